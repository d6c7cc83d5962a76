"""The HTTP servers of --api-server-count N (vLLM's): N processes serve one port (SO_REUSEPORT: the kernel spreads
the connections over them), each an HttpActor with its own event loop, request ledger and engine links, so that the
host's HTTP work (parsing, tokenizing, a stream's events: ~31 us a token on one core) spreads over N cores.
Server k's actor and process are `http_servers(n)[k]` (messages/names.py); N = 1 is one server, as before.

  what they share               how
  the engine                    a request's AddRequest (or PoolRequest) names the server as its client: its output
                                goes there; the engine's and detokenizers' stats go to every server
  /metrics                      answered by server 0 (proxied there; by the server called while 0 cannot be reached):
                                it asks the others (MetricsQuery, within ASK_S) for the series they observe themselves
                                and sums them with its own (frontend/metrics_merge.py: a late server's last report, a
                                dead one's counts carried on); the engine's reports, which every server has, are its own
  a live Response               its id names the server that runs it (`resp_<k:02x>...`): a call about it on another
                                server is proxied to that one's socket in the private run directory (a stream too);
                                one that cannot be reached (restarting: the run is gone) answers from the store
  LoRA runtime updates          loads and unloads are proxied to server 0 (a 503 while it cannot be reached), which
                                tells the others the adapters served and waits for them (ASK_S: a load that one of
                                them did not take is a 503, a retry is idempotent) before it answers; and each server
                                that (re)starts, as it serves (until then it serves those it started with)
  --max-background-responses    each server runs its share (rounded up)

A call proxied carries PROXIED, honoured on the run directory's sockets only: it is answered where it arrives (never
proxied again) and counted once, by the server that took it from the client.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re

import aiohttp
import msgspec
from aiohttp import web
from multidict import CIMultiDict

from actors.engine.config import LoraModule
from frontend.http_base import PROXIED, REQUEST_ID, proxied
from frontend.metrics import CONTENT_TYPE
from frontend.metrics_merge import OtherServers
from messages.names import SUPERVISOR, http_servers
from messages.servers import LorasServed, LorasTaken, MetricsQuery, MetricsReport, ServedLora
from messages.wire import ActorDown, ActorUp

log = logging.getLogger("sluice.http")

ASK_S = 5.0  # another server answers within this (its series, or that it took the adapters served)
HOP_HEADERS = frozenset(("connection", "keep-alive", "transfer-encoding", "date", "server", "host"))
RESPONSE_ID = re.compile(r"resp_([0-9a-f]{2})[0-9a-f]{30}")  # (as frontend/responses_api/endpoint.py makes them)


class ServerGroup:
    def __init__(self, actor, index: int, count: int):
        """`actor`: server `index`'s HttpActor (its metrics, LoRA adapters, router and asks) of `count`."""
        self.actor, self.index, self.count = actor, index, count
        self.names = http_servers(count)
        self.down: set[str] = set()  # other servers known to be down (not asked)
        self.others = OtherServers()  # (server 0's: their series)
        self._sessions: dict[int, aiohttp.ClientSession] = {}  # to the other servers' sockets
        self.incarnation = int.from_bytes(os.urandom(8)) >> 1  # (this process's, in its reports)

    def handlers(self) -> dict:
        return {MetricsQuery: self.report, LorasServed: self.on_loras}

    def socket(self, k: int) -> str:
        return f"{self.actor.router.placement.rundir}/{self.names[k]}.sock"

    async def listen(self, runner: web.AppRunner, host: str, port: int) -> None:
        """The port (shared when there are several servers), and the socket the others proxy calls to."""
        await web.TCPSite(runner, host, port, reuse_port=self.count > 1).start()
        if self.count > 1:
            await web.UnixSite(runner, self.socket(self.index)).start()

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()

    # ------------------------------------------------------------ /metrics

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        """Prometheus text: every server's own series summed, and the engine's reports (server 0's)."""
        if (answer := await self.answered_by(request, 0)) is not None:
            return answer
        asked = [n for n in self.names if n != self.actor.name and n not in self.down]
        asks = (self.actor.ask(n, MetricsQuery(), timeout=ASK_S) for n in asked)
        for name, report in zip(asked, await asyncio.gather(*asks, return_exceptions=True), strict=True):
            if isinstance(report, BaseException):
                log.warning("%s did not report its series (%r): /metrics has its last report", name, report)
            else:
                self.others.reported(name, report)
        body = self.actor.metrics.render(self.others.families())
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    def report(self, msg: MetricsQuery) -> MetricsReport:
        return MetricsReport(families=self.actor.metrics.own(), incarnation=self.incarnation)

    # ------------------------------------------------------------ calls answered by another server

    def owner(self, response_id: str) -> int | None:
        """The server a response id names, if it is another one of this group's."""
        m = RESPONSE_ID.fullmatch(response_id)
        k = int(m.group(1), 16) if m else None
        return k if k is not None and k != self.index and k < self.count else None

    async def answered_by(self, request: web.Request, k: int) -> web.StreamResponse | None:
        """The call proxied to server k, its answer streamed back as it comes; None: answered here (there is no
        other server, the call was proxied here, or k cannot be reached)."""
        if self.count == 1 or k == self.index or proxied(request):
            return None
        session = self._sessions.get(k)
        if session is None:  # (a connection a call: one that k closed is never reused)
            connector = aiohttp.UnixConnector(path=self.socket(k), force_close=True, limit=0)
            session = self._sessions[k] = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        drop = HOP_HEADERS | {"content-encoding", "content-length"}  # (aiohttp decoded the body; it sets the length)
        headers = CIMultiDict((h, v) for h, v in request.headers.items() if h.lower() not in drop)
        headers[PROXIED] = self.actor.name
        body = await self.actor.read_body(request) if request.body_exists else None  # (read already, or not yet)
        try:
            upstream = await session.request(request.method, f"http://{self.names[k]}{request.rel_url}",
                                             headers=headers, data=body,
                                             timeout=aiohttp.ClientTimeout(sock_connect=ASK_S))  # fmt: skip
        except aiohttp.ClientConnectionError as e:  # (down, or it died before answering: its runs are gone)
            log.warning("%s cannot be reached (%s): answering %s here", self.names[k], e, request.rel_url)
            return None
        async with upstream:
            kept = CIMultiDict((h, v) for h, v in upstream.headers.items() if h.lower() not in HOP_HEADERS)
            resp = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=kept)
            try:
                await resp.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
            except ConnectionError:  # (writing to the client; no error of k's answer is one)
                log.info("[%s] client disconnected", request.get(REQUEST_ID, "-"))
            except aiohttp.ClientError as e:  # (k died while answering: the client's connection is cut, as k's was)
                log.warning("%s failed while answering %s (%s): cut short", self.names[k], request.rel_url, e)
                if request.transport is not None:
                    request.transport.abort()
        return resp

    # ------------------------------------------------------------ the other servers coming and going, LoRA adapters

    def on_down(self, msg: ActorDown) -> None:
        if msg.actor in self.names and msg.actor != self.actor.name:
            self.down.add(msg.actor)
            self.others.died(msg.actor)

    def on_up(self, msg: ActorUp) -> None:
        """Server 0 tells a server that came up what it serves, and every server once the system (or server 0,
        restarted) has heard which are down (ActorUp of the supervisor)."""
        if msg.actor in self.names and msg.actor != self.actor.name:
            self.down.discard(msg.actor)
        told = [msg.actor] if msg.actor in self.names[1:] else self.names[1:] if msg.actor == SUPERVISOR else []
        if self.index == 0 and self.actor.lora_api is not None and told:
            self.actor.spawn(self.loras_changed(told))

    async def loras_changed(self, servers: list[str] | None = None) -> list[str]:
        """Server 0 loaded or unloaded an adapter (or `servers` came up): they are told what is served now, and
        answer once they took it. The servers that did not within ASK_S (logged)."""
        served = [msgspec.convert(msgspec.to_builtins(m), ServedLora) for m in self.actor.loras.values()]
        told = [n for n in servers or self.names[1:] if n not in self.down]
        asks = (self.actor.ask(n, LorasServed(modules=served), timeout=ASK_S) for n in told)
        late = [n for n, a in zip(told, await asyncio.gather(*asks, return_exceptions=True), strict=True)
                if isinstance(a, BaseException)]  # fmt: skip
        if late:
            log.warning("%s did not take the LoRA adapters served within %s s", ", ".join(late), ASK_S)
        return late

    def on_loras(self, msg: LorasServed) -> LorasTaken:
        """Server 0's adapters, by name (the whole set); its own are its own."""
        if self.index != 0:
            loras = self.actor.loras  # (changed in place: the serving context holds this dict)
            served = {m.name: msgspec.convert(msgspec.to_builtins(m), LoraModule) for m in msg.modules}
            for name in loras.keys() - served.keys():
                del loras[name]
            loras.update(served)
            self.actor.metrics.lora_names.update({m.digest: name for name, m in served.items()})
        return LorasTaken()

"""The HTTP servers of --api-server-count N (vLLM's): N processes serve one port (SO_REUSEPORT: the kernel spreads
the connections over them), each an HttpActor with its own event loop, request ledger and engine links, so that the
host's HTTP work (parsing, tokenizing, a stream's events: ~31 us a token on one core) spreads over N cores.
Server k's actor and process are `http_server(k)` (messages/names.py); N = 1 is one server, as before.

  what they share               how
  the engine                    a request's AddRequest (or PoolRequest) names the server as its client: its output
                                goes there; the engine's and detokenizers' stats go to every server
  /metrics                      the server scraped asks the others (MetricsQuery, within ASK_S; one that is down or
                                late is left out) for the series they observe themselves and sums them with its own;
                                the engine's reports, which every server has, are its own
  a live Response               its id names the server that runs it (`resp_<k:02x>...`): a call about it on another
                                server is proxied to that one's socket in the private run directory (a stream too);
                                one that cannot be reached (restarting: the run is gone) answers from the store
  LoRA runtime updates          loads and unloads are proxied to server 0 (a 503 while it cannot be reached), which
                                tells the others the adapters served after each, and each server that (re)starts
  --max-background-responses    each server runs its share (rounded up)
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import msgspec
from aiohttp import web

from actors.engine.config import LoraModule
from actors.runtime import AskTimeout
from messages.names import http_servers
from messages.servers import Family, LorasServed, MetricsQuery, MetricsReport, ServedLora
from messages.wire import ActorDown, ActorUp

log = logging.getLogger("sluice.http")

ASK_S = 2.0  # another server's series must come within this (a scrape waits at most this long)
HOP_HEADERS = frozenset(("connection", "keep-alive", "transfer-encoding", "content-length", "date", "server", "host"))


class ServerGroup:
    def __init__(self, actor, index: int, count: int):
        """`actor`: server `index`'s HttpActor (its metrics, LoRA adapters, router and asks) of `count`."""
        self.actor, self.index, self.count = actor, index, count
        self.names = http_servers(count)
        self.down: set[str] = set()  # other servers known to be down (not asked for their series)
        self._sessions: dict[int, aiohttp.ClientSession] = {}  # to the other servers' sockets

    def handlers(self) -> dict:
        return {MetricsQuery: self.report, LorasServed: self.on_loras}

    def socket(self, k: int) -> str:
        return f"{self.actor.router.placement.rundir}/{self.names[k]}.sock"

    async def listen(self, runner: web.AppRunner, host: str, port: int) -> None:
        """The port (shared when there are several servers), and the socket the others proxy calls to."""
        await web.TCPSite(runner, host, port, reuse_port=self.count > 1).start()
        if self.count > 1:
            await web.UnixSite(runner, self.socket(self.index)).start()
            if self.index == 0 and self.actor.lora_api is not None:  # (back from a restart: what it serves now)
                self.loras_changed()

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()

    # ------------------------------------------------------------ /metrics

    async def metrics(self) -> bytes:
        """Prometheus text: every server's own series summed, and the engine's reports as this server has them."""
        asked = [n for n in self.names if n != self.actor.name and n not in self.down]
        reports = await asyncio.gather(*(self._series_of(n) for n in asked))
        return self.actor.metrics.render([f for r in reports for f in r])

    async def _series_of(self, server: str) -> list[Family]:
        try:
            return (await self.actor.ask(server, MetricsQuery(), timeout=ASK_S)).families
        except AskTimeout:
            log.warning("%s did not report its series within %s s: /metrics leaves them out", server, ASK_S)
            return []

    def report(self, msg: MetricsQuery) -> MetricsReport:
        own = self.actor.metrics.registry.collect()
        return MetricsReport(
            families=[Family(m.name, m.documentation, m.type, [s[:3] for s in m.samples]) for m in own]
        )

    # ------------------------------------------------------------ calls answered by another server

    def owner(self, response_id: str) -> int | None:
        """The server a response id names (`response_id`), if it is another one of this group's."""
        try:
            k = int(response_id[5:7], 16) if response_id.startswith("resp_") else None
        except ValueError:
            return None
        return k if k is not None and k != self.index and k < self.count else None

    async def answered_by(self, request: web.Request, k: int) -> web.StreamResponse | None:
        """The call proxied to server k, its answer streamed back as it comes; None if k cannot be reached (or there
        is no other server)."""
        if self.count == 1 or k == self.index:
            return None
        session = self._sessions.get(k)
        if session is None:
            connector = aiohttp.UnixConnector(path=self.socket(k))
            session = self._sessions[k] = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        headers = {h: v for h, v in request.headers.items() if h.lower() not in HOP_HEADERS}
        body = await request.read() if request.body_exists else None  # (read already, or not yet)
        try:
            upstream = await session.request(request.method, f"http://{self.names[k]}{request.rel_url}",
                                             headers=headers, data=body, timeout=aiohttp.ClientTimeout())  # fmt: skip
        except aiohttp.ClientConnectionError as e:
            log.warning("%s cannot be reached (%s): answering %s here", self.names[k], e, request.rel_url)
            return None
        async with upstream:
            kept = {h: v for h, v in upstream.headers.items() if h.lower() not in HOP_HEADERS}
            resp = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=kept)
            await resp.prepare(request)
            async for chunk in upstream.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
        return resp

    # ------------------------------------------------------------ the other servers coming and going, LoRA adapters

    def on_down(self, msg: ActorDown) -> None:
        if msg.actor in self.names:
            self.down.add(msg.actor)

    def on_up(self, msg: ActorUp) -> None:
        if msg.actor in self.names:
            self.down.discard(msg.actor)
            if self.index == 0 and self.actor.lora_api is not None:
                self.actor.tell(msg.actor, self.served())

    def served(self) -> LorasServed:
        loras = self.actor.loras.values()
        return LorasServed(modules=[msgspec.convert(msgspec.to_builtins(m), ServedLora) for m in loras])

    def loras_changed(self) -> None:
        """Server 0 loaded or unloaded an adapter: the others are told what is served now."""
        for name in self.names[1:]:
            self.actor.tell(name, self.served())

    def on_loras(self, msg: LorasServed) -> None:
        loras, names = self.actor.loras, self.actor.metrics.lora_names
        loras.clear()  # (in place: the serving context holds this dict)
        loras.update({m.name: msgspec.convert(msgspec.to_builtins(m), LoraModule) for m in msg.modules})
        names.clear()
        names.update({m.digest: name for name, m in loras.items()})

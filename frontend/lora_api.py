"""Loading and unloading LoRA adapters while serving: vLLM's `POST /v1/load_lora_adapter {"lora_name", "lora_path"}`
and `POST /v1/unload_lora_adapter {"lora_name"}`, served only with --enable-lora-runtime-updates (which needs
--api-key: the endpoints read any directory the server may read).

| request                                              | answer                                                    |
|------------------------------------------------------|-----------------------------------------------------------|
| load a new name, an adapter every replica can serve  | 200 once each replica's scheduler registered it (checked  |
|                                                      | against its model: messages/lora.py); requests name it now |
| load a served name again, the same files             | 200, nothing changes                                      |
| load a served name with other files, or the base's   | 400 naming lora_name (unload it first)                    |
| load an adapter that cannot be served                | 400 naming lora_path and why (gpu/loading/lora.py)        |
| unload a served name                                 | 200: new requests naming it get a 404; running ones end   |
|                                                      | first, then its slot is freed                             |
| unload an unknown name                               | 404 naming it                                             |
| a replica that does not answer within ASK_S          | 503 (the name is not served; a retry is idempotent)       |
| a load another HTTP server did not take in time      | 503 (served by the servers that took it; a retry is       |
| (--api-server-count: frontend/http_servers.py)       | idempotent)                                               |

A replica's scheduler that comes back (a restart: ActorUp) is told again of every adapter served, before the
requests resumed on it (the same link, in order), so their copies find their adapters."""

from __future__ import annotations

import asyncio
import logging

import msgspec
from aiohttp import web

from actors.engine.config import LoraModule
from frontend.body import RequestError
from frontend.http_base import Unavailable, error_response
from messages.lora import RegisterLora, UnregisterLora
from messages.wire import ActorUp

log = logging.getLogger("sluice.http")
ASK_S = 60.0  # a replica checks an adapter's files within this


def refused(status: int, message: str, param: str | None) -> web.Response:
    return error_response(RequestError(status, message, param))


class LoadLora(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str


class UnloadLora(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str


class LoraEndpoints:
    def __init__(self, http) -> None:
        """`http`: the HttpActor (its adapters by name, its context, metrics and replicas)."""
        self.http = http

    def serve(self, app: web.Application) -> None:
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)

    def schedulers(self, up: bool = False) -> list[str]:
        """Every replica's scheduler (`up`: those not down; the others hear of every adapter as they come back)."""
        return [r.names.scheduler for r in self.http.table.replicas.all if not (up and r.names.scheduler in r.down)]

    async def load(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, LoadLora)
        if isinstance(body, web.StreamResponse):
            return body
        name, loras = body.lora_name, self.http.loras
        if name in self.http.names:
            return refused(400, f"lora_name {name!r} is the served model's name", "lora_name")
        schedulers = self.schedulers(up=True)
        if not schedulers:
            return refused(503, "no engine replica serves now; retry", None)
        try:
            answers = await asyncio.gather(
                *(self.http.ask(s, RegisterLora(path=body.lora_path), timeout=ASK_S) for s in schedulers)
            )
        except TimeoutError:
            return refused(503, "an engine replica did not answer in time; retry", None)
        digest, error = answers[0].digest, next((a.error for a in answers if a.error), None)
        if error is None and any(a.digest != digest for a in answers):
            error = "the replicas read different files"
        if error is None and name in loras and loras[name].digest != digest:
            self._forget({a.digest for a in answers}, schedulers)
            return refused(400, f"lora_name {name!r} is served with other files: unload it first", "lora_name")
        if error is not None:
            self._forget({a.digest for a in answers if a.digest}, schedulers)
            return refused(400, f"lora_path: {error}", "lora_path")
        loras[name] = LoraModule(name=name, path=body.lora_path, digest=digest)
        for late in set(self.schedulers()) - set(schedulers):  # (back while it loaded: its on_up knew no such name)
            self.http.tell(late, RegisterLora(path=body.lora_path, digest=digest, reply_to=self.http.name))
        self.http.metrics.lora_names[digest] = name
        if late := await self.http.group.loras_changed():
            return error_response(Unavailable(f"HTTP server {', '.join(late)} did not take the adapter in time", 1))
        log.info("LoRA adapter %s loaded from %s (%s)", name, body.lora_path, digest)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, UnloadLora)
        if isinstance(body, web.StreamResponse):
            return body
        module = self.http.loras.pop(body.lora_name, None)
        if module is None:
            return refused(404, f"The LoRA adapter `{body.lora_name}` does not exist.", "lora_name")
        self._forget({module.digest}, self.schedulers())
        await self.http.group.loras_changed()
        log.info("LoRA adapter %s unloaded", body.lora_name)
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    def _forget(self, digests: set[str], schedulers: list[str]) -> None:
        """Unregister these adapters (those no served name holds) in these schedulers."""
        for digest in digests - {m.digest for m in self.http.loras.values()}:
            for scheduler in schedulers:
                self.http.tell(scheduler, UnregisterLora(digest=digest))

    def on_up(self, msg: ActorUp) -> None:
        """A scheduler back: every adapter served, registered again now, before the copies of its requests go out
        (module docstring); the answers are not waited for (a failure shows in the engine's log)."""
        if msg.actor in self.schedulers():
            for module in {m.digest: m for m in self.http.loras.values()}.values():
                self.http.tell(msg.actor, RegisterLora(path=module.path, digest=module.digest, reply_to=self.http.name))

    async def _body(self, request: web.Request, kind):
        """The body, or the answer: server 0's, which alone loads and unloads (frontend/http_servers.py), or an error."""
        if self.http.group.index != 0:
            if (proxied := await self.http.group.answered_by(request, 0)) is not None:
                return proxied
            return refused(503, "the HTTP server that loads adapters (server 0) cannot be reached; retry", None)
        try:
            return msgspec.json.decode(await self.http.read_body(request), type=kind)
        except msgspec.ValidationError as e:
            return refused(400, f"invalid body: {e}", None)
        except msgspec.DecodeError as e:
            return refused(400, f"the body is not JSON: {e}", None)

"""HttpActor: the OpenAI-compatible aiohttp server, run on the actor's own event loop.

Handlers parse and tokenize (in the default executor for large bodies), register the request in
the RequestTable (which sends one AddRequest per choice to the scheduler) and then wait on the
request's `wake` event: the actor's message handlers only buffer outputs and set it, so no engine
message ever waits for a client. A client that goes away (a failed write, or the handler cancelled
on disconnect: `handler_cancellation=True`) tombstones its request and aborts it in the engine. Until every engine
replica has loaded, and while none can take requests, they get a 503 with Retry-After (frontend/readiness.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import msgspec
from aiohttp import web

from actors.engine.config import LoraModule
from actors.engine.grammar import WARM_IDLE_S, warm
from actors.routing import Replicas
from actors.runtime import Actor
from frontend.context import ServingContext
from frontend.http_base import REQUEST_ID, STREAM_ERROR, HttpConfig, error_response, json_response, middleware
from frontend.http_servers import ServerGroup
from frontend.lora_api import LoraEndpoints
from frontend.metrics import Metrics
from frontend.pool_ledger import PoolLedger
from frontend.protocol import RequestError, new_request_id, parse_chat, parse_completion
from frontend.readiness import Readiness
from frontend.request_state import HttpRequest
from frontend.requests import RequestTable
from frontend.responses import response_body, stream_events, stream_head, stream_tail
from frontend.responses_api.endpoint import ResponsesEndpoint
from frontend.routes import add_routes
from frontend.structured import compile_check
from frontend.throughput_log import ThroughputLog
from frontend.tokenizer import Tokenizer
from messages.names import HTTP
from messages.wire import ActorDown, ActorUp, CheckIdle, DetokStats, EngineStats, Finished, IdleReport, TextOutputs

log = logging.getLogger("sluice.http")

ENGINE_HEADER = "X-Sluice-Engine"  # the engine replica that took the request (--data-parallel-size)
PARSE_INLINE_BYTES = 16 << 10  # larger bodies are parsed and tokenized off the event loop
LARGE_READS, LARGE_PARSES = 32, 4  # large bodies read / parsed at once (the rest wait, unread)


class HttpActor(Actor):
    name = HTTP

    def __init__(
        self,
        model: str,
        http: dict,
        max_model_len: int,
        vocab_size: int,
        bos_token_id: int | None = None,
        replicas: int = 1,
        block_size: int = 16,
        local_replicas: int | None = None,
        loras: list[dict] = (),
        pooling: dict | None = None,
        server: int = 0,
    ):
        """The engine's facts: `max_model_len`, `vocab_size`, `bos_token_id` (whether the model has a BOS to guide
        against), its `replicas` (--data-parallel-size; `local_replicas` of them on this node, None: all) and their KV
        `block_size` (what the router hashes); the LoRA adapters it serves (`loras`: LoraModules). `pooling` (a
        model served for pooling: frontend/pool_ledger.py PoolFacts): the pooling endpoints instead of generation's.
        `server`: which of the --api-server-count servers this is (frontend/http_servers.py)."""
        super().__init__()
        self.config = msgspec.convert(http, HttpConfig)
        self.model = model
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.loras = {m["name"]: msgspec.convert(m, LoraModule) for m in loras}
        self.names = self.config.served_model_name or [Path(model).name]
        c = self.config
        routing = Replicas(replicas, c.dp_routing, block_size)
        self.metrics = Metrics(c.metrics_prefix, self.names[0], routing)  # (vLLM's model_name: the first name)
        self.metrics.lora_names = {m.digest: name for name, m in self.loras.items()}
        self.table = RequestTable(
            self.tell, self.metrics, c.abort_timeout_s, c.max_abort_tries, c.max_resumes, c.stream_interval
        )
        self.readiness = Readiness(self.table, c.url, self.names, local_replicas)  # (503 until every replica is ready)
        self.admitting = True
        self.created = int(time.time())
        self.runner: web.AppRunner | None = None
        self.lora_api: LoraEndpoints | None = None  # (--enable-lora-runtime-updates)
        self.responses: ResponsesEndpoint | None = None  # (generation)
        self.pooling = None if pooling is None else PoolLedger(self, pooling)
        self.group = ServerGroup(self, server, c.api_server_count)
        self._large_reads, self._large_parses = asyncio.Semaphore(LARGE_READS), asyncio.Semaphore(LARGE_PARSES)

    def handlers(self):
        return (
            {
                TextOutputs: self.table.on_outputs,
                Finished: self.table.on_finished,
                EngineStats: lambda msg: (self.metrics.on_engine_stats(msg), self.table.replicas.on_stats(msg)),
                DetokStats: self.metrics.on_detok_stats,
                ActorDown: self.on_down,
                ActorUp: self.on_up,
                CheckIdle: self.on_check,
            }
            | self.group.handlers()
            | (self.pooling.handlers() if self.pooling else {})
        )

    async def on_start(self) -> None:
        """Asks are answered only after this returns: the launcher's first answered ask means "listening"."""
        c = self.config
        tokenizer = Tokenizer.from_model_dir(self.model, c.chat_template)
        names = self.names
        self.ctx = ServingContext(
            tokenizer, names, self.max_model_len, self.vocab_size, c.limits, self.model, c.grammar_timeout_s,
            c.tool_call_parser, self.bos_token_id, c.reasoning_parser, self.loras, "pooling" if self.pooling else "generate",
        )  # fmt: skip
        app = web.Application(
            client_max_size=self.config.max_body_bytes, middlewares=[middleware(self.config, self.metrics)]
        )
        self.lora_api = LoraEndpoints(self) if c.lora_runtime_updates else None
        add_routes(app, self)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await self.runner.setup()
        await self.group.listen(self.runner, c.host, c.port)
        log.info("listening at %s: 503 until every engine replica has loaded its model", self.config.url)
        self.spawn(self._housekeeping())

    # ------------------------------------------------------------ actor messages

    def on_up(self, msg: ActorUp) -> None:
        self.group.on_up(msg)
        if self.lora_api is not None:  # (first: a scheduler back hears of its adapters before its requests' copies)
            self.lora_api.on_up(msg)
        if self.pooling is not None:
            self.pooling.on_up(msg)
        self.readiness.on_up(msg)

    def on_down(self, msg: ActorDown) -> None:
        self.group.on_down(msg)
        if self.pooling is not None:
            self.pooling.on_down(msg)
        self.readiness.on_down(msg)

    def on_check(self, msg: CheckIdle) -> IdleReport:
        details = self.table.idle_details
        e = self.pooling
        details = details | ({"pooling": len(e.pending)} if e else {"responses": len(self.responses.runs)})
        return IdleReport(actor=self.name, idle=not any(details.values()), details=details)

    async def on_shutdown(self, reason: str) -> None:
        """Runs once (Actor.drain), while the handlers go on: the Finished it waits for arrive meanwhile."""
        self.admitting = False
        if self.pooling is not None and self.pooling.pending:  # (answered as their AbortAcks come)
            self.pooling.abort_all("shutdown")
            await self.until(lambda: not self.pooling.pending, self.config.drain_timeout_s)
            self.pooling.fail_all("aborted (shutdown): the server is shutting down")
        if self.table.live:
            log.info("shutdown (%s): aborting %d requests", reason, len(self.table.live))
            self.table.abort_all("shutdown")
            await self.until(lambda: not self.table.live, self.config.drain_timeout_s)
            self.table.fail_all(RequestError(503, "the server is shutting down"), send_abort=False)
        if self.runner is not None:
            await self.runner.cleanup()
        await self.group.close()
        if self.responses is not None:
            await self.until(lambda: not self.responses.runs, self.config.drain_timeout_s)  # (their last writes)
            await self.responses.store.close()

    async def _housekeeping(self) -> None:
        every = self.config.log_stats_interval_s * (self.group.index == 0)  # (the engine's figures: one server's)
        pulse = ThroughputLog(self.metrics, time.monotonic(), every)
        warm_at = time.monotonic() + WARM_IDLE_S  # (the grammar compiler's, once serving and idle that long)
        while True:
            await asyncio.sleep(min(0.5, self.config.abort_timeout_s / 2))
            if warm_at and (self.table.live or not self.readiness.started):
                warm_at = time.monotonic() + WARM_IDLE_S
            elif warm_at and time.monotonic() >= warm_at and self.pooling is None:
                warm_at = 0.0
                warm(self.model, self.vocab_size, tuple(self.ctx.tokenizer.eos_token_ids))
            self.table.expire(time.monotonic())
            self.moved()  # (a drain waits for the table to empty)
            try:
                for line in pulse.lines(time.monotonic()) if every else ():
                    log.info("%s", line)
            except Exception:  # (never the housekeeping's end)
                log.exception("the throughput line failed")

    # ------------------------------------------------------------ HTTP

    def check_available(self, health: bool = False) -> None:
        """503 if no request can be taken now (`health`: or no replica serves); Retry-After: frontend/readiness.py."""
        if not self.admitting:
            raise RequestError(503, "the server is shutting down")
        if (refusal := self.readiness.refusal(health)) is not None:
            raise refusal

    async def health(self, request: web.Request) -> web.Response:
        """200 once every engine replica has loaded its model, while one serves (every actor of it up)."""
        self.check_available(health=True)
        return web.Response()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion, "cmpl")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat, "chatcmpl")

    async def _generate(self, request: web.Request, parse, prefix: str) -> web.StreamResponse:
        self.check_available()
        request[REQUEST_ID] = rid = new_request_id(prefix)
        parsed = await self.parse_body(request, parse, rid)
        if parsed.grammar_param is not None:
            await compile_check(parsed.prompts[0].params.structured, parsed.grammar_param, self.ctx)
        self.check_available()  # an actor may have died while we parsed
        req = self.table.add(parsed, self.name)
        engine = req.choices[0].record.replica.index  # (the replica that took it: a death may move it on)
        stream = ", stream" if parsed.stream else ""
        log.info("[%s] %s: %d prompt tokens, %d choices%s, engine %d", rid, request.path, req.num_prompt_tokens,
                 len(req.choices), stream, engine)  # fmt: skip
        headers = {ENGINE_HEADER: str(engine)}
        try:
            return await (self._stream(request, req, headers) if parsed.stream else self._respond(req, headers))
        finally:
            if not req.done:  # the client went away (a failed write, or this handler was cancelled)
                self.table.cancel(req, "client")
                self.moved()

    async def parse_body(self, request: web.Request, parse, rid: str):
        """`parse(body, ctx, rid)`: small bodies are parsed inline. Large ones (or of unknown length) are read
        LARGE_READS at a time, each within body_timeout_s (a client that stops sending gets a 408 and frees its
        place), and parsed LARGE_PARSES at a time, off the event loop: a flood of 16 MB bodies waits in the
        kernel's socket buffers, not in our memory."""
        if not self.large(request):
            return parse(await self.read_body(request), self.ctx, rid)
        async with self._large_reads:
            body = await self.read_body(request)
        return await self.off_loop(True, parse, body, self.ctx, rid)

    @staticmethod
    def large(request: web.Request) -> bool:
        return request.content_length is None or request.content_length > PARSE_INLINE_BYTES

    async def off_loop(self, large: bool, fn, *args):
        """`fn(*args)`: inline, or when `large`, off the event loop (LARGE_PARSES at a time)."""
        if not large:
            return fn(*args)
        async with self._large_parses:
            return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def read_body(self, request: web.Request) -> bytes:
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                return await request.read()
        except TimeoutError:
            raise RequestError(408, f"the request body did not arrive within {self.config.body_timeout_s} s") from None

    async def _respond(self, req: HttpRequest, headers: dict[str, str]) -> web.Response:
        while not req.done:
            await req.wake.wait()
            req.wake.clear()
        ok = req.error is None
        resp = json_response(response_body(req, self.ctx.tokenizer)) if ok else error_response(req.error)
        resp.headers.update(headers)
        return resp

    async def _stream(self, request: web.Request, req: HttpRequest, headers: dict[str, str]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
        await resp.prepare(request)
        try:
            data = stream_head(req)
            while True:  # each pass writes everything buffered meanwhile, one event per choice
                data += stream_events(req, self.ctx.tokenizer)
                done = req.done
                if done:
                    data += stream_tail(req)
                    if req.error is not None:
                        request[STREAM_ERROR] = req.error
                if data:
                    await resp.write(data)
                if done:
                    break
                await req.wake.wait()
                req.wake.clear()
                data = b""
            await resp.write_eof()
        except ConnectionError:
            log.info("[%s] client disconnected", req.id)
        return resp

"""The offline API (like vLLM's `LLM.generate`), built on the same actors as the server.

`AsyncLLM` launches the engine and detokenizer processes and hosts a client actor in the
caller's process; `LLM` is a synchronous wrapper for scripts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from actors.engine.config import DETOKENIZER, SCHEDULER, EngineConfig
from actors.graph import engine_processes
from actors.protocol import MAX_ATTEMPTS, RecentIds, RequestRecord
from actors.runtime import Actor, ActorSystem, FaultPlan, RestartPolicy
from frontend.tokenizer import Tokenizer
from messages.sampling_params import SamplingParams
from messages.wire import (
    Abort,
    ActorDown,
    ActorUp,
    AddRequest,
    CheckIdle,
    DetokStats,
    EngineStats,
    Finished,
    TextDelta,
    TextOutputs,
    TokenLogprobs,
)

CLIENT = "client"

log = logging.getLogger("sluice.offline")


@dataclass
class Completion:
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    logprobs: TokenLogprobs | None = None  # params.logprobs: aligned with token_ids
    prompt_logprobs: TokenLogprobs | None = None  # params.prompt_logprobs: aligned with the prompt after its first
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache


@dataclass
class Stream:
    record: RequestRecord  # what was sent, what arrived (DESIGN I6, I8)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class ClientActor(Actor):
    """Routes TextOutputs / Finished to one queue per request, checking each stream's seq (DESIGN I6).

    A duplicate delta is dropped, so is an older copy's (stale); a gap (a lost or reordered TextOutputs, or a
    Finished that reports more tokens than arrived) re-submits the request from what the stream has, as does an
    engine-side death once the request path is whole again (DESIGN I8; a stream live at more than `max_resumes`
    deaths, or one that had MAX_ATTEMPTS copies, ends with an error). Output for a stream that has ended is
    counted: `outputs_after_finished` when it brings tokens past the count its Finished reported (a protocol
    bug), `late_outputs` otherwise (a duplicate, a message the link reordered behind the Finished, or a stream
    ended here)."""

    name = CLIENT

    def __init__(self, max_resumes: int = 2):
        super().__init__()
        self.max_resumes = max_resumes
        self.streams: dict[str, Stream] = {}
        self.ended = RecentIds()  # request id -> the tokens its Finished accounts for
        self.down: set[str] = set()  # actors of the request path that are down
        self.engine_stats: EngineStats | None = None
        self.detok_stats: DetokStats | None = None
        self.duplicates = self.gaps = self.stale = self.resumes = self.late_outputs = self.outputs_after_finished = 0

    def handlers(self):
        return {
            TextOutputs: self.on_text,
            Finished: self.on_finished,
            EngineStats: lambda m: setattr(self, "engine_stats", m),
            DetokStats: lambda m: setattr(self, "detok_stats", m),
            ActorDown: self.on_down,
            ActorUp: self.on_up,
        }

    def add(self, msg: AddRequest) -> Stream:
        stream = self.streams[msg.request_id] = Stream(RequestRecord(msg))
        self.tell(SCHEDULER, msg)
        return stream

    def on_text(self, msg: TextOutputs) -> None:
        for delta in msg.deltas:
            stream = self.streams.get(delta.request_id)
            if stream is None:
                self._late(delta.request_id, delta.seq + len(delta.token_ids))
                continue
            match stream.record.check(delta.seq, len(delta.token_ids), delta.attempt):
                case "ok":
                    stream.record.received(delta.text, delta.token_ids)
                    stream.queue.put_nowait(delta)
                case "stale":
                    self.stale += 1
                case "duplicate":
                    self.duplicates += 1
                case "gap":
                    self._gap(delta.request_id, f"delta seq {delta.seq}, expected {stream.record.num_tokens}")
        for fin in msg.finished:
            self.on_finished(fin)

    def on_finished(self, msg: Finished) -> None:
        rid = msg.request_id
        stream = self.streams.get(rid)
        if stream is None:
            self._late(rid, msg.num_output_tokens)
        elif msg.attempt < stream.record.attempt:
            self.stale += 1
        elif msg.finish_reason != "error" and stream.record.num_tokens < msg.num_output_tokens - len(msg.token_ids):
            self._gap(rid, f"Finished after {msg.num_output_tokens} tokens, {stream.record.num_tokens} received")
        else:
            self._end(rid, msg)
            self.ended.remember(rid, max(stream.record.num_tokens + len(msg.token_ids), msg.num_output_tokens))

    def on_down(self, msg: ActorDown) -> None:
        if msg.actor in (SCHEDULER, DETOKENIZER):
            self.down.add(msg.actor)  # the streams wait: the engine side forgets every request

    def on_up(self, msg: ActorUp) -> None:
        self.down.discard(msg.actor)
        if self.down:
            return
        for rid, stream in list(self.streams.items()):
            stream.record.deaths += 1
            if stream.record.deaths > self.max_resumes:
                self._fail(rid, f"failed after {self.max_resumes} restarts of the engine side while it ran")
            else:
                self._resume(rid, "death")

    def fail_all(self, error: str) -> None:
        for rid in list(self.streams):
            self._fail(rid, error)

    def stop(self) -> None:
        """The system stopped (also when it gave up restarting a process): no stream waits on."""
        self.fail_all("the system stopped")
        super().stop()

    def _end(self, rid: str, msg: Finished) -> None:
        self.streams.pop(rid).queue.put_nowait(msg)

    def _gap(self, rid: str, what: str) -> None:
        self.gaps += 1
        self._resume(rid, f"lost output: {what}")

    def _resume(self, rid: str, why: str) -> None:
        """Re-submit the request from what its stream has; one that had MAX_ATTEMPTS copies fails."""
        msg = self.streams[rid].record.resume()
        if msg is None:
            self._fail(rid, f"{why}; failed after {MAX_ATTEMPTS} resumptions", abort=True)
            return
        self.resumes += 1
        log.info("[%s] resumed after %d tokens (%s)", rid, len(msg.resume_token_ids), why)
        self.tell(SCHEDULER, msg)

    def _fail(self, rid: str, error: str, abort: bool = False) -> None:
        received = self.streams[rid].record.num_tokens
        self._end(rid, Finished(request_id=rid, finish_reason="error", error=error, num_output_tokens=received))
        if abort:  # the engine may still run it
            self.tell(SCHEDULER, Abort(request_id=rid, reason="error"))

    def _late(self, rid: str, end: int) -> None:
        final = self.ended.get(rid)
        if final is not None and end > final:
            self.outputs_after_finished += 1
            log.error("[%s] output after its Finished (%d tokens past %d)", rid, end, final)
        else:
            self.late_outputs += 1


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        fault_plan: FaultPlan | None = None,
        policy: RestartPolicy | None = None,
        log_level: str = "WARNING",
    ):
        self.config = config
        self.tokenizer = Tokenizer.from_model_dir(config.model)
        self.client = ClientActor()
        self.system = ActorSystem(
            engine_processes(config, CLIENT),
            local=[self.client],
            fault_plan=fault_plan,
            policy=policy,
            log_level=log_level,
        )
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]

    async def __aenter__(self) -> AsyncLLM:
        await self.system.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.system.stop()

    def new_id(self) -> str:
        return f"offline-{self._prefix}-{next(self._ids)}"

    async def stream(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[TextDelta | Finished]:
        """Yields TextDeltas, then exactly one Finished."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        rid = request_id or self.new_id()
        stream = self.client.add(
            AddRequest(request_id=rid, prompt_token_ids=ids, params=params, arrival_time=time.time(), client=CLIENT)
        )
        while True:
            item = await stream.queue.get()
            yield item
            if isinstance(item, Finished):
                return

    async def generate_one(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> Completion:
        out, logprobs = Completion(request_id=request_id or self.new_id()), []
        async for item in self.stream(prompt, params, out.request_id):
            out.text += item.text
            out.token_ids += item.token_ids
            if item.logprobs is not None:
                logprobs.append(item.logprobs)
            if isinstance(item, Finished):
                out.finish_reason, out.stop_reason, out.error = item.finish_reason, item.stop_reason, item.error
                out.num_prompt_tokens, out.prompt_logprobs = item.num_prompt_tokens, item.prompt_logprobs
                out.num_cached_tokens = item.num_cached_tokens
        out.logprobs = TokenLogprobs.join(logprobs) if params.logprobs is not None else None
        return out

    async def generate(
        self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Completion]:
        per = params if isinstance(params, list) else [params] * len(prompts)
        return list(await asyncio.gather(*(self.generate_one(p, sp) for p, sp in zip(prompts, per, strict=True))))

    def abort(self, request_id: str, reason: str = "client") -> None:
        """Explicit abort: the request ends with finish_reason "abort" (or its natural end if that won)."""
        self.client.tell(SCHEDULER, Abort(request_id=request_id, reason=reason))

    async def idle_reports(self) -> dict[str, dict[str, int]]:
        """The idle invariant's view of every request-path actor: all zero when idle."""
        reports = {}
        for actor in (SCHEDULER, DETOKENIZER):
            report = await self.client.ask(actor, CheckIdle(), timeout=10)
            reports[actor] = report.details
        reports[CLIENT] = {"streams": len(self.client.streams), "pending_asks": self.client.pending_asks}
        return reports

    async def fresh_stats(self) -> tuple[EngineStats, DetokStats]:
        """The engine's and the detokenizer's counters, as published after this call."""
        old = self.client.engine_stats, self.client.detok_stats
        while self.client.engine_stats is old[0] or self.client.detok_stats is old[1]:
            await asyncio.sleep(0.01)
        return self.client.engine_stats, self.client.detok_stats


class LLM:
    """Synchronous wrapper: `LLM(config).generate(prompts, params)`; close() when done."""

    def __init__(self, config: EngineConfig, **kwargs):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="sluice-llm")
        self._thread.start()
        self._llm = AsyncLLM(config, **kwargs)
        self._call(self._llm.__aenter__())

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(
        self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Completion]:
        return self._call(self._llm.generate(prompts, params))

    def close(self) -> None:
        self._call(self._llm.__aexit__(None, None, None))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

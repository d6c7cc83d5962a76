"""The offline API (like vLLM's `LLM.generate`), built on the same actors as the server.

`AsyncLLM` launches the engine and detokenizer processes and hosts a client actor in the
caller's process; `LLM` is a synchronous wrapper for scripts.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from actors.engine.config import DETOKENIZER, SCHEDULER, EngineConfig
from actors.graph import engine_processes
from actors.runtime import Actor, ActorSystem, FaultPlan, RestartPolicy
from frontend.tokenizer import Tokenizer
from messages.sampling_params import SamplingParams
from messages.wire import (
    Abort,
    ActorDown,
    AddRequest,
    CheckIdle,
    DetokStats,
    EngineStats,
    Finished,
    TextDelta,
    TextOutputs,
)

CLIENT = "client"


@dataclass
class Completion:
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0


class ClientActor(Actor):
    """Routes TextOutputs / Finished to one queue per request."""

    name = CLIENT

    def __init__(self):
        super().__init__()
        self.streams: dict[str, asyncio.Queue] = {}
        self.engine_stats: EngineStats | None = None
        self.detok_stats: DetokStats | None = None

    def handlers(self):
        return {
            TextOutputs: self.on_text,
            Finished: self.on_finished,
            EngineStats: lambda m: setattr(self, "engine_stats", m),
            DetokStats: lambda m: setattr(self, "detok_stats", m),
            ActorDown: self.on_down,
        }

    def on_text(self, msg: TextOutputs) -> None:
        for delta in msg.deltas:
            if delta.request_id in self.streams:
                self.streams[delta.request_id].put_nowait(delta)
        for fin in msg.finished:
            self.on_finished(fin)

    def on_finished(self, msg: Finished) -> None:
        queue = self.streams.pop(msg.request_id, None)
        if queue is not None:
            queue.put_nowait(msg)

    def on_down(self, msg: ActorDown) -> None:
        if msg.actor in (SCHEDULER, DETOKENIZER):
            for rid in list(self.streams):
                self.on_finished(Finished(request_id=rid, finish_reason="error", error=f"{msg.actor} died"))


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
        queue = self.client.streams[rid] = asyncio.Queue()
        self.client.tell(
            SCHEDULER,
            AddRequest(request_id=rid, prompt_token_ids=ids, params=params, arrival_time=time.time(), client=CLIENT),
        )
        while True:
            item = await queue.get()
            yield item
            if isinstance(item, Finished):
                return

    async def generate_one(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> Completion:
        out = Completion(request_id=request_id or self.new_id())
        async for item in self.stream(prompt, params, out.request_id):
            out.text += item.text
            out.token_ids += item.token_ids
            if isinstance(item, Finished):
                out.finish_reason, out.stop_reason, out.error = item.finish_reason, item.stop_reason, item.error
                out.num_prompt_tokens = item.num_prompt_tokens
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
        """The idle invariant's view of every request-path actor."""
        reports = {}
        for actor in (SCHEDULER, DETOKENIZER):
            report = await self.client.ask(actor, CheckIdle(), timeout=10)
            reports[actor] = report.details
        return reports


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

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

from actors.engine.config import EngineConfig
from actors.graph import engine_processes
from actors.routing import Policy, Replicas
from actors.runtime import ActorSystem, FaultPlan, RestartPolicy
from frontend.offline_client import ClientActor
from frontend.tokenizer import Tokenizer
from messages.names import CLIENT, replica
from messages.sampling_params import SamplingParams
from messages.wire import (
    Abort,
    AbortReason,
    AddRequest,
    CheckIdle,
    DetokStats,
    EngineStats,
    Finished,
    TextDelta,
    TokenLogprobs,
)


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


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        fault_plan: FaultPlan | None = None,
        policy: RestartPolicy | None = None,
        log_level: str = "WARNING",
        dp_routing: Policy = "cache_aware",
    ):
        """`dp_routing`: which replica a request goes to, with config.data_parallel_size > 1 (actors/routing.py).
        Without a `policy`, an engine past its restart intensity stops the system (its caller awaits its streams: a
        library does not wait out a back-off as a server does)."""
        if config.local_replicas < config.data_parallel_size:
            raise ValueError("the offline API runs every replica itself (replicas on other nodes join a server)")
        self.config = config
        self.tokenizer = Tokenizer.from_model_dir(config.model)
        replicas = Replicas(config.data_parallel_size, dp_routing, config.block_size)
        self.client = ClientActor(replicas=replicas, abort_timeout_s=config.abort_timeout_s,
                                  max_abort_tries=config.max_abort_tries)  # fmt: skip
        self.system = ActorSystem(
            engine_processes(config, [CLIENT]),
            local=[self.client],
            fault_plan=fault_plan,
            policy=policy or RestartPolicy(exit_past_intensity=True),
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

    def abort(self, request_id: str, reason: AbortReason = "client") -> None:
        """Explicit abort: the request ends with finish_reason "abort" (or its natural end if that won)."""
        stream = self.client.streams.live.get(request_id)
        scheduler = (stream.record.replica.names if stream is not None else replica(0)).scheduler
        self.client.tell(scheduler, Abort(request_id=request_id, reason=reason))

    async def idle_reports(self) -> dict[str, dict[str, int]]:
        """The idle invariant's view of every request-path actor: all zero when idle."""
        reports = {}
        for actor in self.engine_actors():
            report = await self.client.ask(actor, CheckIdle(), timeout=10)
            reports[actor] = report.details
        reports[CLIENT] = {**self.client.streams.idle_details, "pending_asks": self.client.pending_asks}
        return reports

    def engine_actors(self) -> list[str]:
        """Every replica's scheduler and detokenizer, and its worker where it has a process."""
        process = self.config.placed().worker == "process"
        dp = self.config.data_parallel_size
        return [a for k in range(dp) for a in replica(k).actors if process or a != replica(k).worker]

    async def fresh_stats(self) -> tuple[EngineStats, DetokStats]:
        """The engine's and the detokenizer's counters, as published after this call."""
        old, client = (self.client.engine_stats, self.client.detok_stats), self.client
        if not await client.until(lambda: client.engine_stats is not old[0] and client.detok_stats is not old[1], 30):
            raise TimeoutError("no fresh counters from the engine and the detokenizer within 30 s")
        return client.engine_stats, client.detok_stats


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

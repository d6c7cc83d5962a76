"""The scheduler's side of the worker: where ExecuteSteps go and StepResults come from (the executor interface).

`submit(msg)` hands an ExecuteStep over and returns a handle; `await result(handle)` gives its StepResult, or
raises WorkerLost when it will never come: the worker died, answered with an error (a gap, a failed step), a
later step's result came first (this one was lost) or none came within `step_timeout_s`. The scheduler then
resets the worker (actors/engine/scheduler_actor.py: a new epoch, every running request recomputed) and
`await ready()` before it submits again. `fill(msg)` delivers deferred grammar masks.

- InlineWorker: the Worker in this process; each ExecuteStep runs on the device thread (the in-process mailbox:
  the message object is handed over as is, never serialized).
- ProcessWorker: a WorkerActor (actors/engine/worker_actor.py) in a process of its own, over its mailbox; the
  supervisor restarts it when it dies (ActorDown, then ActorUp).

The scheduler does not know how many workers are behind the link: tensor parallelism would fan an ExecuteStep out
to one worker per device and answer with the first rank's StepResult.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

from actors.engine.grammar_masks import StepMasks
from actors.engine.request import EngineRequest
from actors.engine.worker import Launched, Worker
from actors.runtime import Actor
from gpu.batch import BatchSpec
from messages.names import WORKER
from messages.step import BLAMING_FAILURES, ExecuteStep, FillMasks, StepFailure, StepResult, WorkerRequest


def execute_step(
    batch: BatchSpec, requests: dict[str, EngineRequest], epoch: int, seq: int, freed: list[str]
) -> tuple[ExecuteStep, StepMasks | None]:
    """A scheduled batch's ExecuteStep: the full state of the sampling requests new to the worker, the output
    deltas of the others, the top-N of the prompt logprobs, and the grammar masks (the StepMasks keeps the
    deferred rows: FillMasks once the step before is postprocessed)."""
    new, appended, top_n, masks, position = [], {}, 0, None, 0
    for row in batch.rows:
        req = requests[row.request_id]
        if row.prompt_targets:
            top_n = max(top_n, req.params.prompt_logprobs)
        if not row.num_samples:
            continue
        known = len(req.output_token_ids)
        if req.worker_outputs < 0:
            new.append(WorkerRequest(req.request_id, req.prompt_token_ids, req.output_token_ids[:], req.params))
        elif known > req.worker_outputs:
            appended[req.request_id] = req.output_token_ids[req.worker_outputs :]
        req.worker_outputs = known
        if req.grammar is not None:
            masks = masks or StepMasks(req.grammar.vocab_size)
            masks.add(req.grammar, position, row.draft_token_ids, defer=req.num_pending_tokens > 1)
        position += row.num_samples
    msg = ExecuteStep(
        epoch=epoch, seq=seq, batch=batch, new=new, appended=appended, freed=freed, num_prompt_logprobs=top_n,
        masks=masks and masks.wire(),
    )  # fmt: skip
    return msg, masks


class WorkerLost(Exception):
    """A submitted step's StepResult will never come (the message says why). `blames` the step's requests when
    the worker died or the step failed there (one of them may be a poison request), not when a message was lost."""

    def __init__(self, failure: StepFailure, reason: str):
        super().__init__(reason)
        self.failure = failure

    @property
    def blames(self) -> bool:
        return self.failure in BLAMING_FAILURES


DIED = "the worker died"


def _checked(result: StepResult) -> StepResult:
    if result.failure is not None:
        raise WorkerLost(result.failure, result.error or result.failure)
    return result


class InlineWorker:
    reset_due = False  # (it dies with the scheduler)

    def __init__(self, worker: Worker, device: concurrent.futures.Executor, on_device: bool):
        self.worker, self._device, self._on_device = worker, device, on_device

    def submit(self, msg: ExecuteStep) -> asyncio.Future[Launched | None]:
        self.worker.abandon(msg.epoch)
        return asyncio.get_running_loop().run_in_executor(self._device, self.worker.launch, msg)

    async def result(self, handle: asyncio.Future[Launched | None]) -> StepResult:
        launched = await handle
        if launched is None:
            raise WorkerLost("gap", "the worker ignored a step (stale epoch)")
        if not self._on_device:  # on the host already: the lists are ready
            return _checked(launched.result())
        return _checked(await asyncio.get_running_loop().run_in_executor(None, launched.result))

    def fill(self, msg: FillMasks) -> None:
        self.worker.fill(msg)

    def lost(self, failure: StepFailure, reason: str) -> None:
        """(The inline worker dies with the scheduler.)"""

    async def ready(self) -> None:
        """Always."""


class ProcessWorker:
    def __init__(self, actor: Actor, timeout_s: float):
        self.actor, self.timeout_s = actor, timeout_s
        self.pending: dict[tuple[int, int], asyncio.Future[StepResult]] = {}  # (epoch, seq) -> its result
        self.up = asyncio.Event()
        self.up.set()
        self.reset_due = False  # it died: its state is gone, even with no step in flight (the scheduler resets)

    def submit(self, msg: ExecuteStep) -> asyncio.Future[StepResult]:
        future = asyncio.get_running_loop().create_future()
        self.pending[msg.epoch, msg.seq] = future
        self.actor.tell(WORKER, msg)
        return future

    async def result(self, handle: asyncio.Future[StepResult]) -> StepResult:
        try:
            return _checked(await asyncio.wait_for(asyncio.shield(handle), self.timeout_s))
        except TimeoutError:
            self.lost("lost", f"no StepResult within {self.timeout_s} s")
            return _checked(await handle)

    def on_result(self, msg: StepResult) -> None:
        """A StepResult: it settles its step; any earlier step still waiting lost its own."""
        key = (msg.epoch, msg.seq)
        if key not in self.pending:
            return  # a duplicate, or of a step already given up
        for earlier in [k for k in self.pending if k < key]:
            self._settle(earlier, "lost", f"StepResult {earlier[1]} of epoch {earlier[0]} was lost")
        self._settle(key, msg=msg)

    def fill(self, msg: FillMasks) -> None:
        self.actor.tell(WORKER, msg)

    def lost(self, failure: StepFailure, reason: str) -> None:
        """Every pending step is lost (the worker died, or its answers stopped)."""
        for key in list(self.pending):
            self._settle(key, failure, reason)

    def down(self) -> None:
        self.up.clear()
        self.reset_due = True
        self.lost("died", DIED)

    async def ready(self) -> None:
        """Until the worker is up (the supervisor restarts it, or gives up and stops the system)."""
        await self.up.wait()

    def _settle(self, key: tuple[int, int], failure: StepFailure | None = None, error: str = "", msg=None) -> None:
        future = self.pending.pop(key)
        if not future.done():
            future.set_result(msg or StepResult(epoch=key[0], seq=key[1], step=-1, failure=failure, error=error))

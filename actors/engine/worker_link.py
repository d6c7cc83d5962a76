"""The scheduler's side of the worker: where ExecuteSteps go and StepResults come from (the executor interface).

`submit(msg)` hands an ExecuteStep over and returns a handle; `await result(handle)` gives its StepResult, or
raises WorkerLost when it will never come: the worker died, answered with an error (a gap, a failed step), a
later step's result came first (this one was lost), or it hung or was lost (below). The scheduler then resets the
worker (actors/engine/recovery.py: a new epoch, every running request recomputed) and `await ready()` before it
submits again. `fill(msg)` delivers deferred grammar masks.

- InlineWorker: the Worker in this process; each ExecuteStep runs on the device thread (the in-process mailbox:
  the message object is handed over as is, never serialized).
- ProcessWorker: a WorkerActor (actors/engine/worker_actor.py) in a process of its own, over its mailbox; the
  supervisor restarts it when it dies (ActorDown, then ActorUp). Its heartbeats (StepProgress, messages/step.py)
  tell a slow step from a hung one. `result` waits until `step_timeout_s` passes with no progress (from the start of
  the wait; a beat whose counter moved, or a StepResult, moves the deadline), then:

  | since the last progress                              | verdict                                              |
  |------------------------------------------------------|------------------------------------------------------|
  | the latest beat: not progressing, not waiting        | "hung": blamed; StepHung (the worker exits), and     |
  |                                                      | `ready()` asks again each step_timeout_s until       |
  |                                                      | ActorDown; that death needs no second reset          |
  | no beat, or the latest waits for the scheduler or    | "lost": nobody blamed (a lost message; a process     |
  | for host copies                                      | whose loop hangs too misses the supervisor's pings)  |

The scheduler does not know how many workers are behind the link: with tensor parallelism the process worker leads
a gang of ranks (actors/engine/gang.py) and answers with the first rank's StepResult.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging

from actors.engine.grammar_masks import StepMasks
from actors.engine.request import EngineRequest
from actors.engine.worker import Launched, Worker
from actors.runtime import Actor
from gpu.batch import BatchSpec
from messages.step import (
    BLAMING_FAILURES,
    ExecuteStep,
    FillMasks,
    StepFailure,
    StepHung,
    StepProgress,
    StepResult,
    WorkerRequest,
)

log = logging.getLogger("sluice.engine")


def execute_step(
    batch: BatchSpec, requests: dict[str, EngineRequest], epoch: int, seq: int, freed: list[str]
) -> tuple[ExecuteStep, StepMasks | None]:
    """A scheduled batch's ExecuteStep: the full state of the sampling requests new to the worker, the output
    deltas of the others while their sampling reads the output (messages/step.py), the top-N of the prompt logprobs,
    and the grammar masks (the StepMasks keeps the deferred rows: FillMasks once the step before is postprocessed)."""
    new, appended, top_n, masks, position = [], {}, 0, None, 0
    for row in batch.rows:
        req = requests[row.request_id]
        if row.prompt_targets:
            top_n = max(top_n, req.params.prompt_logprobs)
        if not (k := row.num_samples):
            continue
        if req.worker_outputs < 0:
            new.append(WorkerRequest(req.request_id, req.prompt_token_ids, req.output_token_ids[:], req.params))
            req.worker_outputs = len(req.output_token_ids)
        elif req.worker_outputs < req.reads_until and len(req.output_token_ids) > req.worker_outputs:
            appended[req.request_id] = req.output_token_ids[req.worker_outputs :]
            req.worker_outputs = len(req.output_token_ids)
        if req.grammar is not None:
            masks = masks or StepMasks(req.grammar.vocab_size)
            masks.add(req.grammar, position, row.draft_token_ids, defer=req.num_pending_tokens > 1)
        position += k
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
    is_up = True

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
    def __init__(self, actor: Actor, worker: str, timeout_s: float):
        self.actor, self.worker, self.timeout_s = actor, worker, timeout_s  # (`worker`: its actor's name)
        self.pending: dict[tuple[int, int], asyncio.Future[StepResult]] = {}  # (epoch, seq) -> its result
        self.up = asyncio.Event()
        self.up.set()
        self.reset_due = False  # it died: its state is gone, even with no step in flight (the scheduler resets)
        self.progress = -1  # the worker's progress counter, as last seen
        self.stalled: StepProgress | None = None  # the latest beat since the last progress, unless it was waiting
        self.doomed: int | None = None  # a step of this epoch hung: the worker is asked to exit until it dies
        # result()'s deadline, `heard_at + timeout_s` while it waits: one timer watches it and re-arms itself when the
        # deadline has moved (a wait or progress moves it at the cost of a clock read, not a timer of its own); the
        # timer fires once more after the wait ends, and stops
        self.heard_at = 0.0
        self.waits = False  # result() is waiting (only then does the deadline run)
        self._watchdog: asyncio.Handle | None = None

    @property
    def is_up(self) -> bool:
        return self.up.is_set()

    def submit(self, msg: ExecuteStep) -> asyncio.Future[StepResult]:
        future = asyncio.get_running_loop().create_future()
        self.pending[msg.epoch, msg.seq] = future
        self.actor.tell(self.worker, msg)
        return future

    async def result(self, handle: asyncio.Future[StepResult]) -> StepResult:
        self._heard()
        self.waits = True
        try:
            return _checked(await handle)  # (settled by its StepResult, or as lost: _watch, lost())
        finally:
            self.waits = False

    def _watch(self, judge: bool = False) -> None:
        """The watchdog's turn, while result() waits: at the deadline if it moved; past it, the verdict one turn of the
        loop later (a result handled in the turn the deadline expired is taken: it moves the deadline)."""
        self._watchdog = None
        if not (self.waits and self.pending):
            return
        loop = asyncio.get_running_loop()
        if loop.time() < self.heard_at + self.timeout_s:
            self._watchdog = loop.call_at(self.heard_at + self.timeout_s, self._watch)
        elif not judge:
            self._watchdog = loop.call_soon(self._watch, True)
        else:
            self._timed_out()

    def _timed_out(self) -> None:
        """No result in time: silence is a lost message; beats without progress, a hung step."""
        beat = self.stalled
        if beat is None:
            self.lost("lost", f"no StepResult and no progress within {self.timeout_s} s")
            return
        reason = f"step {beat.seq} of epoch {beat.epoch} hung: no progress in {self.timeout_s} s"
        log.error("%s: the worker is restarted", reason)
        self.doomed = beat.epoch
        self.up.clear()
        self.lost("hung", reason)

    def on_progress(self, msg: StepProgress) -> None:
        """A heartbeat: a moved counter moves the deadline; one that did not (and waits for nobody) is a stall."""
        if not self.pending:
            return  # (nothing waits on it: a late beat, or a hung worker's)
        if msg.progress > self.progress:
            self._progressed()
            self.progress = msg.progress
        elif msg.progress == self.progress:  # (a lower count: an older beat, overtaken)
            self.stalled = None if msg.waiting else msg

    def on_result(self, msg: StepResult) -> None:
        """A StepResult: it settles its step; any earlier step still waiting lost its own."""
        key = (msg.epoch, msg.seq)
        if key not in self.pending:
            return  # a duplicate, or of a step already given up
        self._progressed()
        for earlier in [k for k in self.pending if k < key]:
            self._settle(earlier, "lost", f"StepResult {earlier[1]} of epoch {earlier[0]} was lost")
        self._settle(key, msg=msg)

    def fill(self, msg: FillMasks) -> None:
        self.actor.tell(self.worker, msg)

    def lost(self, failure: StepFailure, reason: str) -> None:
        """Every pending step is lost (the worker died, or its answers stopped)."""
        for key in list(self.pending):
            self._settle(key, failure, reason)

    def down(self) -> None:
        self.up.clear()
        self.reset_due = self.doomed is None  # (a hung worker's steps were dropped as it was found hung)
        self.doomed, self.progress, self.stalled = None, -1, None  # (a new process counts from 0)
        self.lost("died", DIED)

    async def ready(self) -> None:
        """Until the worker is up (the supervisor restarts it, or gives up and stops the system); a hung one is
        asked to exit first, again every step_timeout_s until its death is seen (the ask may be lost)."""
        while self.doomed is not None:
            self.actor.tell(self.worker, StepHung(epoch=self.doomed))
            await self.actor.until(lambda: self.doomed is None, self.timeout_s)
        await self.up.wait()

    def _progressed(self) -> None:
        self.stalled = None
        self._heard()

    def _heard(self) -> None:
        """The deadline is step_timeout_s from now."""
        loop = asyncio.get_running_loop()
        self.heard_at = loop.time()
        if self._watchdog is None:
            self._watchdog = loop.call_at(self.heard_at + self.timeout_s, self._watch)

    def _settle(self, key: tuple[int, int], failure: StepFailure | None = None, error: str = "", msg=None) -> None:
        future = self.pending.pop(key)
        if not future.done():
            future.set_result(msg or StepResult(epoch=key[0], seq=key[1], step=-1, failure=failure, error=error))

"""Worker: the model runner and the sampler behind the ExecuteStep -> StepResult link (messages/step.py).

It keeps the persistent batch: each live request's sampling state (a WorkerRequest: prompt ids, params, output
ids), built from the ExecuteSteps' full data and deltas. `launch(msg)` runs on the worker's one device thread,
in seq order: it builds the step's SamplingRows from that state and runs the StepExecutor (forward, CFG,
grammar masks, sampling, draft verification; the sampled ids stay on the device for the next step); the
Launched it returns gives the StepResult (`result()`, any thread: it waits for this step's host copy only).
`fill(msg)` (any thread) delivers a step's deferred grammar masks, before or after its launch.

An ExecuteStep of an older epoch, or one already run, is ignored (None); a gap in seq (a lost or reordered
ExecuteStep) breaks the epoch: that step and every later one of the epoch answer with an error, and the
scheduler resets the worker (a new epoch). So does a step whose rows do not fit the block tables the runner keeps
(gpu/runner/slot_tables.py: a bookkeeping bug, no request's; a second such step in a row counts as one that raised).
A step that raises answers with the error too: the scheduler treats it as a lost worker (the step's requests are
recomputed; one that keeps failing steps is failed alone); the leader of a tensor-parallel gang whose followers
were in the step exits instead (actors/engine/gang.py), a worker death.

Progress (a process worker's, for its heartbeats: messages/step.py StepProgress): `progress` counts what the
device thread did (a step begun, every few decoder layers of the forward: forward pre-hooks in the model's Python
layer loop, at most 8 a forward, a step done), plus the native layer loop's layers run (its counter, read as it runs:
gpu/runner/native_loop.py); `beat()` says which step it is in and whether it waits for the scheduler instead.

Test hooks, when a row of a step feeds the token: `EngineConfig.crash_token` makes the worker's process exit
(code 7); `slow_token` sleeps step_timeout_s in each hooked layer, in quarters, each a progress tick (a slow step);
`hang_token` blocks the device thread for good, with no progress (a hung step). A slow_token keeps the worker on the
Python layer loop (its sleeps are in the hooked layers).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import msgspec
import torch

from actors.engine.config import EngineConfig
from actors.engine.executor import StepExecutor, StepTensors
from actors.engine.gang import GANG_EXIT
from actors.engine.grammar_masks import WorkerMasks
from actors.engine.worker_loras import WorkerLoras
from gpu.batch import BatchSpec
from gpu.loading.config import ModelConfig
from gpu.runner.slot_tables import TablesDisagree
from gpu.sampling import SamplingRow
from messages.step import ExecuteStep, FillMasks, GrammarMasks, StepFailure, StepProgress, StepResult, WorkerRequest

log = logging.getLogger("sluice.worker")


@dataclass
class Launched:
    """A step handed to the device (or refused): its StepResult once the host copy is done."""

    msg: ExecuteStep
    tensors: StepTensors | None = None
    failure: StepFailure | None = None  # (then `error` says what happened)
    error: str | None = None
    loras: tuple[list[str] | None, dict[str, str]] = (None, {})  # what the LoRA adapters' report says

    def result(self) -> StepResult:
        msg = self.msg
        out = StepResult(epoch=msg.epoch, seq=msg.seq, step=msg.batch.step, failure=self.failure, error=self.error,
                         loras=self.loras[0], lora_errors=self.loras[1])  # fmt: skip
        if self.tensors is not None:
            out.sampled, out.num_emitted, out.logprobs, out.prompt_logprobs = self.tensors.host()
        return out


class Worker:
    def __init__(self, config: EngineConfig, model: ModelConfig, num_blocks: int | None):
        self.executor = StepExecutor(config, model, num_blocks)
        self.eos_token_ids, self.vocab_size = model.eos_token_ids, model.vocab_size
        hooks = {"crash": config.crash_token, "slow": config.slow_token, "hang": config.hang_token}
        self.hooks = {token: hook for hook, token in hooks.items() if token is not None}  # token -> test hook
        self.slow_s = config.step_timeout_s / 4  # (slow_token: per progress tick)
        self.progress, self.running, self._slow = 0, None, False  # device thread only (read by beat())
        if config.worker == "process":  # (the decoder layers: the model's first ModuleList)
            model = self.executor.runner.model
            if config.slow_token is not None:  # (its sleeps run in the Python loop's hooked layers)
                model.model.native_loop = None
            layers = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), [])
            for layer in layers[:: max(1, -(-len(layers) // 8))]:
                layer.register_forward_pre_hook(self._layer)
        self.requests: dict[str, WorkerRequest] = {}  # the persistent batch (device thread only)
        self.loras = None if config.lora is None else WorkerLoras(self.executor.runner, config.lora.at_start())
        self.epoch, self.next_seq, self.broken = -1, 0, False
        self.disagreed = False  # the last step failed as its rows did not fit the kept block tables
        self._lock = threading.Lock()  # guards the two mask tables (fill() comes from another thread)
        self._waiting: dict[tuple[int, int], WorkerMasks] = {}  # launched steps whose deferred masks are due
        self._early: dict[tuple[int, int], FillMasks] = {}  # fills that came before their step's launch

    def launch(self, msg: ExecuteStep) -> Launched | None:
        """Run one step on the device (device thread; module docstring)."""
        if msg.epoch > self.epoch:  # a new epoch: nothing of the old one holds
            self.epoch, self.next_seq, self.broken, self.requests = msg.epoch, 0, False, {}
            with self._lock:
                self._waiting.clear()
                self._early = {k: v for k, v in self._early.items() if k[0] >= msg.epoch}
        if msg.epoch < self.epoch or (msg.seq < self.next_seq and not self.broken):
            return None  # stale or duplicated
        if self.broken or msg.seq != self.next_seq:
            self.broken = True
            error = f"ExecuteStep {msg.seq} of epoch {msg.epoch} came before {self.next_seq}"
            return Launched(msg, failure="gap", error=error)
        self.next_seq += 1
        self.running, self.progress = (msg.epoch, msg.seq), self.progress + 1
        try:
            launched = Launched(msg, self._run(msg))
            self.disagreed = False
            if self.loras is not None:
                launched.loras = self.loras.report()
            return launched
        except Exception as e:  # a bug, or a fault: the scheduler recomputes the step's requests
            log.exception("step %d (epoch %d, seq %d) failed", msg.batch.step, msg.epoch, msg.seq)
            if self.executor.followed:  # the gang's other ranks wait in a collective this one will not call
                os._exit(GANG_EXIT)
            self.broken = True
            disagree = isinstance(e, TablesDisagree)  # (the two sides' bookkeeping: no request's fault, unless it
            failure = "gap" if disagree and not self.disagreed else "raised"  # comes twice in a row: no endless resets)
            self.disagreed = disagree
            return Launched(msg, failure=failure, error=f"step failed in the worker: {type(e).__name__}: {e}")
        finally:
            self.running, self.progress = None, self.progress + 1

    def beat(self) -> StepProgress:
        """What the device thread is doing, for a heartbeat (any thread)."""
        loop = self.executor.runner.model.model.native_loop  # (rebuilt as adapters come: its count goes on)
        running, progress = self.running, self.progress + (loop.layers_done() if loop is not None else 0)
        if running is None:  # idle: the steps wait for their host copies
            return StepProgress(epoch=self.epoch, seq=self.next_seq - 1, progress=progress, waiting=True)
        with self._lock:
            waiting = running in self._waiting  # its deferred grammar masks are still due
        return StepProgress(epoch=running[0], seq=running[1], progress=progress, waiting=waiting)

    def abandon(self, epoch: int) -> None:
        """Steps of epochs before `epoch` waiting for their masks go on, all allowed (their answers are ignored: the
        scheduler that would have filled them reset the worker, or died). Called as an ExecuteStep arrives (any
        thread: the device thread may be the one waiting)."""
        with self._lock:
            old = [key for key in self._waiting if key[0] < epoch]
            released = [self._waiting.pop(key) for key in old]
        for masks in released:
            masks.fill(GrammarMasks(positions=[], bitmask=b""), last=True)

    def update_batch(self, msg: ExecuteStep) -> None:
        """The persistent batch after the ExecuteStep's frees, new requests and output deltas."""
        for rid in msg.freed:
            self.requests.pop(rid, None)
        for req in msg.new:
            self.requests[req.request_id] = req
        for rid, tokens in msg.appended.items():
            self.requests[rid].output_token_ids += tokens

    def sampling_rows(self, batch: BatchSpec) -> list[SamplingRow]:
        """A SamplingRow per sampled position (a row verifying K drafts has K + 1, position j with the first j drafts
        in its output history).

        A request whose sampling reads its output (reads_output) never has a step in flight when it is scheduled
        (the scheduler syncs first, or it was just admitted): its list is whole. The others' lists grow only to
        min_tokens (ExecuteStep.appended) and lag the host from then on, which no sampling decision reads."""
        rows = []
        for row in batch.rows:
            if row.num_samples:
                req = self.requests[row.request_id]
                for j in range(row.num_samples):
                    output = req.output_token_ids + row.draft_token_ids[:j] if j else req.output_token_ids
                    position = row.output_position + j
                    rows.append(SamplingRow(req.params, req.prompt_token_ids, output, position, self.eos_token_ids))
        return rows

    def fill(self, msg: FillMasks) -> None:
        """A launched (or yet to launch) step's deferred grammar masks."""
        with self._lock:
            masks = self._waiting.pop((msg.epoch, msg.seq), None)
            if masks is None:
                self._early[msg.epoch, msg.seq] = msg
                return
        masks.fill(msg.masks, last=True)

    def _run(self, msg: ExecuteStep) -> StepTensors | None:
        self.update_batch(msg)
        batch = msg.batch
        if self.loras is not None and (unloaded := self.loras.before(msg)):  # (worker_loras.py, step 3)
            rows = [msgspec.structs.replace(r, lora=None) if r.lora in unloaded else r for r in batch.rows]
            batch = msgspec.structs.replace(batch, rows=rows)
        if not batch.rows:
            return None  # bookkeeping only (the scheduler went idle)
        if self.hooks:
            self._test_hooks(msg.batch)
        rows = self.sampling_rows(msg.batch)
        masks = None
        if msg.masks is not None:
            masks = WorkerMasks(msg.masks, msg.batch.num_samples, self.vocab_size)
            if msg.masks.deferred:
                with self._lock:
                    early = self._early.pop((msg.epoch, msg.seq), None)
                    if early is None:
                        self._waiting[msg.epoch, msg.seq] = masks
                if early is not None:
                    masks.fill(early.masks, last=True)
        return self.executor.run(batch, rows, msg.num_prompt_logprobs, masks)

    def _layer(self, *_) -> None:
        """A hooked decoder layer begins (device thread): progress."""
        self.progress += 1
        if self._slow:
            for _ in range(4):
                time.sleep(self.slow_s)
                self.progress += 1

    def _test_hooks(self, batch: BatchSpec) -> None:
        """The module docstring's test hooks."""
        fed = {self.hooks[t] for row in batch.rows for t in row.token_ids if t in self.hooks}
        if "crash" in fed:
            os._exit(7)  # a poison request
        if "hang" in fed:
            threading.Event().wait()  # a deadlock: the heartbeats go on, the progress does not
        self._slow = "slow" in fed

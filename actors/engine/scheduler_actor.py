"""SchedulerActor: the engine process. schedule -> execute (the worker: runner + sampler) -> postprocess.

The step loop is an owned task; handlers (new requests, aborts) run between steps on the same
event loop, so scheduler state is only touched from this thread. Each step goes to the worker as one
ExecuteStep and comes back as one StepResult (actors/engine/worker_link.py: inline or in its own process); with
async scheduling the loop plans and submits step N+1 before collecting step N (one step ahead), otherwise it
collects each step before planning the next. A lost worker state (`_worker_lost`) drops the steps in flight and
recomputes every running request. Before a step goes to the worker, the requests of the steps in flight are written
to the flight record (actors/engine/flight_record.py), which the next incarnation blames if this process dies.

The request intake (AddRequest, Abort, ActorDown: the cases of each) is actors/engine/intake.py; Shutdown aborts
every live request (reason "shutdown"), sends the acks, then stops the actor.
Every AbortAck is sent after the StepOutputs of the step that last touched the request (one FIFO link).
Every executed step sends one StepOutputs (possibly without entries), numbered by `step`, and so does
the engine each time it goes idle: the detokenizer tells duplicates and lost messages by those numbers
(actors/engine/step_outputs.py). No StepOutputs is unnumbered: a terminal output made outside a step's results (a
failed planning, a refused request, a poison request) goes first in the StepOutputs of the step in flight, or at once
under a number of its own when none is (a worker restarting holds none back). A request whose planning
or results raise fails alone, the engine goes on (actors/engine/isolation.py); the fault plan's raise rules reach the
scheduler as its `fault` hook.
What the intake knows of the last 65536 ids is in its ledger (IntakeLedger).

Test hooks: with `EngineConfig.step_gate`, a Probe(seq=k) lets k more steps be postprocessed (k < 0: all);
a step waits, executed and still in flight, until it may go on. Handlers keep running meanwhile; the terminal
outputs held for that step's StepOutputs (a refusal meanwhile among them) wait with it.
With `EngineConfig.record_outputs`, every StepOutputs' [request id, seq, token ids] entries (all of them: every
StepOutputs is numbered and goes through StepReports._report) are appended to that file as it is sent: what the
client must receive whatever the links do to it (a resumed copy's overwrite the positions it regenerates).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time

import msgspec
import torch

from actors.engine.block_manager import BlockManager
from actors.engine.config import EngineConfig
from actors.engine.draft import DraftProposer
from actors.engine.executor import num_kv_blocks
from actors.engine.flight_record import FlightRecord
from actors.engine.grammar import WARM_IDLE_S, warm
from actors.engine.grammar_masks import StepMasks
from actors.engine.intake import IntakeLedger, RequestIntake
from actors.engine.kv_sizing import published
from actors.engine.lora_registry import LoraRegistry
from actors.engine.lora_table import LoraTable
from actors.engine.metrics import engine_stats, idle_details, log_speculation
from actors.engine.recovery import WorkerRecovery
from actors.engine.request import EngineRequest, RequestStatus
from actors.engine.scheduler import Scheduler
from actors.engine.speculative import make_proposer
from actors.engine.step_outputs import StepReports
from actors.engine.worker import Worker
from actors.engine.worker_link import DIED, InlineWorker, ProcessWorker, WorkerLost, execute_step
from actors.protocol import SentNames, StepGate
from actors.runtime import Actor
from gpu.batch import BatchSpec
from gpu.loading.config import ModelConfig
from messages.lora import RegisterLora, UnregisterLora
from messages.names import SCHEDULER
from messages.step import FillMasks, StepProgress, StepResult
from messages.wire import Abort, ActorDown, ActorUp, AddRequest, CheckIdle, IdleReport, Probe

log = logging.getLogger("sluice.engine")


def needs_history(req: EngineRequest) -> bool:
    """Sampling that reads the output so far, or a beam search (its next rows follow from this step's decision): the
    host must know every token before the step."""
    return req.beams is not None or len(req.output_token_ids) < req.reads_until  # (as reads_output: gpu/sampling)


class SchedulerActor(RequestIntake, WorkerRecovery, StepReports, LoraRegistry, Actor):
    name = SCHEDULER

    def __init__(self, config: dict):
        super().__init__()
        self.config = msgspec.convert(config, EngineConfig)
        self.model = ModelConfig.from_path(self.config.model)
        self.max_model_len = min(self.config.max_model_len, self.model.max_model_len)
        self.late_aborts = 0
        self.names = SentNames()  # the requests of the last StepOutputs, named in the next (a lost one's suspects)
        self.intake = IntakeLedger()  # copies held before the scheduler takes them, what is known of the ids seen
        self.duplicates = 0
        self.admitting = True
        self.gate = StepGate()  # steps wait there before their postprocess; open unless a test closes it
        # the worker state addressed (increasing across restarts of this process too: the clock since boot), and
        # the next ExecuteStep's number in it
        self.epoch, self.seq = time.monotonic_ns(), 0
        self.freed: list[str] = []  # requests the worker holds that ended since the last ExecuteStep
        self.worker_resets = 0
        self._work = asyncio.Event()
        self.warmed = False  # the grammar compiler's warm-up started (`_idle`)
        self._device = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sluice-device")
        self._record = self.config.record_outputs and open(self.config.record_outputs, "ab", buffering=0)  # noqa: SIM115

    def handlers(self):
        table = {AddRequest: self.on_add, Abort: self.on_abort, ActorDown: self.on_down, CheckIdle: self.on_check}
        if self.config.worker == "process":
            table[StepResult] = lambda msg: self.link.on_result(msg)
            table[StepProgress] = lambda msg: self.link.on_progress(msg)
            table[ActorUp] = lambda msg: msg.actor == self.config.replica.worker and self.link.up.set()
        if self.config.step_gate:
            table[Probe] = lambda msg: self.gate.set(None if msg.seq < 0 else msg.seq)
        if self.config.lora is not None:
            table |= {RegisterLora: self.on_register_lora, UnregisterLora: self.on_unregister_lora}
        return table

    async def on_start(self) -> None:
        path = f"{self.router.placement.rundir}/{self.name}.flight"
        self.flight = FlightRecord(path, self.config.max_step_failures, names=self._arrives_as)
        for rid, n in self.flight.recover().items():  # (before any request arrives: its copy takes its blame)
            log.warning("[%s] was in a step in flight as the engine process died: %d failed steps", rid, n)
        torch.set_num_threads(self.config.threads())
        blocks = num_kv_blocks(self.config, self.model)  # (None: the worker sizes its cache to the device)
        loop = asyncio.get_running_loop()
        if self.config.worker == "process":
            if blocks is None:  # (its process started once the worker's had published the count)
                blocks = published(self.router.placement.rundir, self.config.replica.worker, expected=True)
            self.proposer = await loop.run_in_executor(self._device, make_proposer, self.config, self.model, blocks)
            self.link = ProcessWorker(self, self.config.replica.worker, self.config.step_timeout_s)
        else:
            worker = await loop.run_in_executor(self._device, Worker, self.config, self.model, blocks)
            blocks = worker.executor.runner.num_blocks
            self.proposer = await loop.run_in_executor(self._device, make_proposer, self.config, self.model, blocks)
            worker.executor.draft = self.proposer if isinstance(self.proposer, DraftProposer) else None
            self.link = InlineWorker(worker, self._device, worker.executor.device.type != "cpu")
        if self.config.lora:  # (adapters named while serving are checked against it: actors/engine/lora_registry.py)
            await loop.run_in_executor(None, self.meta_model)
        self.grammar_key = (self.config.model, self.model.vocab_size, tuple(self.model.eos_token_ids))
        self.sched = Scheduler(
            BlockManager(blocks, self.config.block_size, self.config.enable_prefix_caching),
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=self.model.eos_token_ids,
            release=self._released,
            long_prefill_token_threshold=self.config.long_prefill_token_threshold,
            isolate_after=self.config.max_step_failures - 1,  # (a single death is seldom a poison: a kill, OOM)
            max_loras=lora.max_loras if (lora := self.config.lora) else None,
            loras=lora and LoraTable({m.digest: m.path for m in lora.modules}, lora.capacity, list(lora.at_start())),
        )
        self.sched.fault = self.router.faults and self.router.faults.check  # (a fault plan's raise rules)
        self.flight.arm()  # (copies of blamed requests can come from now on)
        log.info(
            "engine ready: %s, %d KV blocks of %d, max_model_len %d",
            self.model.name,
            blocks,
            self.config.block_size,
            self.max_model_len,
        )
        self._stepping = self.spawn(self._step_loop())
        if self.config.stats_to:
            self.sched.queue_times = []
            self.spawn(self._publish_stats())
        if self.config.speculative:
            self.spawn(log_speculation(lambda: self.sched.spec))

    # ------------------------------------------------------------ handlers

    def on_check(self, msg: CheckIdle) -> IdleReport:
        held = sum(r.worker_outputs >= 0 for r in self.sched.requests.values())  # (the worker frees them at the next
        details = idle_details(self.sched) | {  # step, or when the engine goes idle)
            "silent_aborts": sum(r.status is RequestStatus.ABORTED and r.abort_reason is None
                                 for r in self.sched.requests.values()),
            "compiling": self.intake.count(compiling=True), "resuming": self.intake.count(compiling=False),
            "pending_asks": self.pending_asks, "unreported": len(self.sched.failed),
            "gate_permits": self.gate.permits or 0, "held_steps": int(self.gate.holding),
            "worker_requests": held + len(self.freed),
        }  # fmt: skip
        return IdleReport(actor=self.name, idle=not any(details.values()), details=details)

    async def on_shutdown(self, reason: str) -> None:
        self.admitting = False
        self.gate.set(None)
        compiling = [rid for rid, held in self.intake.held.items() if held.compiling]
        for rid in [*compiling, *(r.request_id for r in (*self.sched.waiting, *self.sched.running))]:
            self.on_abort(Abort(request_id=rid, reason="shutdown"))
        await self.until(lambda: not (self.sched.has_unfinished() or self.sched.in_flight or self.sched.failed), 10)
        self._stepping.cancel()  # before the device goes: the loop would send it the idle marker's frees
        await asyncio.wait([self._stepping])
        self._device.shutdown(wait=False, cancel_futures=True)
        self.flight.close()
        if self._record:
            self._record.close()

    # ------------------------------------------------------------ the step loop

    async def _step_loop(self) -> None:
        # speculation steps synchronously: the proposer reads the tokens of the step before
        depth = 2 if self.config.async_scheduling and not self.config.speculative else 1
        inflight: collections.deque[tuple[BatchSpec, object, StepMasks | None, int]] = collections.deque()
        while True:
            batch = None
            if self.link.reset_due and not inflight:  # the worker died between steps
                await self._worker_lost(inflight, WorkerLost("died", DIED))
            if len(inflight) < depth and not (inflight and self._must_sync()):
                drafts = await self._propose() if self.proposer and not inflight else None
                batch = self.sched.schedule(drafts)
                if batch.rows:
                    self.flight.write([*(step[0] for step in inflight), batch])  # (before its masks and the worker)
                    msg, masks = execute_step(batch, self.sched.requests, self.epoch, self.seq, self.freed)
                    msg.loras = self.sched.loras and self.sched.loras.desired()
                    self.seq, self.freed = self.seq + 1, []
                    inflight.append((batch, self.link.submit(msg), masks, msg.seq))
            if inflight and (len(inflight) >= depth or batch is None or not batch.rows):
                done, handle, _, _ = inflight[0]
                try:
                    result = await self.link.result(handle)
                except WorkerLost as e:
                    hit = [self.sched.requests[row.request_id] for step in inflight for row in step[0].rows]
                    await self._worker_lost(inflight, e)
                    self.flight.watch(hit)  # (the blamed ones)
                    self.flight.write(())
                    continue
                inflight.popleft()
                await self.gate.wait()
                await self._postprocess(done, result)
                if inflight and inflight[0][2] is not None and inflight[0][2].deferred:  # the next step's rows that
                    masks = inflight[0][2].fill_deferred()  # waited for these tokens
                    self.link.fill(FillMasks(epoch=self.epoch, seq=inflight[0][3], masks=masks))
            elif not inflight:
                if self.flight.named:  # the last steps are done: a death now blames nobody
                    self.flight.write(())
                self._work.clear()
                if not self.sched.has_unfinished():
                    self._idle_marker()
                    await self._idle()
            self.moved()
            await asyncio.sleep(0)  # handlers (aborts, new requests) run between steps

    async def _idle(self) -> None:
        """Wait for work; the first time the engine stays idle WARM_IDLE_S, it warms the grammar compiler (its import
        held the GIL from a fresh engine's first steps for about a second: actors/engine/grammar.py)."""
        if self.warmed:
            await self._work.wait()
            return
        try:
            await asyncio.wait_for(self._work.wait(), WARM_IDLE_S)
        except TimeoutError:
            self.warmed = True
            warm(*self.grammar_key)
            await self._work.wait()

    async def _propose(self) -> dict[str, list[int]] | None:
        """Drafts for the requests that may speculate, drafted on the device thread."""
        candidates = self.sched.speculation_candidates()
        if not candidates:
            return None
        return await asyncio.get_running_loop().run_in_executor(self._device, self.proposer.propose, candidates)

    def _arrives_as(self, rids: list[str]) -> list[str]:
        """The ids the requests' copies arrive under, each once: a beam group's are its members' (its rows carry its
        own)."""
        if not self.sched.num_groups:
            return list(dict.fromkeys(rids))
        requests, ids = self.sched.requests, []
        for rid in rids:
            req = requests.get(rid)
            if req is not None and req.beams is not None:
                ids += [m.request_id for m in req.beams.members.values()]
            else:
                ids.append(rid)
        return list(dict.fromkeys(ids))

    def _must_sync(self) -> bool:
        return any(needs_history(r) for r in self.sched.running)

    async def _publish_stats(self) -> None:
        while True:
            queue_times, self.sched.queue_times = self.sched.queue_times, []
            stats = engine_stats(self.sched, self.late_aborts, queue_times)
            stats.worker_resets_total = self.worker_resets
            stats.worker_ranks, stats.worker_up = self.config.tensor_parallel_size, self.link.is_up
            stats.replica = self.config.data_parallel_rank
            for actor in self.config.stats_to:
                self.tell(actor, stats)
            await asyncio.sleep(self.config.stats_interval_s)

"""SchedulerActor: the engine process. schedule -> execute (runner + sampler) -> postprocess.

The step loop is an owned task; handlers (new requests, aborts) run between steps on the same
event loop, so scheduler state is only touched from this thread. Steps execute on one device
thread; with async scheduling the loop plans and submits step N+1 before collecting step N
(one step ahead), otherwise it collects each step before planning the next.

Abort cases (DESIGN section 3; request state at the scheduler x event -> action):
  waiting / preempted        Abort -> removed from the queue, AbortAck now
  mid chunked prefill        Abort -> dropped from the next batch; AbortAck when no in-flight step reads its blocks
  decoding, step in flight   Abort -> its sample of that step is discarded (counted); blocks freed, then AbortAck
  decoding, nothing in flight Abort -> blocks freed, AbortAck now
  finished (terminal sent)   Abort -> late abort: ignored, counted (the detokenizer has the terminal entry)
  aborted twice              Abort -> late abort: ignored, counted
  compiling its grammar      Abort -> dropped, AbortAck now (the compile finishes unused)
  unknown (never added)      Abort -> late abort, counted; remembered: if its AddRequest comes after all (the
                                      link reordered them), it is registered and acked at once, never run
  added before               AddRequest -> a duplicate (ids are unique, DESIGN I1): dropped, logged
  unknown or live            AddRequest(resumed, DESIGN I8) -> a live copy is aborted silently; once no copy is left,
                                      registered and admitted with its delivered tokens, outputs from their count on
  resumed, copy not yet freed Abort -> remembered: registered and acked at once when the copy is freed
  any live request           ActorDown(detokenizer) -> aborted silently (its text is lost; no ack to send)
  any live request           Shutdown -> aborted (reason "shutdown"), acks sent, then the actor stops
Every AbortAck is sent after the StepOutputs of the step that last touched the request (one FIFO link).
Every executed step sends one StepOutputs (possibly without entries), numbered by `step`, and so does
the engine each time it goes idle: the detokenizer tells duplicates and lost messages by those numbers.
The last 65536 ids are remembered (RecentIds).

Test hooks: with `EngineConfig.step_gate`, a Probe(seq=k) lets k more steps be postprocessed (k < 0: all);
a step waits, executed and still in flight, until it may go on. Handlers keep running meanwhile.
With `EngineConfig.record_outputs`, every StepOutputs' [request id, seq, token ids] entries are appended to that
file as it is sent: what the client must receive whatever the links do to it (a resumed copy's overwrite the
positions it regenerates).
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
from actors.engine.executor import StepExecutor, StepResult, num_kv_blocks, step_inputs
from actors.engine.grammar import GrammarError, Matcher, StepMasks, grammars, warm
from actors.engine.guidance import guidance_error
from actors.engine.logprobs import collect_prompt_logprobs, entries, wanted_logprobs
from actors.engine.metrics import engine_stats, idle_details, log_speculation
from actors.engine.request import EngineRequest
from actors.engine.scheduler import Scheduler
from actors.engine.speculative import make_proposer
from actors.protocol import RecentIds, StepGate
from actors.runtime import Actor
from gpu.batch import BatchSpec
from gpu.config import ModelConfig
from gpu.sampling import reads_output
from messages.sampling_params import ParamError
from messages.wire import (
    Abort,
    AbortAck,
    ActorDown,
    AddRequest,
    CheckIdle,
    IdleReport,
    Probe,
    RequestOutput,
    StepOutputs,
)

log = logging.getLogger("sluice.engine")

ADDED = "\0added"  # in `recent`: the request was added ((ADDED, reason) once aborted), or the reason of an Abort
# that came before it


def needs_history(req: EngineRequest) -> bool:
    """Sampling that reads the output so far: the host must know every token before the step."""
    return reads_output(req.params, len(req.output_token_ids))


class SchedulerActor(Actor):
    name = "scheduler"

    def __init__(self, config: dict):
        super().__init__()
        self.config = msgspec.convert(config, EngineConfig)
        self.model = ModelConfig.from_path(self.config.model)
        self.max_model_len = min(self.config.max_model_len, self.model.max_model_len)
        self.late_aborts = 0
        self.abort_reasons: dict[str, str] = {}
        self.silent: set[str] = set()
        self.recent = RecentIds()  # ids seen
        self.duplicates = 0
        self.admitting = True
        self.queued: dict[str, float] = {}  # with stats_to: request id -> arrival here, until first scheduled
        self.compiling: dict[str, AddRequest] = {}  # constrained requests whose grammar is being compiled
        self.resuming: dict[str, AddRequest] = {}  # resumed requests waiting for their earlier copy to be freed
        self.queue_times: list[float] = []  # arrival -> first scheduled, since the last EngineStats
        self.gate = StepGate()  # steps wait there before their postprocess; open unless a test closes it
        self._work = asyncio.Event()
        self._device = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sluice-device")
        self._record = self.config.record_outputs and open(self.config.record_outputs, "ab", buffering=0)  # noqa: SIM115

    def handlers(self):
        table = {AddRequest: self.on_add, Abort: self.on_abort, ActorDown: self.on_actor_down, CheckIdle: self.on_check}
        if self.config.step_gate:
            table[Probe] = lambda msg: self.gate.set(None if msg.seq < 0 else msg.seq)
        return table

    async def on_start(self) -> None:
        torch.set_num_threads(self.config.threads())
        blocks = num_kv_blocks(self.config, self.model)
        loop = asyncio.get_running_loop()
        self.executor = await loop.run_in_executor(self._device, StepExecutor, self.config, self.model, blocks)
        self.proposer = await loop.run_in_executor(self._device, make_proposer, self.config, self.model, blocks)
        self.executor.draft = self.proposer if isinstance(self.proposer, DraftProposer) else None
        self.grammar_key = (self.config.model, self.model.vocab_size, tuple(self.model.eos_token_ids))
        warm(*self.grammar_key)
        self.sched = Scheduler(
            BlockManager(blocks, self.config.block_size, self.config.enable_prefix_caching),
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=self.model.eos_token_ids,
            release=self.proposer and self.proposer.release,
            long_prefill_token_threshold=self.config.long_prefill_token_threshold,
        )
        log.info(
            "engine ready: %s, %d KV blocks of %d, max_model_len %d",
            self.model.name,
            blocks,
            self.config.block_size,
            self.max_model_len,
        )
        self.spawn(self._step_loop())
        if self.config.stats_to:
            self.spawn(self._publish_stats())
        if self.config.speculative:
            self.spawn(log_speculation(lambda: self.sched.spec))

    # ------------------------------------------------------------ handlers

    def on_add(self, msg: AddRequest) -> None:
        rid = msg.request_id
        note = early_abort = self.recent.get(rid)
        if msg.resume_token_ids is not None:  # a copy of an aborted request is registered and acked at once
            if self._resume_later(msg):
                return
            early_abort = note[1] if isinstance(note, tuple) else None if note == ADDED else note
        elif note == ADDED or isinstance(note, tuple) or rid in self.sched.requests:
            self.duplicates += 1
            log.warning("[%s] duplicate AddRequest dropped", rid)
            return
        self.recent.remember(rid, ADDED if early_abort is None else (ADDED, early_abort))
        self.tell(self.config.detokenizer, msg)  # registration precedes every output (FIFO link)
        if early_abort is not None:
            log.info("[%s] aborted before it arrived (%s)", rid, early_abort)
            self.tell(self.config.detokenizer, AbortAck(request_id=rid, reason=early_abort))
            return
        error = self._validate(msg)
        if error:
            self._reject(msg, error)
        elif msg.params.structured is not None:
            self.compiling[rid] = msg
            self.spawn(self._compile(msg))
        else:
            self._admit(msg)

    def _resume_later(self, msg: AddRequest) -> bool:
        """A resumed request whose earlier copy is still here (the detokenizer restarted while it ran) waits until
        that copy, aborted silently, is freed; a copy still compiling is dropped now."""
        rid = msg.request_id
        self.compiling.pop(rid, None)
        if rid not in self.sched.requests:
            log.info("[%s] resumed after %d tokens", rid, len(msg.resume_token_ids))
            return False
        if self.sched.abort(rid):
            self.silent.add(rid)
        self.resuming[rid] = msg
        self._send_acks()  # admits it now if the copy is freed already
        return True

    def _admit(self, msg: AddRequest, grammar: Matcher | None = None) -> None:
        self.sched.add_request(EngineRequest.from_msg(msg, self.model.bos_token_id, grammar))
        if self.config.stats_to:
            self.queued[msg.request_id] = time.monotonic()
        self._work.set()

    def _reject(self, msg: AddRequest, error: str) -> None:
        log.warning("[%s] rejected: %s", msg.request_id, error)
        seq = len(msg.resume_token_ids or [])
        out = RequestOutput(
            request_id=msg.request_id,
            seq=seq,
            new_token_ids=[],
            finish_reason="error",
            error=error,
            attempt=msg.attempt,
        )
        self.tell(self.config.detokenizer, StepOutputs(step=-1, outputs=[out]))

    async def _compile(self, msg: AddRequest) -> None:
        """A constrained request's matcher, compiled off the loop; then it joins the queue (unless aborted)."""
        try:
            grammar = await asyncio.get_running_loop().run_in_executor(
                None, lambda: grammars(*self.grammar_key).matcher(msg.params.structured, msg.resume_token_ids or ())
            )
        except GrammarError as e:
            grammar, error = None, f"invalid structured output: {e}"
        if self.compiling.get(msg.request_id) is not msg:
            return  # aborted meanwhile (acked then), or resumed (a newer copy compiles)
        del self.compiling[msg.request_id]
        if grammar is None:
            self._reject(msg, error)
        else:
            self._admit(msg, grammar)

    def _validate(self, msg: AddRequest) -> str | None:
        if not self.admitting:
            return "the server is shutting down"
        n = len(msg.prompt_token_ids)
        if n == 0:
            return "the prompt is empty"
        if n >= self.max_model_len:
            return f"the prompt has {n} tokens; max_model_len is {self.max_model_len}"
        try:
            msg.params.verify(self.model.vocab_size, limits=None)  # validity; the frontend enforced its limits
        except ParamError as e:
            return str(e)
        resumed = msg.resume_token_ids or []
        bad = next((t for t in msg.prompt_token_ids + resumed if not 0 <= t < self.model.vocab_size), None)
        if bad is not None:
            return f"token id {bad} is outside the vocabulary"
        if resumed and (len(resumed) >= msg.params.max_tokens or n + len(resumed) >= self.max_model_len):
            return f"resumed after {len(resumed)} tokens: nothing is left to generate"
        return guidance_error(msg.params, self.config, self.model) if msg.params.guided else None

    def on_abort(self, msg: Abort) -> None:
        if msg.request_id in self.resuming:  # registered, then acked at once, when its earlier copy is freed
            self.recent.remember(msg.request_id, msg.reason)
        elif self.compiling.pop(msg.request_id, None) is not None:
            log.info("[%s] aborted while its grammar compiled (%s)", msg.request_id, msg.reason)
            self.recent.remember(msg.request_id, (ADDED, msg.reason))
            self.tell(self.config.detokenizer, AbortAck(request_id=msg.request_id, reason=msg.reason))
        elif self.sched.abort(msg.request_id):
            self.abort_reasons[msg.request_id] = msg.reason
            self.recent.remember(msg.request_id, (ADDED, msg.reason))
            log.info("[%s] aborted (%s)", msg.request_id, msg.reason)
            self._send_acks()
        else:
            self.late_aborts += 1
            log.debug("[%s] late abort (%s) ignored", msg.request_id, msg.reason)
            if msg.request_id not in self.recent:
                self.recent.remember(msg.request_id, msg.reason)

    def on_actor_down(self, msg: ActorDown) -> None:
        if msg.actor != self.config.detokenizer:
            return
        live = [r.request_id for r in (*self.sched.waiting, *self.sched.running)]
        log.warning("detokenizer down: aborting %d requests silently", len(live) + len(self.compiling))
        self.silent.update(live)
        self.compiling.clear()
        for rid in live:
            self.sched.abort(rid)
        self._send_acks()

    def on_check(self, msg: CheckIdle) -> IdleReport:
        details = idle_details(self.sched)
        details["abort_reasons"] = len(self.abort_reasons)
        details["silent_aborts"] = len(self.silent)
        details["queued"] = len(self.queued)
        details["compiling"] = len(self.compiling)
        details["resuming"] = len(self.resuming)
        details["pending_asks"] = self.pending_asks
        details["gate_permits"] = self.gate.permits or 0
        details["held_steps"] = int(self.gate.holding)
        return IdleReport(actor=self.name, idle=not any(details.values()), details=details)

    async def on_shutdown(self, reason: str) -> None:
        self.admitting = False
        self.gate.set(None)
        for rid in [*self.compiling, *(r.request_id for r in (*self.sched.waiting, *self.sched.running))]:
            self.on_abort(Abort(request_id=rid, reason="shutdown"))
        deadline = time.monotonic() + 10
        while (self.sched.has_unfinished() or self.sched.in_flight) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._device.shutdown(wait=False, cancel_futures=True)
        if self._record:
            self._record.close()

    def _send_acks(self) -> None:
        for rid in self.sched.drain_aborted():
            reason = self.abort_reasons.pop(rid, "client")
            self.queued.pop(rid, None)  # aborted before it was scheduled
            if rid in self.silent:
                self.silent.discard(rid)
            else:
                self.tell(self.config.detokenizer, AbortAck(request_id=rid, reason=reason))
        for rid in [r for r in self.resuming if r not in self.sched.requests]:
            self.on_add(self.resuming.pop(rid))

    # ------------------------------------------------------------ the step loop

    async def _step_loop(self) -> None:
        # speculation steps synchronously: the proposer reads the tokens of the step before
        depth = 2 if self.config.async_scheduling and not self.config.speculative else 1
        inflight: collections.deque[tuple[BatchSpec, asyncio.Future, StepMasks | None]] = collections.deque()
        loop = asyncio.get_running_loop()
        while True:
            batch = None
            if len(inflight) < depth and not (inflight and self._must_sync()):
                drafts = await self._propose() if self.proposer and not inflight else None
                batch = self.sched.schedule(drafts)
                if batch.rows:
                    if self.queued:
                        self._note_first_scheduled(batch)
                    inputs = step_inputs(batch, self.sched.requests, self.model.eos_token_ids)
                    step = loop.run_in_executor(self._device, self.executor.run, batch, *inputs)
                    inflight.append((batch, step, inputs[-1]))
            if inflight and (len(inflight) >= depth or batch is None or not batch.rows):
                done, future, _ = inflight.popleft()
                result = await future
                await self.gate.wait()
                await self._postprocess(done, result)
                if inflight and inflight[0][2] is not None:  # the next step's rows that waited for these tokens
                    inflight[0][2].fill_deferred()
            elif not inflight:
                self._work.clear()
                if not self.sched.has_unfinished():
                    self._idle_marker()
                    await self._work.wait()
            await asyncio.sleep(0)  # handlers (aborts, new requests) run between steps

    async def _propose(self) -> dict[str, list[int]] | None:
        """Drafts for the requests that may speculate, drafted on the device thread."""
        candidates = self.sched.speculation_candidates()
        if not candidates:
            return None
        return await asyncio.get_running_loop().run_in_executor(self._device, self.proposer.propose, candidates)

    def _idle_marker(self) -> None:
        """An empty StepOutputs with a step number of its own, sent as the engine goes idle: a lost
        last step shows as a gap at the detokenizer even when no other step follows."""
        step, self.sched.next_step = self.sched.next_step, self.sched.next_step + 1
        self.tell(self.config.detokenizer, StepOutputs(step=step, outputs=[]))

    def _must_sync(self) -> bool:
        return any(needs_history(r) for r in self.sched.running)

    async def _postprocess(self, batch: BatchSpec, result: StepResult) -> None:
        if result.ready is None:
            sampled, emitted, lp, plp = result.host()
        else:  # wait for this step's copy off the loop: handlers keep running meanwhile
            sampled, emitted, lp, plp = await asyncio.get_running_loop().run_in_executor(None, result.host)
        if plp is not None:
            collect_prompt_logprobs(batch, plp, self.sched.requests)
        want = wanted_logprobs(batch, self.sched.requests) if lp is not None else {}  # before update() ends any
        outputs = self.sched.update(batch, sampled, emitted)
        for out in outputs:
            if out.request_id in want:
                start, n = want[out.request_id]
                out.logprobs = entries(lp, start, start + len(out.new_token_ids), n)
        self.tell(self.config.detokenizer, StepOutputs(step=batch.step, outputs=outputs))
        if self._record:
            self._record.write(msgspec.json.encode([[o.request_id, o.seq, o.new_token_ids] for o in outputs]) + b"\n")
        self._send_acks()

    def _note_first_scheduled(self, batch: BatchSpec) -> None:
        now = time.monotonic()
        for row in batch.rows:
            arrival = self.queued.pop(row.request_id, None)
            if arrival is not None:
                self.queue_times.append(now - arrival)

    async def _publish_stats(self) -> None:
        while True:
            queue_times, self.queue_times = self.queue_times, []
            stats = engine_stats(self.sched, self.late_aborts, queue_times)
            for actor in self.config.stats_to:
                self.tell(actor, stats)
            await asyncio.sleep(self.config.stats_interval_s)

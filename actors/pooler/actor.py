"""PoolerActor: a pooling model's engine (issue 52). It takes the scheduler's name (messages/names.py), so the
router, readiness and the supervisor treat it as the replica's engine; it has no worker and no detokenizer.

A step embeds inputs of the queued requests, one of each in turn, whole, up to max_num_batched_tokens (at least
one), packed in one forward on the device thread (the loop never blocks); a request's PoolOutput goes to its client
once all its inputs are embedded. No state outlives a step: nothing to free, nothing to resume from.

Cases (request state x event -> action):
  queued    Abort            -> removed, AbortAck now
  in a step Abort            -> remembered: AbortAck as the step ends, its output dropped
  unknown   Abort            -> a late abort (it ended, or never came): ignored, counted
  any       PoolRequest, an older copy than one held -> stale: dropped; a newer one replaces the held one
  any       an input the engine cannot take (the frontend checks first) -> PoolOutput(error)
  any       Shutdown         -> every one aborted (shutdown: those in the step acked as it ends); a new one acked
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
from dataclasses import dataclass, field

import msgspec
import torch
import torch.nn.functional as F

from actors.engine.config import EngineConfig
from actors.runtime import Actor
from gpu.layers.pooling import pool
from gpu.loading.encoder import load_encoder
from gpu.loading.encoder_config import EncoderConfig, pooling_config
from gpu.runner.pooling import CausalStates
from messages.names import SCHEDULER
from messages.pooling import PoolOutput, PoolRequest
from messages.wire import Abort, AbortAck, CheckIdle, DetokStats, EngineStats, IdleReport

log = logging.getLogger("sluice.pooler")


@dataclass(eq=False)
class Job:
    msg: PoolRequest
    order: int  # its place in arrival order (the round-robin's)
    done: list[torch.Tensor | None] = field(default_factory=list)  # per input: its embedding once embedded
    next: int = 0  # the first input not yet in a step
    aborted: str | None = None  # the reason of an Abort that came while it was in a step


class PoolerActor(Actor):
    name = SCHEDULER

    def __init__(self, config: dict):
        super().__init__()
        self.config = msgspec.convert(config, EngineConfig)
        self.model_config = pooling_config(self.config.model, self.config.pooler_config)
        self.max_model_len = min(self.config.max_model_len, self.model_config.max_model_len)
        self.jobs: dict[str, Job] = {}  # every request held, in arrival order (the queue)
        self.stepping: set[Job] = set()  # the jobs with inputs in the step in flight
        self.draining = False  # (Shutdown: new requests are acked as aborted)
        self._arrivals, self._last = itertools.count(), -1  # (jobs' arrival order; the last one a step took)
        self.late_aborts = self.stale = self.tokens = 0  # (stale: replaced copies; tokens: embedded, every step)
        self._work = asyncio.Event()
        self._device = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sluice-device")

    def handlers(self):
        return {PoolRequest: self.on_request, Abort: self.on_abort, CheckIdle: self.on_check}

    async def on_start(self) -> None:
        torch.set_num_threads(self.config.threads())
        loop = asyncio.get_running_loop()
        self.model = await loop.run_in_executor(self._device, self._load)
        c = self.model_config
        log.info("pooling engine ready: %s, %s pooling, max_model_len %d", c.name, c.pooling.pooling_type,
                 self.max_model_len)  # fmt: skip
        self.spawn(self._step_loop())
        if self.config.stats_to:
            self.spawn(self._publish_stats())

    def on_request(self, msg: PoolRequest) -> None:
        if self.draining:
            self.tell(msg.client, AbortAck(request_id=msg.request_id, reason="shutdown", attempt=msg.attempt))
            return
        held = self.jobs.get(msg.request_id)
        if held is not None and held.msg.attempt >= msg.attempt:
            self.stale += 1
            return
        if error := self._invalid(msg):
            self._send(msg, error=error)
            return
        self.jobs.pop(msg.request_id, None)  # (an older copy's place goes: the new one queues at the end)
        self.jobs[msg.request_id] = Job(msg, next(self._arrivals), [None] * len(msg.inputs))
        self._work.set()

    def on_abort(self, msg: Abort) -> None:
        job = self.jobs.get(msg.request_id)
        if job is None:
            self.late_aborts += 1
        elif job in self.stepping:
            job.aborted = msg.reason
        else:
            del self.jobs[msg.request_id]
            self.tell(job.msg.client, AbortAck(request_id=msg.request_id, reason=msg.reason, attempt=job.msg.attempt))

    def on_check(self, msg: CheckIdle) -> IdleReport:
        details = {"queued": len(self.jobs), "in_step": len(self.stepping), "pending_asks": self.pending_asks}
        return IdleReport(actor=self.name, idle=not any(details.values()), details=details)

    async def on_shutdown(self, reason: str) -> None:
        self.draining = True
        for rid in list(self.jobs):  # (those in the step are acked as it ends)
            self.on_abort(Abort(request_id=rid, reason="shutdown"))
        await self.until(lambda: not self.jobs, 10)
        self._device.shutdown(wait=False, cancel_futures=True)

    def _load(self):
        """An encoder (gpu/models/bert.py), or a decoder's states (gpu/runner/pooling.py): `model(ids, lens, types)`."""
        c, e = self.model_config, self.config
        if isinstance(c, EncoderConfig):
            return load_encoder(c, e.cpu_kernels)
        tokens = max(e.max_num_batched_tokens, self.max_model_len)  # (an input longer than the budget runs alone)
        return CausalStates(c.model, tokens, e.max_num_seqs, e.cpu_kernels, c.score_tokens)

    def _invalid(self, msg: PoolRequest) -> str | None:
        c = self.model_config
        for ids in msg.inputs:
            if not 0 < len(ids) <= self.max_model_len:
                return f"an input has {len(ids)} tokens; 1 to max_model_len {self.max_model_len} are taken"
            if not all(0 <= t < c.vocab_size for t in ids):
                return f"a token id is outside the vocabulary (0 .. {c.vocab_size - 1})"
        # (a decoder has no segments, nor has MPNet: a pair's second text, segment 1 by its tokenizer, is ignored)
        types = msg.token_type_ids if isinstance(c, EncoderConfig) and c.type_vocab_size else None
        if types is not None and (len(types) != len(msg.inputs) or any(
                len(t) != len(ids) or not all(0 <= k < c.type_vocab_size for k in t)
                for t, ids in zip(types, msg.inputs, strict=False))):  # fmt: skip
            return "token_type_ids must give each token of each input a segment the model has"
        if msg.dimensions is not None and msg.dimensions not in c.dimensions:
            return f"dimensions {msg.dimensions}: this model is not served for matryoshka dimensions"
        return None

    def _batch(self) -> list[tuple[Job, int]]:
        """The inputs of the next step, whole, up to the token budget and max_num_seqs inputs (one at least): one of
        each request in turn (round robin in arrival order, from the request after the last one the step before
        took), so that a request of a few inputs waits at most a round, and none waits for ever."""
        taken, budget = [], self.config.max_num_batched_tokens
        left = [job for job in self.jobs.values() if job.next < len(job.msg.inputs)]
        start = next((i for i, job in enumerate(left) if job.order > self._last), 0)
        left = left[start:] + left[:start]
        while left:
            for job in left:
                n = len(job.msg.inputs[job.next])
                if taken and (n > budget or len(taken) == self.config.max_num_seqs):
                    return taken
                taken.append((job, job.next))
                self._last = job.order
                job.next, budget = job.next + 1, budget - n
            left = [job for job in left if job.next < len(job.msg.inputs)]
        return taken

    def _embed(self, inputs: list[list[int]], types: list[list[int]] | None) -> torch.Tensor:
        """Each input's embedding (not normalized: `_send` does), or a cross-encoder's logits."""
        lens, p = [len(ids) for ids in inputs], self.model_config.pooling
        typed = None if types is None else torch.tensor([t for ids in types for t in ids])
        with torch.no_grad():
            hidden = self.model(torch.tensor([t for ids in inputs for t in ids]), lens, typed)
            if self.model.head is not None:
                return self.model.classify(hidden, lens)
            return pool(hidden, lens, p.pooling_type, normalize=False)

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._work.wait()
            self._work.clear()
            while self.jobs:
                taken = self._batch()
                if not taken:
                    break
                inputs = [job.msg.inputs[i] for job, i in taken]
                typed = any(job.msg.token_type_ids is not None for job, _ in taken)
                types = [job.msg.token_type_ids[i] if job.msg.token_type_ids else [0] * len(job.msg.inputs[i])
                         for job, i in taken] if typed else None  # fmt: skip
                self.stepping = {job for job, _ in taken}
                try:
                    out = await loop.run_in_executor(self._device, self._embed, inputs, types)
                    error, self.tokens = None, self.tokens + sum(map(len, inputs))
                except Exception as e:  # (a failure of the forward fails the requests of that step alone)
                    log.exception("pooling step of %d inputs failed", len(inputs))
                    out, error = None, f"the pooling step failed: {type(e).__name__}: {e}"
                finally:
                    self.stepping = set()
                for k, (job, i) in enumerate(taken):
                    job.done[i] = None if out is None else out[k]
                    self._finish(job, error)
                self.moved()

    async def _publish_stats(self) -> None:
        """/metrics' engine gauges and the prompt tokens counter (sluice:prompt_tokens_total: the detokenizer's,
        which a pooling model has none of)."""
        while True:
            queued = sum(job not in self.stepping for job in self.jobs.values())
            engine = EngineStats(num_running=len(self.stepping), num_waiting=queued, kv_usage=0.0,
                                 prompt_tokens_total=self.tokens, generation_tokens_total=0,
                                 late_aborts_total=self.late_aborts)  # fmt: skip
            counts = DetokStats(stale_outputs_dropped_total=0, protocol_violations_total=0, num_tombstones=0,
                                prompt_tokens_total=self.tokens)  # fmt: skip
            for actor in self.config.stats_to:
                self.tell(actor, engine)
                self.tell(actor, counts)
            await asyncio.sleep(self.config.stats_interval_s)

    def _finish(self, job: Job, error: str | None) -> None:
        rid = job.msg.request_id
        if self.jobs.get(rid) is not job:
            return  # (replaced by a newer copy, or already ended)
        if job.aborted is not None:
            del self.jobs[rid]
            self.tell(job.msg.client, AbortAck(request_id=rid, reason=job.aborted, attempt=job.msg.attempt))
        elif error is not None:
            del self.jobs[rid]
            self._send(job.msg, error=error)
        elif all(e is not None for e in job.done):
            del self.jobs[rid]
            self._send(job.msg, rows=torch.stack(job.done))

    def _send(self, msg: PoolRequest, rows: torch.Tensor | None = None, error: str | None = None) -> None:
        if rows is not None and self.model.head is None:
            if msg.dimensions is not None:
                rows = rows[:, : msg.dimensions]
            if self.model_config.pooling.normalize if msg.normalize is None else msg.normalize:
                rows = F.normalize(rows, p=2, dim=-1)
        data = b"" if rows is None else rows.contiguous().numpy().astype("<f4").tobytes()
        dim = 0 if rows is None else rows.shape[1]
        self.tell(msg.client, PoolOutput(request_id=msg.request_id, attempt=msg.attempt, dim=dim, data=data,
                                         error=error))  # fmt: skip

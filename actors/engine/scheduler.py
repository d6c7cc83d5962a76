"""Scheduler: continuous batching with one token budget per step (vLLM v1 style), pure Python.

Invariants (sync use: schedule N, update N, schedule N+1, ...; one-ahead use: schedule N, schedule N+1, update N,
schedule N+2, update N+1, ...):

- At most two scheduled batches are not yet updated: `schedule()` plans with at most one in flight.
- `schedule()` advances `num_computed_tokens` and counts each sampling row as one pending token. A row's tokens are
  known on the host except possibly its last, a token sampled by the batch in flight: that one is PLACEHOLDER and the
  runner takes it from the device (slot-indexed buffer). A request is never scheduled when its in-flight sample is
  certain to end it (its `length_limit`: max_tokens, max_model_len); an EOS or stop token sampled in flight leaves a
  junk row in the next batch, whose sample `update()` discards (counted in `num_discarded_samples`).
- Every row makes its request in flight until that batch's `update()` (or `drop()`, when the worker lost it); what
  a finished or aborted request holds is freed after that (actors/engine/lifecycle.py).
- Preemption (recompute) frees the victim's blocks at once: the device runs steps in order, so a later step rewriting
  those blocks runs after every in-flight reader. The victim keeps its slot and is not re-admitted until its in-flight
  sample is known, so it resumes from prompt + output and produces exactly the tokens it would have produced without
  preemption.
- Speculative decoding: actors/engine/lookahead.py; beam search: actors/engine/beams.py.
- Each request's planning and each of its results run in a `try` that hands what it raises to `_failed`, with its
  `snapshot` as it began: it fails alone (its rows taken back, its terminal output in `failed` or the step's outputs:
  actors/engine/isolation.py). One in `isolate_after` failed steps (a poison: the worker died in them) runs alone.
- A slot is (re)assigned on admission; the sequence's first row there sends its whole block table (blocks_from 0:
  BlockManager.unsent), its later rows only the blocks added since.
Progress (no livelock, no starvation: tests/test_scheduler_progress.py):
- Every request fits the whole KV cache alone at its longest: one max_model_len sequence (checked at construction;
  lookahead never passes max_tokens or max_model_len), a CFG pair at both halves' longest (`add_request` raises;
  the intake refuses it first, a 400 naming guidance_scale: actors/engine/guidance.py), a beam group with every
  beam at its longest, none shared (the intake refuses it, a 400 naming best_of: actors/engine/beams.py).
- `running` is in admission order; a request short of blocks preempts the youngest (`_make_room`), never an older
  one. The oldest running request is never preempted: alone and still short, it waits for what requests that ended
  with a step in flight hold (the only other holders then), freed when that step reports. So it gains a token in
  every step without a sample in flight that ends it (a budget of 2 holds a decoding pair) and finishes within its
  remaining tokens' steps; then the next one is the oldest.
- A victim returns to the front of the queue in running order; admission is FIFO (but past a request whose LoRA
  adapter is over the cap, for a while: actors/engine/admission.py) and skips a step short of blocks: nothing younger
  overtakes it, and once nothing runs the head is admitted when the steps in flight report.
  `n` choices are separate requests: the oldest finishes first while the youngest are preempted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from actors.engine.admission import Admission
from actors.engine.beams import beam_plan
from actors.engine.block_manager import BlockManager
from actors.engine.guidance import companion_row, pair_fit_error, pair_tokens
from actors.engine.isolation import RequestIsolation, snapshot
from actors.engine.lifecycle import RequestLedger
from actors.engine.lookahead import Lookahead
from actors.engine.lora_table import LoraTable
from actors.engine.request import EngineRequest
from actors.engine.spec_stats import SpecStats
from gpu.batch import BatchSpec, ScheduledRow
from messages.wire import RequestOutput, TokenLogprobs


class Scheduler(Lookahead, RequestIsolation, Admission, RequestLedger):
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: Iterable[int],
        release: Callable[[EngineRequest], None] | None = None,
        long_prefill_token_threshold: int | None = None,
        isolate_after: int = 1,
        max_loras: int | None = None,
        loras: LoraTable | None = None,
    ):
        if block_manager.num_blocks * block_manager.block_size < max_model_len:
            raise ValueError("the KV cache must hold at least one sequence of max_model_len tokens")
        if min(max_num_seqs, max_num_batched_tokens, max_model_len) < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_model_len must be >= 1")
        if (long_prefill_token_threshold or 0) < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0 (0: off), got {long_prefill_token_threshold}")
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        # vLLM's knob, applied while others decode: one request's prefill chunk in a step that also decodes (0 or
        # None: off, the budget). A long prompt then delays the running requests by a bounded chunk per step; a wave
        # of short prompts, or any prompt while nothing decodes, still prefills at once.
        self.long_prefill_token_threshold = long_prefill_token_threshold or max_num_batched_tokens
        super().__init__(block_manager, max_num_seqs, max_model_len, eos_token_ids, release)
        self.isolate_after = isolate_after  # a request in this many failed steps (a suspected poison) runs alone
        self.max_loras, self.loras = max_loras, loras
        self.in_flight: deque[int] = deque()  # steps scheduled and not yet updated
        self.next_step = 0
        self.num_discarded_samples = self.prompt_tokens_total = self.generation_tokens_total = 0  # (/metrics' counts)
        self.spec = SpecStats()
        self.failed: list[RequestOutput] = []  # terminal outputs for the next numbered StepOutputs (drain_failed)

    # ---------------------------------------------------------------- requests

    def add_request(self, req: EngineRequest) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if not 0 < req.num_prompt_tokens < self.max_model_len:
            raise ValueError(f"prompt has {req.num_prompt_tokens} tokens, need 1..{self.max_model_len - 1}")
        if req.companion is not None:
            sizes = req.num_prompt_tokens, len(req.companion.prompt_token_ids), req.params.max_tokens
            if error := pair_fit_error(*sizes, self.max_model_len, self.block_manager):
                raise error  # (a ParamError: a ValueError)
        self.requests[req.request_id] = req
        req.length_limit = min(req.num_prompt_tokens + req.params.max_tokens, self.max_model_len - req.overhang)
        if req.params.beam is not None:
            self._join(req)
            return
        self.waiting.append(req)
        self.matchers += req.grammar is not None

    # ---------------------------------------------------------------- step

    def schedule(self, drafts: dict[str, list[int]] | None = None) -> BatchSpec:
        """Plan the next step; `drafts`: request id -> draft tokens (for speculation_candidates()). A batch without
        rows is not in flight and needs no update()."""
        if len(self.in_flight) > 1:
            raise RuntimeError("schedule() may run at most one batch ahead of update()")
        batch = BatchSpec(step=self.next_step)
        budget = self.max_num_batched_tokens
        decoding = any(r.decoding for r in self.running)
        chunk = self.long_prefill_token_threshold if decoding else budget  # one request's prefill this step
        suspect = next((r for r in self.running if self._suspect(r)), None)  # it runs in steps of its own
        short = False  # blocks ran out: no admission this step (a request preempted now would only thrash)
        planned, i = [], 0
        while i < len(self.running) and budget > 0:  # each row's own tokens first, oldest first
            req = self.running[i]
            i += 1
            if self._waits(req) or suspect not in (None, req):
                continue
            before = snapshot(req)
            try:  # (each request's planning fails it alone)
                plan = self._plan(req, budget, chunk)
                if not (self.fault is None and self.block_manager.try_grow(plan)):  # (a fault plan: its site with room)
                    if not self.block_manager.may_grow(plan):
                        short = True
                        if not self._make_room(req, plan):
                            break
                    self.inject("scheduler.schedule", req)
                    self.block_manager.grow(plan)
                if not drafts:  # (its rows now: no drafts follow)
                    self._add_rows(batch, req, plan)
            except Exception as e:
                self._failed(req, before, e, self.failed, planning=True)
                i -= 1  # (it left the running list)
                continue
            if drafts:
                planned.append((req, plan, before))
            for _, n in plan:
                budget -= n
        for req, plan, before in planned:  # then drafts, in what budget and free blocks are left: they never cost a row
            try:
                row_drafts = self._lookahead(req, plan, budget, drafts) if drafts else []
                if row_drafts:
                    plan = [(seq, n + len(row_drafts)) for seq, n in plan]  # (each sequence feeds them)
                    self.block_manager.append_slots(req, plan[0][1])  # (the companion's grow with its row)
                    budget -= len(row_drafts) * len(plan)
                self._add_rows(batch, req, plan, row_drafts)
            except Exception as e:
                self._failed(req, before, e, self.failed, planning=True)
        if not short and suspect is None:  # (no admission in a step short of blocks)
            self._admit_queue(batch, budget, chunk)
        if batch.rows:
            self.in_flight.append(batch.step)
            self.next_step += 1
        return batch

    def update(
        self,
        batch: BatchSpec,
        sampled: list[int],
        num_emitted: list[int] | None = None,
        logprobs: TokenLogprobs | None = None,
    ) -> list[RequestOutput]:
        """Apply a step's results: `sampled` holds the batch's sampled positions in order (1 per sampling row,
        1 + K for a row verifying K drafts); `num_emitted[j]`: how many leading positions sampling row j emits
        (None: one each); `logprobs`: theirs (a beam search's candidates)."""
        if not batch.rows:
            return []
        if not self.in_flight or self.in_flight[0] != batch.step:
            raise RuntimeError(f"update() for step {batch.step}, expected {list(self.in_flight)[:1]}")
        samples = [row.num_samples for row in batch.rows]
        if len(sampled) != sum(samples):
            raise ValueError(f"{len(sampled)} sampled tokens for {sum(samples)} sampled positions")
        self.in_flight.popleft()
        outputs, searches = [], {}
        pos, emitted = 0, None if num_emitted is None else iter(num_emitted)
        for row, k in zip(batch.rows, samples, strict=True):
            req = self.requests[row.request_id]
            req.num_inflight_steps -= 1
            if k:
                n = 1 if emitted is None else next(emitted)
                tokens, at, pos = sampled[pos : pos + n], pos, pos + k
                req.num_pending_tokens -= 1
                before = snapshot(req)
                try:  # (each request's results fail it alone)
                    self._apply(req, row, tokens, logprobs, at, outputs, searches)
                except Exception as e:
                    self._failed(req, before, e, outputs)
            self._settle(req)
        for req in searches:
            before = snapshot(req)
            try:
                outputs += self._search_step(req)
            except Exception as e:
                self._failed(req, before, e, outputs)
        return outputs

    def drop(self, batch: BatchSpec) -> list[EngineRequest]:
        """A step in flight that will never report (its worker was lost): undo what scheduling it counted; its
        requests (the preempted ones and those ended meanwhile are freed here if it was their last step)."""
        if not self.in_flight or self.in_flight[0] != batch.step:
            raise RuntimeError(f"drop() of step {batch.step}, expected {list(self.in_flight)[:1]}")
        self.in_flight.popleft()
        reqs = []
        for row in batch.rows:
            req = self.requests[row.request_id]
            req.num_inflight_steps -= 1
            req.num_pending_tokens -= row.num_samples > 0
            reqs.append(req)
            self._settle(req)
        return reqs

    # ---------------------------------------------------------------- internals

    def _apply(self, req: EngineRequest, row, tokens: list[int], lists, at: int, outputs: list, searches: dict) -> None:
        """A sampling row's results: the `tokens` it emits, sampled from position `at` of the step's logprob `lists`
        (a beam's candidates); a plain request's output appended last (RequestIsolation)."""
        req.failed_steps = 0  # it sampled: no longer a suspect
        if row.draft_token_ids:
            self._verified(req, len(row.draft_token_ids), len(tokens) - 1)
        if req.is_finished:
            self.num_discarded_samples += len(tokens)
            return
        if self.fault is not None:
            self.inject("scheduler.update", req)
        if req.beams is not None:
            req.beams.sampled(row.slot, lists, at)
            searches[req] = None
        else:
            outputs.append(self._append_tokens(req, tokens))

    def _waits(self, req: EngineRequest) -> bool:
        """Nothing of a running request to feed this step: it is computed to its end (drafts in flight), or its samples
        in flight certainly end it (max_tokens, max_model_len: another row would be junk); a beam group's step is in
        flight (its next rows follow from its decision)."""
        if req.beams is not None:
            return req.num_inflight_steps > 0
        n = len(req.prompt_token_ids) + len(req.output_token_ids) + req.num_pending_tokens  # (num_tokens, inline)
        return req.num_computed_tokens >= n or n >= req.length_limit

    def _plan(self, req: EngineRequest, budget: int, chunk: int) -> list[tuple[object, int]]:
        """Each of the request's sequences and the tokens it feeds this step (actors/engine/guidance.py, beams.py)."""
        if req.beams is not None:
            return beam_plan(req, budget, chunk)
        if req.companion is not None:
            n, m = pair_tokens(req, budget, chunk)
            return [(req, n), (req.companion, m)]
        return [(req, min(req.num_tokens - req.num_computed_tokens, budget, chunk))]

    def _add_rows(self, batch: BatchSpec, req: EngineRequest, plan: list, drafts: list[int] = ()) -> None:
        """The rows of a plan: the request's, then its CFG companion's (built first: the parent's row adds a pending
        token to both sequences); a beam group's, one per beam fed."""
        if req.beams is not None:
            batch.rows += [self._row(req, n, seq=beam) for beam, n in plan if n]
            return
        if req.companion is None:  # (the common row: it feeds at least one token, _plan)
            batch.rows.append(self._row(req, plan[0][1], drafts))
            return
        n, m = plan[0][1], plan[1][1]  # (the companion's: _plan)
        guide = companion_row(req, m, self.block_manager, drafts) if m else None
        if n:
            batch.rows.append(self._row(req, n, drafts))
        if guide:
            batch.rows.append(guide)

    def _row(self, req: EngineRequest, n: int, drafts: list[int] = (), seq=None) -> ScheduledRow:
        """The row feeding n tokens of the request (or of `seq`, one of its beams)."""
        seq = seq or req
        start, fed = seq.num_computed_tokens, n - len(drafts)
        sample = start + fed == seq.num_tokens
        # prompt_logprobs: the prompt tokens after the fed ones, until the first output token is known
        wants = req.params.prompt_logprobs is not None and req.fresh
        targets = req.prompt_token_ids[start + 1 : start + n + 1] if wants else []
        token_ids = seq.token_ids(start, start + fed)
        sent, blocks = self.block_manager.unsent(seq)
        row = ScheduledRow(req.request_id, seq.slot, token_ids + drafts if drafts else token_ids, start, blocks, sample,
                           targets, drafts or [], output_position=req.num_output_tokens, lora=req.params.lora,
                           blocks_from=sent)  # fmt: skip
        seq.num_computed_tokens += n
        if not req.scheduled_at:
            self._first_scheduled(req)
        self.block_manager.cache_full_blocks(seq)
        req.num_pending_tokens += sample
        req.num_inflight_steps += 1
        return row

    def _suspect(self, req: EngineRequest) -> bool:
        return req.failed_steps >= self.isolate_after

"""Drives the Scheduler for its tests: a fake paged-KV model whose next token hashes the context it
reads back through the block tables, so a wrong position, block table, placeholder or recompute
changes the output, and a harness that checks every step. `Harness.run` ends idle within its step bound: no
request, block, slot or in-flight step left."""

import random
from collections import defaultdict, deque

from actors.engine.block_manager import BlockManager
from actors.engine.metrics import idle_details
from actors.engine.request import Companion, EngineRequest
from actors.engine.scheduler import Scheduler
from gpu.batch import PLACEHOLDER, BatchSpec
from gpu.runner.slot_tables import SlotTables
from messages.sampling_params import SamplingParams

VOCAB = 97
EOS = 96


def next_token(ctx: list[int]) -> int:
    h = 17
    for t in ctx:
        h = (h * 131 + t + 1) % 1_000_003
    return h % VOCAB


def chain(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


def expected(prompt, p: SamplingParams, max_model_len: int, eos=(EOS,)):
    """The oracle: tokens and (finish_reason, stop_reason) of an unbatched run."""
    out = []
    for tok in chain(prompt, min(p.max_tokens, max_model_len - len(prompt))):
        out.append(tok)
        if len(out) > p.min_tokens and tok in eos and not p.ignore_eos:
            return out, ("stop", None)
        if len(out) > p.min_tokens and tok in p.stop_token_ids:
            return out, ("stop", tok)
    return out, ("length", None)


class FakeModel:
    """Executes batches in order like a device: writes fed tokens into a paged KV dict, reads the
    whole context back for sampling rows, keeps the last sample per slot for PLACEHOLDERs."""

    def __init__(self, block_size: int):
        self.bs = block_size
        self.kv: dict[tuple[int, int], int] = {}
        self.prev: dict[int, int] = {}
        self.tables = SlotTables()  # (each row sends the blocks its slot lacks: the runner's own bookkeeping)
        self.resolved: list[list[int]] = []  # the last step's rows' whole tables

    def execute(self, batch: BatchSpec) -> tuple[list[int], list[int]]:
        """The sampled positions in order (a row verifying K drafts samples its last K + 1) and how many each
        sampling row emits: its drafts up to the first the model disagrees with, plus one. A CFG companion's row
        only writes its KV (its PLACEHOLDER is its parent's last sample; guidance does not change the output)."""
        sampled, emitted, prev = [], [], dict(self.prev)  # PLACEHOLDERs are the step before's samples
        parent_slot = {r.request_id: r.slot for r in batch.rows if r.guidance_scale is None}
        tables, lens = self.tables.resolve(batch.step, batch.rows)
        self.resolved = [table[:n] for table, n in zip(tables.tolist(), lens.tolist(), strict=True)]
        for row, table in zip(batch.rows, self.resolved, strict=True):
            ids = list(row.token_ids)
            assert ids and PLACEHOLDER not in ids[:-1]
            if ids[-1] == PLACEHOLDER:
                ids[-1] = prev[row.slot if row.guidance_scale is None else parent_slot[row.request_id]]
            end = row.num_computed + len(ids)
            assert len(table) >= -(-end // self.bs)
            for pos, tok in enumerate(ids, row.num_computed):
                self.kv[table[pos // self.bs], pos % self.bs] = tok
            if row.sample and row.guidance_scale is None:
                ctx = [self.kv[table[p // self.bs], p % self.bs] for p in range(end)]
                k = len(row.draft_token_ids)
                samples = [next_token(ctx[: end - k + j]) for j in range(k + 1)]
                n = next((j for j in range(k) if samples[j] != row.draft_token_ids[j]), k) + 1
                self.prev[row.slot] = samples[n - 1]
                sampled += samples
                emitted.append(n)
        return sampled, emitted


class Harness:
    """Drives schedule/execute/update in sync mode or one batch ahead, checking every step."""

    def __init__(
        self,
        one_ahead=False,
        num_blocks=64,
        block_size=4,
        max_num_seqs=4,
        budget=32,
        max_model_len=64,
        eos=(EOS,),
        proposer=None,
        long_prefill=None,
        caching=False,
        max_loras=None,
        loras=None,
    ):
        """`loras`: the scheduler's LoraTable (actors/engine/lora_table.py); the fake worker holds what it wants at
        once."""
        self.sched = Scheduler(
            BlockManager(num_blocks, block_size, caching), max_num_seqs, budget, max_model_len, eos,
            long_prefill_token_threshold=long_prefill, max_loras=max_loras, loras=loras,
        )  # fmt: skip
        self.proposer = proposer  # (request, at most k) -> drafts
        self.model = FakeModel(block_size)
        self.one_ahead = one_ahead
        self.queue: deque[tuple[BatchSpec, tuple[list[int], list[int]]]] = deque()  # scheduled, not yet updated
        self.empty_before = False
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finish: dict[str, tuple] = {}
        self.acks: list[str] = []
        self.batches: list[BatchSpec] = []
        self.requests: dict[str, EngineRequest] = {}
        self.peak_blocks = 0  # the most blocks in use after a schedule()
        self.worker_loras: set[str] = set(loras.held) if loras else set()  # the fake worker's adapters ...
        self.stalls = 0  # ... and its steps that had to load a row's adapter first
        self.broken_loras: set[str] = set()  # ... and those whose files it cannot load
        self.preempted: set[str] = set()  # the requests the last schedule() preempted

    def add(self, rid, prompt, negative: list[int] | None = None, **params):
        """A request; with a `negative` prompt, guided (guidance_scale 2) by a CFG companion holding it."""
        req = EngineRequest(rid, list(prompt), SamplingParams(guidance_scale=2.0 if negative else 1.0, **params))
        req.companion = Companion(req, negative) if negative else None
        self.sched.add_request(req)
        self.requests[rid] = req

    def step_bound(self) -> int:
        """Steps within which every request added so far ends (actors/engine/scheduler.py, "Progress"): each in turn
        is the oldest, which gains a token every step (its prompts, then its output twice at most: before and after
        a preemption) but for 3 steps at most on each wait for steps in flight (its admission, its end, and each
        request ending in flight while it is short of blocks)."""
        waits = 3 * (len(self.requests) + 2)
        companions = [len(r.companion.prompt_token_ids) if r.companion else 0 for r in self.requests.values()]
        return sum(
            r.num_prompt_tokens + c + 2 * r.params.max_tokens + waits
            for r, c in zip(self.requests.values(), companions, strict=True)
        )

    def drafts(self) -> dict[str, list[int]] | None:
        if self.proposer is None:
            return None
        return {req.request_id: self.proposer(req, k) for req, k in self.sched.speculation_candidates()}

    def step(self) -> BatchSpec:
        s = self.sched
        running = {r.request_id for r in s.running}
        batch = s.schedule(self.drafts())
        self.preempted = running - {r.request_id for r in s.running}  # by this schedule()
        assert batch.rows or self.queue or not s.has_unfinished(), "deadlock: nothing to run, nothing in flight"
        assert batch.num_tokens <= s.max_num_batched_tokens and len(batch.rows) <= s.max_num_seqs
        parents = [r.request_id for r in batch.rows if r.guidance_scale is None]  # (a companion's row shares its id)
        assert len(set(parents)) == len(parents) and len({r.slot for r in batch.rows}) == len(batch.rows)
        assert all(r.num_computed + len(r.token_ids) < s.max_model_len for r in batch.rows)
        bm = s.block_manager
        self.peak_blocks = max(self.peak_blocks, bm.num_blocks - bm.num_free_blocks)
        sampled = self.model.execute(batch)
        if s.loras is not None:
            self._lora_worker(batch)
        self._check_contexts(batch)
        self.batches.append(batch)
        if batch.rows:
            self.queue.append((batch, sampled))
        # One-ahead: update a batch once the next one is scheduled; after an empty schedule, try
        # scheduling once more before letting the device catch up.
        if len(self.queue) == 2 or (self.queue and not (self.one_ahead and (batch.rows or not self.empty_before))):
            self._update(*self.queue.popleft())
        self.empty_before = not batch.rows
        return batch

    def _lora_worker(self, batch: BatchSpec) -> None:
        """The fake worker's adapters (actors/engine/worker_loras.py): it holds what the step wants but the broken ones,
        and reports it (a row of a broken adapter runs on the base model, its failure reported)."""
        before = self.worker_loras
        if (wanted := self.sched.loras.desired()) is not None:
            self.worker_loras = set(wanted) - self.broken_loras
        rows = {r.lora for r in batch.rows} - {None}
        assert rows - self.broken_loras <= self.worker_loras and len(self.worker_loras) <= self.sched.loras.capacity
        if rows - before - self.broken_loras:  # (a load before the step: only in a step of nothing else)
            assert len({r.request_id for r in batch.rows}) == 1, "a step stalled for another request's adapter"
            self.stalls += 1
        failed = {d: "broken files" for d in (set(wanted or ()) | rows) & self.broken_loras}
        self.sched.lora_report(sorted(self.worker_loras), failed)

    def drained(self) -> list[str]:
        """The ids `drain_aborted` gives now (their AbortAcks are due)."""
        return [r.request_id for r in self.sched.drain_aborted()]

    def _check_contexts(self, batch: BatchSpec) -> None:
        """After a step, every row's block table holds its sequence's known tokens below its start (computed by
        itself, taken from the cache, or written by another row of the step: a device writes every row's KV before
        any row attends): a shared block overwritten, or a cached block handed out after its eviction, fails."""
        bs, kv = self.model.bs, self.model.kv
        for row, table in zip(batch.rows, self.model.resolved, strict=True):
            req = self.requests[row.request_id]
            known = (req if row.guidance_scale is None else req.companion).all_token_ids
            for pos in range(min(row.num_computed, len(known))):
                held = kv.get((table[pos // bs], pos % bs))
                who = row.request_id if row.guidance_scale is None else f"{row.request_id}'s companion"
                assert held == known[pos], f"{who} position {pos}: {held} in KV, not {known[pos]}"

    def _update(self, batch, result):
        self._record([*self.sched.drain_failed(), *self.sched.update(batch, *result)])  # (step_outputs.py's order)
        acks = self.drained()
        assert not set(acks) & set(self.acks) and not set(acks) & set(self.finish)
        self.acks += acks

    def traffic(self, reqs, steps: int) -> None:
        """Step `steps` times; reqs: (id, prompt, params, arrival step, abort step or None), then run to the end."""
        for t in range(steps):
            for rid, prompt, p, arrive, abort_at in reqs:
                if arrive == t:
                    self.add(rid, prompt, **p)
                if abort_at == t and arrive <= t:
                    self.sched.abort(rid)
            self.step()
        self.run()

    def _record(self, outputs) -> None:
        for out in outputs:
            assert out.request_id not in self.finish and out.seq == len(self.tokens[out.request_id])
            self.tokens[out.request_id] += out.new_token_ids
            if out.finish_reason:
                self.finish[out.request_id] = (out.finish_reason, out.stop_reason)

    def run(self, max_steps=2000):
        """Step until nothing is left; more than `max_steps` steps fails as a livelock."""
        for _ in range(max_steps):
            if not (self.sched.has_unfinished() or self.queue):
                break
            self.step()
        left = [r.request_id for r in (*self.sched.running, *self.sched.waiting)]
        assert not left, (
            f"livelock: {left} unfinished after {max_steps} more steps, {self.sched.num_preemptions} preemptions"
        )
        self.acks += self.drained()
        self._record(self.sched.drain_failed())  # (sent as the engine goes idle: step_outputs.py's _report_held)
        assert set(idle_details(self.sched).values()) == {0}, idle_details(self.sched)
        bm = self.sched.block_manager
        for row in (r for b in self.batches for r in b.rows):  # tables as scheduled, not grown later
            assert row.blocks_from + len(row.block_table) == -(
                -(row.num_computed + len(row.token_ids)) // bm.block_size
            )
        assert bm.num_free_blocks == bm.num_blocks and sorted(bm.free_queue) == list(range(bm.num_blocks))


def prompts(n, seed=0, lo=1, hi=30):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB - 1) for _ in range(rng.randint(lo, hi))] for _ in range(n)]

"""Scheduler: driven by a fake paged-KV model whose next token hashes the context it reads back
through the block tables, so a wrong position, block table, placeholder or recompute changes
the output. Every test ends idle: no request, block, slot or in-flight step left."""

import random
from collections import defaultdict, deque

import pytest

from actors.engine.block_manager import BlockManager
from actors.engine.request import EngineRequest
from actors.engine.scheduler import Scheduler
from gpu.batch import PLACEHOLDER, BatchSpec
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

    def execute(self, batch: BatchSpec) -> list[int]:
        sampled = []
        for row in batch.rows:
            ids = list(row.token_ids)
            assert ids and PLACEHOLDER not in ids[:-1]
            if ids[-1] == PLACEHOLDER:
                ids[-1] = self.prev[row.slot]
            end = row.num_computed + len(ids)
            assert len(row.block_table) >= -(-end // self.bs)
            for pos, tok in enumerate(ids, row.num_computed):
                self.kv[row.block_table[pos // self.bs], pos % self.bs] = tok
            if row.sample:
                tok = next_token([self.kv[row.block_table[p // self.bs], p % self.bs] for p in range(end)])
                self.prev[row.slot] = tok
                sampled.append(tok)
        return sampled


class Harness:
    """Drives schedule/execute/update in sync mode or one batch ahead, checking every step."""

    def __init__(
        self, one_ahead=False, num_blocks=64, block_size=4, max_num_seqs=4, budget=32, max_model_len=64, eos=(EOS,)
    ):
        self.sched = Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget, max_model_len, eos)
        self.model = FakeModel(block_size)
        self.one_ahead = one_ahead
        self.queue: deque[tuple[BatchSpec, list[int]]] = deque()  # scheduled, not yet updated
        self.empty_before = False
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finish: dict[str, tuple] = {}
        self.acks: list[str] = []
        self.batches: list[BatchSpec] = []

    def add(self, rid, prompt, **params):
        self.sched.add_request(EngineRequest(rid, list(prompt), SamplingParams(**params)))

    def step(self) -> BatchSpec:
        s = self.sched
        batch = s.schedule()
        assert batch.rows or self.queue or not s.has_unfinished(), "deadlock: nothing to run, nothing in flight"
        assert batch.num_tokens <= s.max_num_batched_tokens and len(batch.rows) <= s.max_num_seqs
        assert len({r.request_id for r in batch.rows}) == len({r.slot for r in batch.rows}) == len(batch.rows)
        assert all(r.num_computed + len(r.token_ids) < s.max_model_len for r in batch.rows)
        sampled = self.model.execute(batch)
        self.batches.append(batch)
        if batch.rows:
            self.queue.append((batch, sampled))
        # One-ahead: update a batch once the next one is scheduled; after an empty schedule, try
        # scheduling once more before letting the device catch up.
        if len(self.queue) == 2 or (self.queue and not (self.one_ahead and (batch.rows or not self.empty_before))):
            self._update(*self.queue.popleft())
        self.empty_before = not batch.rows
        return batch

    def _update(self, batch, sampled):
        for out in self.sched.update(batch, sampled):
            assert out.request_id not in self.finish and out.seq == len(self.tokens[out.request_id])
            self.tokens[out.request_id] += out.new_token_ids
            if out.finish_reason:
                self.finish[out.request_id] = (out.finish_reason, out.stop_reason)
        acks = self.sched.drain_aborted()
        assert not set(acks) & set(self.acks) and not set(acks) & set(self.finish)
        self.acks += acks

    def run(self, max_steps=2000):
        for _ in range(max_steps):
            if not (self.sched.has_unfinished() or self.queue):
                break
            self.step()
        self.acks += self.sched.drain_aborted()
        assert set(self.sched.check_idle().values()) == {0}, self.sched.check_idle()
        bm = self.sched.block_manager
        for row in (r for b in self.batches for r in b.rows):  # tables as scheduled, not grown later
            assert len(row.block_table) == -(-(row.num_computed + len(row.token_ids)) // bm.block_size)
        assert bm.num_free_blocks == bm.num_blocks and sorted(bm.free_block_ids) == list(range(bm.num_blocks))


def prompts(n, seed=0, lo=1, hi=30):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB - 1) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("one_ahead", [False, True])
@pytest.mark.parametrize("num_blocks", [64, 12])  # 12 blocks of 4 force preemptions
def test_outputs_match_unbatched_reference(one_ahead, num_blocks):
    h = Harness(one_ahead=one_ahead, num_blocks=num_blocks, max_model_len=48)
    params = [SamplingParams(max_tokens=5 + i % 17, ignore_eos=True) for i in range(12)]
    for i, (prompt, p) in enumerate(zip(prompts(12), params, strict=True)):
        h.add(f"r{i}", prompt, max_tokens=p.max_tokens, ignore_eos=True)
    h.run()
    for i, (prompt, p) in enumerate(zip(prompts(12), params, strict=True)):
        assert (h.tokens[f"r{i}"], h.finish[f"r{i}"]) == expected(prompt, p, 48)
    assert (h.sched.num_preemptions > 0) == (num_blocks == 12)
    assert h.sched.num_discarded_samples == 0  # length ends are foreseen: no junk rows


def test_admission_is_fifo_within_max_num_seqs():
    h = Harness(max_num_seqs=2)
    for i in range(5):
        h.add(f"r{i}", [1, 2, 3], max_tokens=2 + 2 * (i % 2))
    first = h.step()
    assert [r.request_id for r in first.rows] == ["r0", "r1"] and h.sched.num_waiting == 3
    order = []
    while h.sched.has_unfinished():
        batch = h.step()
        order += [r.request_id for r in batch.rows if r.num_computed == 0]
        assert h.sched.num_running <= 2
    assert order == ["r2", "r3", "r4"]
    h.run()


def test_chunked_prefill_splits_prompt_and_samples_on_last_chunk():
    h = Harness(budget=8)
    h.add("short", [5, 6], max_tokens=6)
    h.add("long", list(range(20)), max_tokens=3)
    b = h.step()  # short: whole prompt (2), long: first chunk (6)
    assert [(r.request_id, r.num_computed, len(r.token_ids), r.sample) for r in b.rows] == [
        ("short", 0, 2, True),
        ("long", 0, 6, False),
    ]
    assert h.tokens["long"] == []
    b = h.step()  # decode first (1 token), then the next chunk in the remaining budget
    assert [(r.request_id, r.num_computed, len(r.token_ids), r.sample) for r in b.rows] == [
        ("short", 2, 1, True),
        ("long", 6, 7, False),
    ]
    assert b.rows[1].token_ids == list(range(6, 13))
    b = h.step()
    assert [(r.request_id, r.num_computed, len(r.token_ids), r.sample) for r in b.rows][1] == ("long", 13, 7, True)
    assert len(h.tokens["long"]) == 1
    h.run()
    assert h.tokens["long"] == chain(list(range(20)), 3) and h.tokens["short"] == chain([5, 6], 6)


PROMPT = [3, 1, 4, 1, 5]
FULL = chain(PROMPT, 12)
K = next(i for i in range(3, 12) if FULL.count(FULL[i]) == 1)  # TOK occurs once, as output K
TOK = FULL[K]
STOP_CASES = [  # (eos_token_ids, params, tokens, (finish_reason, stop_reason))
    ((TOK,), {}, FULL[: K + 1], ("stop", None)),
    ((TOK,), {"ignore_eos": True}, FULL, ("length", None)),
    ((TOK,), {"min_tokens": K}, FULL[: K + 1], ("stop", None)),  # K outputs before it: allowed
    ((TOK,), {"min_tokens": K + 1}, FULL, ("length", None)),  # held by min_tokens
    ((), {"stop_token_ids": [TOK]}, FULL[: K + 1], ("stop", TOK)),
    ((), {"stop_token_ids": [TOK], "ignore_eos": True}, FULL[: K + 1], ("stop", TOK)),
    ((), {"stop_token_ids": [TOK], "min_tokens": K + 1}, FULL, ("length", None)),
    ((TOK,), {"max_tokens": K}, FULL[:K], ("length", None)),
]


@pytest.mark.parametrize("one_ahead", [False, True])
@pytest.mark.parametrize(("eos", "params", "tokens", "finish"), STOP_CASES)
def test_stop_conditions(one_ahead, eos, params, tokens, finish):
    h = Harness(one_ahead=one_ahead, eos=eos)
    h.add("r", PROMPT, **{"max_tokens": 12, **params})
    h.run()
    assert (h.tokens["r"], h.finish["r"]) == (tokens, finish)
    # One-ahead scheduled a junk row past a stop token, never past a foreseeable length end.
    assert h.sched.num_discarded_samples == (one_ahead and finish[0] == "stop")


@pytest.mark.parametrize("one_ahead", [False, True])
def test_max_model_len_ends_with_length(one_ahead):
    h = Harness(one_ahead=one_ahead, max_model_len=16)
    h.add("r", list(range(10)), max_tokens=100, ignore_eos=True)
    with pytest.raises(ValueError):
        h.add("too-long", list(range(16)))
    h.run()
    assert h.tokens["r"] == chain(list(range(10)), 6) and h.finish["r"] == ("length", None)


@pytest.mark.parametrize("one_ahead", [False, True])
def test_preempted_request_waits_a_step_then_resumes_first(one_ahead):
    h = Harness(one_ahead=one_ahead, num_blocks=4, block_size=4, max_num_seqs=3, budget=5, max_model_len=16)
    for rid in "ABC":
        h.add(rid, [ord(rid)] * 6, max_tokens=10, ignore_eos=True)
    admitted = []
    while h.sched.has_unfinished():
        was_running = {r.request_id for r in h.sched.running}
        batch = h.step()
        new = [r.request_id for r in batch.rows if r.num_computed == 0]
        assert not was_running & set(new)  # a victim is not re-admitted in the step that preempts it
        admitted += new
    h.run()
    assert h.sched.num_preemptions > 0 and admitted.index("B", 2) < admitted.index("C")
    stats = h.sched.stats()
    assert (stats["prompt_tokens_total"], stats["generation_tokens_total"], stats["kv_usage"]) == (18, 30, 0.0)
    for rid in "ABC":
        assert (h.tokens[rid], h.finish[rid]) == (chain([ord(rid)] * 6, 10), ("length", None))


def test_abort_waiting_and_mid_prefill_are_acked_at_once():
    h = Harness(budget=8, max_num_seqs=1)
    h.add("long", list(range(20)), max_tokens=2)
    h.add("queued", [1, 2], max_tokens=2)
    h.step()
    assert h.sched.abort("queued") and h.sched.drain_aborted() == ["queued"]
    h.step()  # long is mid chunked prefill, nothing in flight between steps in sync mode
    assert h.sched.abort("long") and h.sched.drain_aborted() == ["long"]
    assert not h.sched.abort("long") and not h.sched.abort("queued")  # twice: late, no second ack
    h.run()
    assert h.tokens == {} and h.finish == {}


def test_abort_running_finished_and_unknown():
    h = Harness()
    h.add("a", [1, 2, 3], max_tokens=20, ignore_eos=True)
    h.add("b", [4, 5], max_tokens=1)
    h.step()
    h.step()
    assert h.finish["b"] == ("length", None) and not h.sched.abort("b")  # finished: late abort
    assert not h.sched.abort("nobody")
    assert h.sched.abort("a") and h.sched.drain_aborted() == ["a"]
    h.run()
    assert h.tokens["a"] == chain([1, 2, 3], 2)


def test_abort_in_flight_frees_after_its_last_step():
    h = Harness(one_ahead=True)
    h.add("a", [1, 2, 3], max_tokens=20, ignore_eos=True)
    h.add("b", [7], max_tokens=20, ignore_eos=True)
    for _ in range(3):
        h.step()  # a is in the batch in flight (and the one before, already updated)
    used = h.sched.check_idle()["used_blocks"]
    assert h.sched.abort("a") and h.sched.drain_aborted() == []  # still referenced in flight
    assert not h.sched.abort("a")
    assert h.sched.check_idle()["used_blocks"] == used and "a" not in [r.request_id for r in h.step().rows]
    assert h.acks == ["a"] and h.sched.num_discarded_samples == 1
    assert h.tokens["a"] == chain([1, 2, 3], 2) and "a" not in h.finish
    h.run()
    assert h.tokens["b"] == chain([7], 20)


def test_abort_preempted_request():
    h = Harness(num_blocks=4, max_model_len=16, block_size=4)
    h.add("old", [1] * 6, max_tokens=10, ignore_eos=True)
    h.add("new", [2] * 6, max_tokens=10, ignore_eos=True)
    while not h.sched.num_preemptions:
        h.step()
    victim = h.sched.waiting[0].request_id
    assert victim == "new" and h.sched.abort(victim) and h.sched.drain_aborted() == [victim]
    h.run()
    assert h.tokens["old"] == chain([1] * 6, 10)


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_with_aborts_and_preemption(seed):
    """Random arrivals, params and aborts on a small cache, in sync and one-ahead mode: each
    request ends exactly once (final output or AbortAck) and its tokens match the oracle."""
    rng = random.Random(seed)
    eos = (EOS, 7)
    reqs = []
    for i, prompt in enumerate(prompts(16, seed, hi=24)):
        p = {"max_tokens": rng.randint(1, 20), "min_tokens": rng.choice([0, 0, 3]), "ignore_eos": rng.random() < 0.2}
        p["stop_token_ids"] = rng.sample(range(VOCAB), 3) if rng.random() < 0.5 else []
        reqs.append((f"r{i}", prompt, p, rng.randint(0, 30), rng.choice([None, None, rng.randint(0, 40)])))
    for one_ahead in (False, True):
        h = Harness(one_ahead=one_ahead, num_blocks=14, max_num_seqs=5, budget=16, max_model_len=48, eos=eos)
        for t in range(120):
            for rid, prompt, p, arrive, abort_at in reqs:
                if arrive == t:
                    h.add(rid, prompt, **p)
                if abort_at == t and arrive <= t:
                    h.sched.abort(rid)
            h.step()
        h.run()
        for rid, prompt, p, *_ in reqs:
            assert (rid in h.acks) != (rid in h.finish)
            want = expected(prompt, SamplingParams(**p), 48, eos)
            if rid in h.finish:
                assert (h.tokens[rid], h.finish[rid]) == want
            else:
                assert h.tokens[rid] == want[0][: len(h.tokens[rid])]
        assert h.sched.num_preemptions > 0


def test_contract_misuse_raises():
    h = Harness(one_ahead=True)
    h.add("a", [1, 2], max_tokens=5)
    with pytest.raises(ValueError):
        h.add("a", [3])  # ids are unique
    with pytest.raises(ValueError):
        h.add("empty", [])
    first, second = h.sched.schedule(), h.sched.schedule()
    with pytest.raises(RuntimeError):
        h.sched.schedule()  # at most one batch ahead
    with pytest.raises(RuntimeError):
        h.sched.update(second, [0])  # updates come in schedule order
    with pytest.raises(ValueError):
        h.sched.update(first, [])  # one sample per sampling row
    sampled = [h.model.execute(first), h.model.execute(second)]
    h._update(first, sampled[0])
    h.queue.append((second, sampled[1]))
    h.run()
    assert h.tokens["a"] == chain([1, 2], 5)
    with pytest.raises(ValueError):
        Scheduler(BlockManager(3, 4), 4, 32, 13, ())  # the cache cannot hold one max_model_len sequence

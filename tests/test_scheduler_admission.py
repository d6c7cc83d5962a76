"""Scheduler admission and batching: FIFO within max_num_seqs, chunked prefill within the token
budget, one batch ahead at most, and the contract's misuse errors (tests.scheduler_harness)."""

import pytest

from actors.engine.block_manager import BlockManager
from actors.engine.scheduler import Scheduler
from tests.scheduler_harness import Harness, chain


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


def test_a_long_prompt_is_chunked_while_others_decode_and_a_wave_is_not():
    """A wave of prompts arriving together prefills in one step (nothing decodes yet), beyond the threshold; a long
    prompt arriving while others decode is fed long_prefill_token_threshold tokens per step beside their decode
    rows, while a short one arriving with it is prefilled whole; both finish."""
    h = Harness(budget=32, long_prefill=5, max_num_seqs=5)
    for i in range(3):
        h.add(f"wave{i}", list(range(10 * i, 10 * i + 8)), max_tokens=12, ignore_eos=True)
    assert [len(r.token_ids) for r in h.step().rows] == [8, 8, 8]
    h.add("long", list(range(100, 117)), max_tokens=2)
    h.add("short", [7, 8, 9, 10, 11], max_tokens=2)
    chunks = []
    while not h.tokens["long"]:
        b = h.step()
        assert [len(r.token_ids) for r in b.rows if r.request_id.startswith("wave")] == [1, 1, 1]
        chunks += [len(r.token_ids) for r in b.rows if r.request_id == "long"]
    assert chunks == [5, 5, 5, 2] and h.batches[1].rows[-1].request_id == "short"
    assert len(h.batches[1].rows[-1].token_ids) == 5  # the short prompt, whole, in the same step
    h.run()
    assert h.tokens["long"] == chain(list(range(100, 117)), 2) and h.tokens["short"] == chain([7, 8, 9, 10, 11], 2)


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
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        Scheduler(BlockManager(8, 4), 4, 32, 13, (), long_prefill_token_threshold=-1)

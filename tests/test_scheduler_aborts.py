"""Scheduler aborts in every request state (waiting, mid-prefill, running, in flight, preempted,
finished, unknown), and random traffic with aborts and preemption (tests.scheduler_harness)."""

import random

import pytest

from actors.engine.metrics import idle_details
from messages.sampling_params import SamplingParams
from tests.scheduler_harness import EOS, VOCAB, Harness, chain, expected, prompts


def test_abort_waiting_and_mid_prefill_are_acked_at_once():
    h = Harness(budget=8, max_num_seqs=1)
    h.add("long", list(range(20)), max_tokens=2)
    h.add("queued", [1, 2], max_tokens=2)
    h.step()
    assert h.sched.abort("queued") and h.drained() == ["queued"]
    h.step()  # long is mid chunked prefill, nothing in flight between steps in sync mode
    assert h.sched.abort("long") and h.drained() == ["long"]
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
    assert h.sched.abort("a") and h.drained() == ["a"]
    h.run()
    assert h.tokens["a"] == chain([1, 2, 3], 2)


def test_abort_in_flight_frees_after_its_last_step():
    h = Harness(one_ahead=True)
    h.add("a", [1, 2, 3], max_tokens=20, ignore_eos=True)
    h.add("b", [7], max_tokens=20, ignore_eos=True)
    for _ in range(3):
        h.step()  # a is in the batch in flight (and the one before, already updated)
    used = idle_details(h.sched)["used_blocks"]
    assert h.sched.abort("a") and h.drained() == []  # still referenced in flight
    assert not h.sched.abort("a")
    assert idle_details(h.sched)["used_blocks"] == used and "a" not in [r.request_id for r in h.step().rows]
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
    assert victim == "new" and h.sched.abort(victim) and h.drained() == [victim]
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
        h.traffic(reqs, 120)
        for rid, prompt, p, *_ in reqs:
            assert (rid in h.acks) != (rid in h.finish)
            want = expected(prompt, SamplingParams(**p), 48, eos)
            if rid in h.finish:
                assert (h.tokens[rid], h.finish[rid]) == want
            else:
                assert h.tokens[rid] == want[0][: len(h.tokens[rid])]
        assert h.sched.num_preemptions > 0

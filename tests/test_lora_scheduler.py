"""The scheduler's LoRA cap (actors/engine/admission.py): never more than max_loras adapters in a step, a request of
another adapter passed over without holding up those behind it, and admitted within max_num_seqs overtakes however
many requests of the running adapters keep coming (tests.scheduler_harness checks every step's contexts and output)."""

import random

from tests.scheduler_harness import Harness, prompts


def adapters_of(batch) -> set[str]:
    return {r.lora for r in batch.rows} - {None}


def test_a_hundred_adapters_two_at_a_time():
    h = Harness(max_num_seqs=4, max_loras=2, num_blocks=128)
    order = list(range(120))
    random.Random(0).shuffle(order)  # (100 adapters' requests and 20 of the base model's, mixed)
    for i, prompt in zip(order, prompts(120, seed=1), strict=True):
        h.add(f"r{i}", prompt, max_tokens=3 + i % 5, lora=f"adapter-{i}" if i < 100 else None)
    seen = set()
    while h.sched.has_unfinished():
        batch = h.step()
        assert len(adapters_of(batch)) <= 2, f"step {batch.step} runs {sorted(adapters_of(batch))}"
        assert len({r.params.lora for r in h.sched.running} - {None}) <= 2
        seen |= adapters_of(batch)
    h.run()
    assert len(seen) == 100 and len(h.finish) == 120


def test_a_request_over_the_cap_does_not_block_those_behind_it():
    h = Harness(max_num_seqs=4, max_loras=1)
    h.add("a-long", [1, 2, 3], max_tokens=20, lora="a")
    h.step()
    h.add("b", [4, 5], max_tokens=2, lora="b")  # over the cap while a-long runs
    h.add("a-short", [6, 7], max_tokens=2, lora="a")
    h.add("base", [8, 9], max_tokens=2)
    batch = h.step()
    assert {r.request_id for r in batch.rows} == {"a-long", "a-short", "base"}
    assert [r.request_id for r in h.sched.waiting] == ["b"]
    h.run()


def test_a_passed_over_request_is_admitted_within_max_num_seqs_overtakes():
    """Requests of adapter a keep coming; b's request is overtaken by at most max_num_seqs of them, then a's drain
    and b runs. Without the bound (overtaken never stops admission) it would wait for as long as a's kept coming."""
    h = Harness(max_num_seqs=3, max_loras=1, num_blocks=128)
    h.add("a0", [1, 2], max_tokens=4, lora="a")
    h.step()
    h.add("b", [3, 4], max_tokens=2, lora="b")
    admitted, k = [], 1
    while "b" not in admitted:
        h.add(f"a{k}", [5, k % 90], max_tokens=4, lora="a")
        k += 1
        batch = h.step()
        admitted += [r.request_id for r in batch.rows if r.num_computed == 0]
        assert k < 40, "b was never admitted"
    assert admitted.index("b") <= 3, admitted
    h.run()

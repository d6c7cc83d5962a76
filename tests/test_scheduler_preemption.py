"""Scheduler preemption: batched outputs match an unbatched run with and without preemption, and a
preempted request waits a step, then resumes before later arrivals (tests.scheduler_harness)."""

import pytest

from actors.engine.metrics import engine_stats
from messages.sampling_params import SamplingParams
from tests.scheduler_harness import Harness, chain, expected, prompts


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
    stats = engine_stats(h.sched)
    assert (stats.prompt_tokens_total, stats.generation_tokens_total, stats.kv_usage) == (18, 30, 0.0)
    for rid in "ABC":
        assert (h.tokens[rid], h.finish[rid]) == (chain([ord(rid)] * 6, 10), ("length", None))


class Sited(Harness):
    """Which requests reach the scheduler.schedule fault site in each step (a recording fault plan)."""

    def step(self):
        self.sited: list[str] = []
        batch = super().step()
        scheduled = {r.request_id for r in batch.rows}
        assert set(self.sited) <= scheduled, "a request that got no room (nor a row) reached the fault site"
        return batch


@pytest.mark.parametrize("one_ahead", [False, True])
def test_the_schedule_fault_site_is_reached_only_by_a_request_that_has_room(one_ahead):
    """(actors/runtime/faults.py: never a blocked attempt) 12 blocks of 4 under 12 requests: preemptions."""
    h = Sited(one_ahead=one_ahead, num_blocks=12, max_model_len=48)
    h.sched.fault = lambda site, rid: h.sited.append(rid) if site == "scheduler.schedule" else None
    for i, prompt in enumerate(prompts(12)):
        h.add(f"r{i}", prompt, max_tokens=5 + i % 17, ignore_eos=True)
    h.run()
    assert engine_stats(h.sched).num_preemptions_total > 0  # (blocked attempts happened)

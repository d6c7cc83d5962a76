"""Slow is not hung (issue 28), through the real engine, worker and detokenizer processes (`worker="process"`):

- a step slower than step_timeout_s whose forward progresses (EngineConfig.slow_token: 2 x step_timeout_s a step)
  is waited for: exact output, no reset (the old link gave it up as lost, recomputed it as slowly, forever);
- a step that blocks with no progress (hang_token) is blamed like a crash: the worker is restarted, the request
  fails alone with an error naming the hang after `max_step_failures` such steps, and every other request ends
  exactly as in the fault-free run (the old link recomputed it forever behind the stuck step, and nobody heard).
The idle invariant holds after each."""

from __future__ import annotations

from frontend.offline import AsyncLLM
from messages.sampling_params import SamplingParams
from tests.cancel_harness import (
    assert_idle,
    clean_llm,  # noqa: F401 (a fixture)
    engine_config,
    model_dir,  # noqa: F401 (a fixture)
    start,
)
from tests.test_faults_e2e import WORKLOAD, key, outcomes, reference  # noqa: F401 (a fixture)

SLOW, HANG = 4243, 4244
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


async def test_a_slow_step_that_progresses_is_waited_for(model_dir, clean_llm, reference):  # noqa: F811
    prompt = [7, SLOW, 9]
    expected = key((await outcomes(clean_llm, [(prompt, GREEDY)]))[0])
    assert SLOW not in expected[0]  # (only its prefill is slow)
    config = engine_config(model_dir, worker="process", step_timeout_s=2.0, slow_token=SLOW)
    async with AsyncLLM(config) as llm:
        slow = start(llm, prompt, GREEDY)
        runs = [start(llm, p, params) for p, params in WORKLOAD]
        for run in [slow, *runs]:
            await run.done(timeout=120)
        assert key(slow) == expected
        assert [key(r) for r in runs] == reference
        await assert_idle(llm)
        stats, _ = await llm.fresh_stats()
        assert stats.worker_resets_total == 0 and not llm.system.num_restarts


async def test_a_hung_step_is_blamed_and_its_request_fails_alone(model_dir, reference):  # noqa: F811
    config = engine_config(model_dir, worker="process", step_timeout_s=1.0, hang_token=HANG)
    async with AsyncLLM(config) as llm:
        hung = start(llm, [7, HANG, 9], GREEDY)
        runs = [start(llm, p, params) for p, params in WORKLOAD]
        for run in [hung, *runs]:
            await run.done(timeout=120)
        assert [key(r) for r in runs] == reference
        assert hung.finished.finish_reason == "error", hung.finished
        assert "failed 3 steps" in hung.finished.error and "hung: no progress" in hung.finished.error
        assert llm.system.num_restarts == 3  # (each hung worker restarted, within the restart intensity)
        await assert_idle(llm)
        stats, _ = await llm.fresh_stats()
        assert stats.worker_resets_total == 3

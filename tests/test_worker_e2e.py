"""The worker in a process of its own (issue 17), through the real engine, worker and detokenizer processes: lost,
duplicated and reordered ExecuteSteps and StepResults cost a reset and a recompute, never an output; a poison
request that kills the worker is failed alone while every other request ends exactly as in the fault-free run;
so is one that kills the engine process itself, the inline worker's (issue 28: the engine's flight record);
the idle invariant holds after each (the kill -9 of the worker over HTTP: tests/test_resume_e2e.py)."""

from __future__ import annotations

import pytest

from actors.runtime import FaultPlan, FaultRule
from frontend.offline import AsyncLLM
from messages.sampling_params import BeamSearch, SamplingParams
from tests.cancel_harness import (
    assert_idle,
    clean_llm,  # noqa: F401 (a fixture)
    engine_config,
    model_dir,  # noqa: F401 (a fixture)
    start,
    wait_for,
)
from tests.test_faults_e2e import WORKLOAD, key, outcomes, reference  # noqa: F401 (a fixture)

LOST_STEPS = FaultPlan(
    seed=5,
    rules=[
        FaultRule(link="scheduler->worker", msg_type="ExecuteStep", action="drop", probability=0.03),
        FaultRule(link="worker->scheduler", msg_type="StepResult", action="drop", probability=0.03),
        FaultRule(msg_type="ExecuteStep", action="duplicate", probability=0.05),
        FaultRule(msg_type="StepResult", action="reorder", probability=0.03),
    ],
)


async def test_lost_and_reordered_steps_change_no_output(model_dir, reference):  # noqa: F811
    config = engine_config(model_dir, worker="process", step_timeout_s=2.0)
    async with AsyncLLM(config, fault_plan=LOST_STEPS) as llm:
        runs = await outcomes(llm)
        assert [key(r) for r in runs] == reference
        await assert_idle(llm)
        stats, _ = await llm.fresh_stats()
    assert stats.worker_resets_total >= 2, stats  # (the plan lost steps: each a reset)


POISON = 4242  # a token whose step makes the worker's process exit (EngineConfig.crash_token)


async def test_a_poison_request_is_failed_alone(model_dir, reference):  # noqa: F811
    config = engine_config(model_dir, worker="process", crash_token=POISON)
    async with AsyncLLM(config) as llm:
        poison = start(llm, [7, POISON, 9], SamplingParams(temperature=0, max_tokens=8))
        runs = [start(llm, prompt, params) for prompt, params in WORKLOAD]
        for run in [poison, *runs]:
            await run.done(timeout=120)
        assert [key(r) for r in runs] == reference
        assert poison.finished.finish_reason == "error" and "failed 3 steps" in poison.finished.error
        assert llm.system.num_restarts == 3  # (within the supervisor's restart intensity: it did not give up)
        await assert_idle(llm)
        stats, _ = await llm.fresh_stats()
        assert stats.worker_resets_total == 3


@pytest.mark.parametrize("beam", [None, BeamSearch(width=2, group="g")], ids=["sampled", "beam search"])
async def test_a_poison_request_that_kills_the_engine_is_failed_alone(model_dir, reference, beam):  # noqa: F811
    """The inline worker (the harness's, CPU's default): the poison's step kills the engine process, and the clients
    resume every request at each of its deaths. The engine's flight record blames the requests of the steps in flight
    at each (a beam search's rows: its choices); suspects run alone from the second, so the third blames the poison
    alone, whose copy is then refused (an internal error: a 500 over HTTP) while every other request ends exactly as
    in the fault-free run."""
    async with AsyncLLM(engine_config(model_dir, crash_token=POISON)) as llm:
        poison = start(llm, [7, POISON, 9], SamplingParams(temperature=0, max_tokens=8, beam=beam))
        runs = [start(llm, prompt, params) for prompt, params in WORKLOAD]
        for run in [poison, *runs]:
            await run.done(timeout=180)
        assert [key(r) for r in runs] == reference
        fin = poison.finished
        assert (fin.finish_reason, fin.error_kind) == ("error", "internal")
        assert "crashed the engine 3 times" in fin.error
        assert llm.system.num_restarts == 3  # (within the supervisor's restart intensity: it did not give up)
        await assert_idle(llm)
        assert [key(r) for r in await outcomes(llm)] == reference  # it serves on


async def test_a_worker_that_dies_while_the_engine_is_idle_is_reset_before_the_next_step(model_dir, reference):  # noqa: F811
    """Its state is gone though no step was in flight: the engine starts a new epoch before it sends the next one
    (which the new worker would otherwise take for a gap, or run against requests it does not hold)."""
    async with AsyncLLM(engine_config(model_dir, worker="process")) as llm:
        await outcomes(llm, WORKLOAD[:3])
        old = llm.system.pids()["worker"]
        llm.system.kill("worker")
        await wait_for(lambda: llm.system.pids().get("worker", old) != old and llm.system.state["worker"] == "up")
        runs = await outcomes(llm)
        assert [key(r) for r in runs] == reference
        await assert_idle(llm)
        stats, _ = await llm.fresh_stats()
        assert stats.worker_resets_total == 1

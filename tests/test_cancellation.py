"""Every abort case of the cancellation protocol (DESIGN section 3) through the real engine and
detokenizer processes, made deterministic without sleeps: the step gate (EngineConfig.step_gate)
holds an executed step in flight until the test lets it finish, and an ask queued behind an Abort on
the same FIFO link proves the Abort was handled. Sync and async scheduling (one step ahead); the
idle invariant holds after every test.
"""

from __future__ import annotations

import asyncio

import pytest

from frontend.offline import AsyncLLM
from messages.sampling_params import SamplingParams
from tests.cancel_harness import (
    GREEDY,
    LONG_PROMPT,
    STOP_PROMPT,
    assert_idle,
    clean_llm,  # noqa: F401 (a fixture)
    engine_config,
    gate,
    model_dir,  # noqa: F401 (a fixture)
    scheduler_state,
    start,
    start_held,
    stop_case,
    wait_state,
)

FOUR = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module", params=["async", "sync"])
async def llm(request, model_dir, clean_llm):  # noqa: F811
    if request.param == "async":
        yield clean_llm
        return
    async with AsyncLLM(engine_config(model_dir, async_scheduling=False)) as engine:
        yield engine


@pytest.fixture(autouse=True)
async def idle_after(llm):
    gate(llm, None)
    yield
    gate(llm, None)
    await assert_idle(llm)


def steps_ahead(llm: AsyncLLM) -> int:
    """Steps in flight when the loop holds one: the held one, plus the next with async scheduling."""
    return 2 if llm.config.async_scheduling else 1


async def test_abort_while_waiting_is_acked_at_once(llm):
    head = await start_held(llm, [1, 2, 3], GREEDY)
    queued = start(llm, [4, 5, 6], GREEDY)
    await wait_state(llm, waiting=1)
    llm.abort(queued.request_id)
    fin = await queued.done()
    assert (fin.finish_reason, fin.stop_reason, queued.token_ids) == ("abort", "client", [])
    state = await scheduler_state(llm)
    assert (state["held_steps"], state["waiting"], state["running"]) == (1, 0, 1), "acked with the engine held"
    gate(llm, None)
    assert (await head.done()).finish_reason == "length" and len(head.token_ids) == GREEDY.max_tokens


async def test_abort_mid_chunked_prefill_frees_after_the_steps_in_flight(llm):
    run = await start_held(llm, LONG_PROMPT, GREEDY)  # chunk 1 executed
    gate(llm, 1)
    await wait_state(llm, gate_permits=0, held_steps=1)  # chunk 1 done, chunk 2 executed and held
    llm.abort(run.request_id)
    state = await wait_state(llm, running=0)
    assert state["requests"] == 1 and state["used_blocks"] > 0, "in flight: blocks still held"
    assert state["in_flight_steps"] == steps_ahead(llm)
    await asyncio.sleep(0)
    assert run.finished is None, "no AbortAck while a step still reads its blocks"
    gate(llm, None)
    fin = await run.done()
    assert (fin.finish_reason, run.token_ids) == ("abort", [])


async def test_abort_while_the_final_step_runs_wins(llm):
    """The Abort reaches the scheduler before the final step's update: finish_reason abort (vLLM #29987)."""
    engine0, _ = await llm.fresh_stats()
    run = await start_held(llm, [7, 8, 9], FOUR)
    gate(llm, 3)
    await wait_state(llm, gate_permits=0, held_steps=1)  # tokens 0..2 are out; the step sampling token 3 is held
    await run.wait_tokens(3)
    llm.abort(run.request_id)
    await wait_state(llm, running=0)
    gate(llm, None)
    fin = await run.done()
    assert (fin.finish_reason, len(run.token_ids)) == ("abort", 3)
    await assert_idle(llm)
    engine1, _ = await llm.fresh_stats()
    assert engine1.late_aborts_total == engine0.late_aborts_total
    assert engine1.discarded_samples_total - engine0.discarded_samples_total == 1


async def test_abort_after_the_final_update_is_late(llm):
    """The final step's update came first: the terminal entry is out, the Abort is late (ignored,
    counted), and the client gets exactly one Finished, with the natural reason."""
    engine0, detok0 = await llm.fresh_stats()
    late0 = llm.client.streams.counts.violations.total()
    run = await start_held(llm, [7, 8, 9], FOUR)
    gate(llm, 4)
    await wait_state(llm, gate_permits=0, requests=0)  # the scheduler sent the terminal entry
    llm.abort(run.request_id)
    llm.abort(run.request_id)  # twice is harmless
    llm.abort("never-added")
    await wait_state(llm)  # barrier: the three aborts were handled
    fin = await run.done()
    assert (fin.finish_reason, len(run.token_ids)) == ("length", 4)
    await assert_idle(llm)
    engine1, detok1 = await llm.fresh_stats()
    assert engine1.late_aborts_total - engine0.late_aborts_total == 3
    assert detok1.protocol_violations_total == detok0.protocol_violations_total
    assert llm.client.streams.counts.violations.total() == late0, "exactly one terminal message"


async def test_stop_string_while_the_engine_runs_ahead(llm):
    """The detokenizer finds a stop string in token j while the engine holds step j+1 (and, with async
    scheduling, j+2) in flight: the client has its Finished(stop) at once; the Abort discards the
    samples in flight, so no stale output is even sent."""
    free, params, j = await stop_case(llm)
    stop = params.stop[0]
    engine0, detok0 = await llm.fresh_stats()
    run = await start_held(llm, STOP_PROMPT, params)
    gate(llm, j + 1)
    fin = await run.done()
    assert (fin.finish_reason, fin.stop_reason) == ("stop", stop)
    assert run.token_ids == free.token_ids[: j + 1]
    assert run.text == free.text[: free.text.index(stop)]
    state = await wait_state(llm, running=0)  # its Abort(stop) arrived while the engine was held
    assert state["in_flight_steps"] == steps_ahead(llm)
    gate(llm, None)
    await assert_idle(llm)
    engine1, detok1 = await llm.fresh_stats()
    assert detok1.stale_outputs_dropped_total == detok0.stale_outputs_dropped_total
    assert engine1.discarded_samples_total - engine0.discarded_samples_total == steps_ahead(llm)


async def test_aborting_some_leaves_the_others_exact(llm):
    """vLLM test_abort's shape: every third request is aborted mid-stream; the rest are untouched."""
    prompts = [[20 + i, 21 + i, 22 + i] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    solo = [await completed(llm, p, params) for p in prompts]
    runs = [start(llm, p, params) for p in prompts]
    for run in runs[::3]:
        await run.wait_tokens(2)
        llm.abort(run.request_id)
    for i, run in enumerate(runs):
        fin = await run.done()
        if i % 3:
            assert (fin.finish_reason, run.token_ids) == ("length", solo[i])
        else:
            assert fin.finish_reason in ("abort", "length") and run.token_ids == solo[i][: len(run.token_ids)]


async def completed(llm: AsyncLLM, prompt, params: SamplingParams) -> list[int]:
    run = start(llm, prompt, params)
    await run.done()
    return run.token_ids

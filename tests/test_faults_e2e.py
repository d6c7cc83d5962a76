"""The cancellation protocol under injected link faults (DESIGN section 8), through the real engine
and detokenizer processes: duplicates and delays change no output; reorders and losses are repaired
(DESIGN I6 with I8: the party that finds an output missing re-submits the request from what its client
has) and change no output either; lost Aborts are re-sent and their tombstones bounded (I7). References
come from the fault-free engine; the idle invariant holds after every test.
"""

from __future__ import annotations

import pytest

from actors.runtime import FaultPlan, FaultRule
from actors.runtime.faults import FaultInjector
from frontend.offline import AsyncLLM
from messages.sampling_params import SamplingParams
from tests.cancel_harness import (
    LONG_PROMPT,
    STOP_PROMPT,
    Run,
    assert_idle,
    clean_llm,  # noqa: F401 (a fixture)
    engine_config,
    gate,
    model_dir,  # noqa: F401 (a fixture)
    start,
    start_held,
    stop_case,
    wait_for,
    wait_state,
)

PROMPTS = [[5, 6, 7], [100, 200, 300, 400], LONG_PROMPT, [42] * 20, [9, 8, 7, 6, 5, 4, 3, 2]]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=1, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
    SamplingParams(temperature=0.7, seed=2, max_tokens=16, min_tokens=4, repetition_penalty=1.2, ignore_eos=True),
]
WORKLOAD = [(p, PARAMS[i % len(PARAMS)]) for i, p in enumerate(PROMPTS * 3)]


async def outcomes(llm: AsyncLLM, workload=WORKLOAD) -> list[Run]:
    runs = [start(llm, prompt, params) for prompt, params in workload]
    for run in runs:
        await run.done(timeout=60)
    return runs


def key(run: Run) -> tuple:
    return run.token_ids, run.text, run.finished.finish_reason


@pytest.fixture(scope="module")
async def reference(clean_llm):  # noqa: F811
    return [key(r) for r in await outcomes(clean_llm)]


def assert_clean(runs: list[Run], reference: list[tuple]) -> int:
    """Every request ended as in the fault-free run, or failed after its repairs with a prefix of that run's
    output, saying why. Returns the failures."""
    failed = 0
    for run, (tokens, text, reason) in zip(runs, reference, strict=True):
        if run.finished.finish_reason == "error":
            failed += 1
            why = ("lost output", "seq", "arrived before the request was registered")  # (its repairs' reasons)
            assert any(w in run.finished.error for w in why), run.finished.error
            assert run.token_ids == tokens[: len(run.token_ids)] and text.startswith(run.text)
        else:
            assert key(run) == (tokens, text, reason)
    return failed


# ---------------------------------------------------------------- duplicates, delays, lost Aborts

LOSSY = FaultPlan(
    seed=3,
    rules=[
        FaultRule(link="detokenizer->scheduler", msg_type="Abort", action="drop"),
        FaultRule(link="client->scheduler", msg_type="Abort", action="reorder", delay_ms=60_000),
        *(
            FaultRule(msg_type=t, action="duplicate", probability=0.3)
            for t in ("AddRequest", "StepOutputs", "AbortAck", "TextOutputs", "Finished")
        ),
        FaultRule(msg_type="*Outputs", action="delay", probability=0.1, delay_ms=5),
    ],
)


@pytest.fixture(scope="module")
async def lossy(model_dir):  # noqa: F811
    """Every link duplicates and delays; the detokenizer's Aborts are lost; the client's Aborts are
    held back until its next message (the next ask, in these tests)."""
    config = engine_config(model_dir, abort_timeout_s=1.0, max_abort_tries=2)
    async with AsyncLLM(config, fault_plan=LOSSY) as llm:
        yield llm


@pytest.fixture
async def lossy_llm(lossy):
    yield lossy
    gate(lossy, None)
    await assert_idle(lossy)
    assert lossy.client.streams.counts.violations["after_finished"] == 0


async def test_duplicates_and_delays_change_no_output(lossy_llm, reference):
    runs = await outcomes(lossy_llm)
    assert [key(r) for r in runs] == reference
    assert lossy_llm.client.streams.counts.violations["duplicate"] > 0, "the plan duplicated TextOutputs"


async def test_lost_stop_abort_leaves_every_later_step_stale(lossy_llm):
    """The stop string is found in token j but its Abort is lost: the engine runs the request to
    max_tokens, k steps ahead of the client's Finished; all k outputs are stale, dropped, never
    forwarded, and the terminal entry closes the tombstone."""
    free, params, j = await stop_case(lossy_llm)
    engine0, detok0 = await lossy_llm.fresh_stats()
    run = start(lossy_llm, STOP_PROMPT, params)
    fin = await run.done()
    assert (fin.finish_reason, run.token_ids) == ("stop", free.token_ids[: j + 1])
    assert run.text == free.text[: free.text.index(params.stop[0])]
    await assert_idle(lossy_llm)
    engine1, detok1 = await lossy_llm.fresh_stats()
    assert detok1.stale_outputs_dropped_total - detok0.stale_outputs_dropped_total == 24 - (j + 1)
    assert engine1.late_aborts_total == engine0.late_aborts_total, "no Abort reached the engine"


async def test_unanswered_abort_tombstone_is_dropped_after_bounded_tries(lossy_llm):
    """I7: the engine is held after the stop step, so no terminal message comes; the lost Abort is
    re-sent (lost again) and after max_abort_tries the tombstone is dropped. The request's later
    outputs then belong to nobody: protocol violations, counted and dropped."""
    _, params, j = await stop_case(lossy_llm)
    _, detok0 = await lossy_llm.fresh_stats()
    run = await start_held(lossy_llm, STOP_PROMPT, params)
    gate(lossy_llm, j + 1)
    assert (await run.done()).finish_reason == "stop"
    await wait_for(lambda: (s := lossy_llm.client.detok_stats) is not None and s.num_tombstones == 1, what="tombstone")
    await wait_for(lambda: lossy_llm.client.detok_stats.num_tombstones == 0, timeout=10, what="tombstone dropped")
    state = await wait_state(lossy_llm, running=1, held_steps=1)  # the engine never heard of the abort
    assert state["requests"] == 1
    gate(lossy_llm, None)
    await assert_idle(lossy_llm)
    _, detok1 = await lossy_llm.fresh_stats()
    assert detok1.protocol_violations_total - detok0.protocol_violations_total >= 24 - (j + 1)


async def test_abort_delayed_past_the_natural_end_is_counted_late(lossy_llm):
    engine0, _ = await lossy_llm.fresh_stats()
    run = start(lossy_llm, [7, 8, 9], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    await run.wait_tokens(1)
    lossy_llm.abort(run.request_id)  # held on the link until the client's next message
    fin = await run.done()
    assert (fin.finish_reason, len(run.token_ids)) == ("length", 4)
    await wait_state(lossy_llm)  # this ask releases the Abort behind it
    await wait_state(lossy_llm)  # this one proves it was handled
    engine1, _ = await lossy_llm.fresh_stats()
    assert engine1.late_aborts_total - engine0.late_aborts_total == 1


# ---------------------------------------------------------------- reorders

REORDER = FaultPlan(
    seed=5,
    rules=[
        FaultRule(link="scheduler->detokenizer", action="reorder", delay_ms=200),
        FaultRule(link="detokenizer->client", msg_type="TextOutputs", action="reorder", delay_ms=200),
        FaultRule(link="client->scheduler", msg_type="AddRequest", action="reorder", delay_ms=200),
        FaultRule(link="detokenizer->scheduler", msg_type="Abort", action="reorder", delay_ms=60_000),
    ],
)


@pytest.fixture(scope="module")
async def reorder(model_dir):  # noqa: F811
    """Every message on every request-path link is swapped with the next one (or held 200 ms);
    the detokenizer's Aborts wait for the next Abort (its I7 re-send, at the latest)."""
    async with AsyncLLM(engine_config(model_dir, abort_timeout_s=0.3), fault_plan=REORDER) as llm:
        yield llm


@pytest.fixture
async def reorder_llm(reorder):
    yield reorder
    await assert_idle(reorder)
    assert reorder.client.streams.counts.violations["after_finished"] == 0


async def test_reorders_are_repaired_or_fail_cleanly(reorder_llm, reference):
    """Every message of every link reordered: a request whose outputs come out of order is re-submitted from what
    its client has, again at each reorder that hits a copy; it ends exactly as the fault-free run, or, after
    MAX_ATTEMPTS copies, fails with a prefix of it (no corruption either way)."""
    _, detok0 = await reorder_llm.fresh_stats()
    runs = await outcomes(reorder_llm)
    failed = assert_clean(runs, reference)
    _, detok1 = await reorder_llm.fresh_stats()
    assert reorder_llm.client.streams.counts.violations["gap"] + detok1.repairs_total - detok0.repairs_total > 0, (
        "no reorder hit a request"
    )
    assert failed < len(runs)


async def test_an_abort_that_overtakes_its_request_still_ends_it(reorder_llm):
    engine0, _ = await reorder_llm.fresh_stats()
    run = start(reorder_llm, [1, 2, 3], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    await wait_for(lambda: run.request_id in reorder_llm.client.streams.live, what="AddRequest sent")
    reorder_llm.abort(run.request_id)  # overtakes the AddRequest held on the link
    fin = await run.done()
    assert run.token_ids == []
    assert (fin.finish_reason, fin.stop_reason) == ("abort", "client")
    engine1, _ = await reorder_llm.fresh_stats()
    assert engine1.late_aborts_total - engine0.late_aborts_total >= 1  # an Abort for an id not yet added (and any
    # Abort the reorder test before left held on its link)
    assert engine1.generation_tokens_total == engine0.generation_tokens_total, "never scheduled"


# ---------------------------------------------------------------- lost StepOutputs


def drop_plan(p: float = 0.08) -> FaultPlan:
    """A plan that drops StepOutputs d1 and d2 (5 <= d1 <= 15, d1 + 4 <= d2 <= d1 + 10) and no other
    of the first d2 + 40: found by replaying the injector, which draws once per StepOutputs. The
    detokenizer's Aborts are held until the next one (an I7 re-send, if nothing else)."""
    for seed in range(100_000):
        rules = [FaultRule(link="scheduler->detokenizer", msg_type="StepOutputs", action="drop", probability=p)]
        injector = FaultInjector(FaultPlan(seed=seed, rules=rules))
        drops = [i for i in range(120) if injector.decide("scheduler->detokenizer", "StepOutputs")]
        fits = len(drops) >= 2 and 5 <= drops[0] <= 15 and 4 <= drops[1] - drops[0] <= 10
        if fits and (len(drops) == 2 or drops[2] > drops[1] + 40):
            held = FaultRule(link="detokenizer->scheduler", msg_type="Abort", action="reorder", delay_ms=60_000)
            return FaultPlan(seed=seed, rules=[*rules, held])
    raise AssertionError("no seed fits")


async def test_lost_step_outputs_are_repaired(model_dir, clean_llm):  # noqa: F811
    """Two StepOutputs are lost (d1 and d2 of the first d2 + 40): the requests that may have been in them are
    re-submitted by the detokenizer from what their client has, a request whose terminal entry was lost is run
    again from there; every stream ends exactly as in the fault-free run, and nothing is left behind."""
    plan = drop_plan()
    workload = [
        ([31 + i, 32 + i], SamplingParams(temperature=0, max_tokens=3 + 5 * i, ignore_eos=True)) for i in range(8)
    ]
    want = [key(r) for r in await outcomes(clean_llm, workload)]
    async with AsyncLLM(engine_config(model_dir, async_scheduling=False), fault_plan=plan) as llm:
        runs = await outcomes(llm, workload)
        await assert_idle(llm)
        _, detok = await llm.fresh_stats()
    assert [key(r) for r in runs] == want
    assert detok.repairs_total > 0

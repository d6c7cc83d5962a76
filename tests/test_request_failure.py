"""One request that raises in the engine's scheduler fails alone, through the real engine and detokenizer
processes (issue 48): a fault plan's raise rule fires inside `update` or `schedule` for the chosen request while
others stream; it ends with an internal error (a 500 for its client) after a prefix of its tokens, every other
request outputs exactly what the fault-free engine does, the engine process is the same one (no restart), nothing
is left behind, and the engine serves on."""

from __future__ import annotations

import pytest

from actors.runtime import FaultPlan, FaultRule
from frontend.offline import AsyncLLM
from messages.sampling_params import SamplingParams
from tests.cancel_harness import (
    LONG_PROMPT,
    assert_idle,
    clean_llm,  # noqa: F401 (a fixture)
    engine_config,
    model_dir,  # noqa: F401 (a fixture)
    start,
)

PROMPTS = [[5, 6, 7], [100, 200, 300, 400], LONG_PROMPT, [42] * 20, [9, 8, 7, 6, 5, 4, 3, 2]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)
VICTIM = [11, 12, 13, 14]
SKIP = 3  # (the victim's first outputs pass: it fails mid-stream)
PLAN = FaultPlan(
    rules=[
        FaultRule(action="raise", site="scheduler.update", request="victim-update-*", skip=SKIP),
        FaultRule(action="raise", site="scheduler.schedule", request="victim-schedule-*", skip=SKIP),
    ]
)


def workload() -> list[tuple[list[int], SamplingParams]]:
    return [(p, GREEDY if i % 2 else SEEDED) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
async def faulty(model_dir):  # noqa: F811
    async with AsyncLLM(engine_config(model_dir), fault_plan=PLAN) as llm:
        yield llm


@pytest.fixture(scope="module")
async def reference(clean_llm):  # noqa: F811
    runs = [start(clean_llm, p, params) for p, params in [(VICTIM, GREEDY), *workload()]]
    for run in runs:
        await run.done()
    return [(r.token_ids, r.text, r.finished.finish_reason) for r in runs]


@pytest.mark.parametrize("site", ["update", "schedule"])
async def test_a_request_that_raises_in_the_scheduler_fails_alone(faulty, reference, site):
    engine = faulty.system.pids()["engine"]
    victim = start(faulty, VICTIM, GREEDY, request_id=f"victim-{site}-{faulty.new_id()}")
    others = [start(faulty, p, params) for p, params in workload()]
    fin = await victim.done()
    assert (fin.finish_reason, fin.error_kind) == ("error", "internal"), fin
    assert "internal error" in fin.error and "InjectedFault" in fin.error
    tokens, text, _ = reference[0]
    assert victim.token_ids == tokens[: len(victim.token_ids)] and text.startswith(victim.text)
    assert len(victim.token_ids) < len(tokens) and (site == "schedule" or len(victim.token_ids) == SKIP)
    unfinished = [r for r in others if r.finished is None]
    assert unfinished, "the others were still streaming as it failed"
    for run in others:
        await run.done()
    assert [(r.token_ids, r.text, r.finished.finish_reason) for r in others] == reference[1:]
    assert faulty.system.pids()["engine"] == engine  # (the same process: no restart)
    await assert_idle(faulty)
    after = start(faulty, VICTIM, GREEDY)  # (the engine serves on)
    assert ((await after.done()).finish_reason, after.token_ids) == ("length", tokens)

"""Seeded chaos at the engine level (scripts/chaos.py, CI-sized): 300 concurrent requests with random
aborts, stop strings and siblings, under duplicated, delayed and reordered StepOutputs, TextOutputs,
AbortAcks and Aborts. No hang, no output after a Finished, the idle invariant, and every request
that ended naturally equals the fault-free run; aborted or failed ones got a prefix of it."""

from __future__ import annotations

from frontend.offline import AsyncLLM
from scripts.chaos import chaos, chaos_config, fault_plan, workload
from tests.cancel_harness import clean_llm, model_dir  # noqa: F401 (fixtures)

SEED, REQUESTS = 7, 300


def test_same_seed_same_workload_and_plan():
    assert workload(SEED, REQUESTS) == workload(SEED, REQUESTS) != workload(SEED + 1, REQUESTS)
    assert fault_plan(SEED) == fault_plan(SEED)


async def test_chaos(model_dir, clean_llm):  # noqa: F811
    async with AsyncLLM(chaos_config(str(model_dir)), fault_plan=fault_plan(SEED)) as faulty:
        report = await chaos(clean_llm, faulty, SEED, REQUESTS, timeout_s=120)
    print(report)
    assert not report.problems, str(report)
    counts = report.counts
    assert counts["aborted"] > 0 and counts["natural"] >= REQUESTS // 2, counts
    assert counts["client_duplicates"] > 0 and counts["late_aborts"] > 0, counts

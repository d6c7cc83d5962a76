"""Cancellation cost: abort -> KV blocks freed, and stale tokens per stop-string abort, sync vs async scheduling.

    python scripts/bench_cancel.py [--aborts 40] [--batch 1 16] [--model DIR]

1. Explicit aborts. With `batch` requests decoding (one of them a "clock"), a victim that has streamed a
   random number of tokens is aborted. Measured from the abort() call to the victim's Finished(abort) at the
   client: the scheduler sends the AbortAck the moment no in-flight step reads the victim's blocks and frees
   them, so this is the time to free plus three hops. In engine steps: the clock's tokens meanwhile (it
   samples once per step). Baselines from the same run: the step time (the clock's token interval) and an
   ask round trip to the scheduler (the messaging floor).
2. Stop strings. `batch` requests, each with a stop string that first matches in its token j (5 <= j <= 20,
   from a free run), max_tokens far beyond. Stale tokens per stop-string abort = outputs the detokenizer
   dropped as stale + samples the engine computed and discarded (DetokStats / EngineStats deltas).

Runs on the tiny random Llama unless --model is given (one torch thread for the engine).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import itertools

from actors.engine.config import EngineConfig
from frontend.offline import AsyncLLM
from messages.names import SCHEDULER
from messages.sampling_params import SamplingParams
from messages.wire import CheckIdle, Finished

FOREVER = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def explicit_aborts(llm: AsyncLLM, batch: int, n: int, rng: random.Random) -> dict[str, float]:
    clock_ticks: list[tuple[float, int]] = []
    clock_id = llm.new_id()
    clock = asyncio.ensure_future(tokens_of_id(llm, clock_id, clock_ticks))
    others = [llm.new_id() for _ in range(batch - 2)]
    background = [asyncio.ensure_future(tokens_of_id(llm, rid, None)) for rid in others]
    while len(clock_ticks) < 20:
        await asyncio.sleep(0.01)
    ms, steps, rtt = [], [], []
    for _ in range(n):
        t = time.perf_counter()
        await llm.client.ask(SCHEDULER, CheckIdle())
        rtt.append(time.perf_counter() - t)
        victim, got = llm.new_id(), []
        task = asyncio.ensure_future(tokens_of_id(llm, victim, got, prompt=[rng.randrange(100, 40000)]))
        want = rng.randint(1, 12)
        while sum(k for _, k in got) < want:
            await asyncio.sleep(0.001)
        await asyncio.sleep(rng.uniform(0, 0.01))
        before, t0 = len(clock_ticks), time.perf_counter()
        llm.abort(victim)
        fin = await task
        ms.append(time.perf_counter() - t0)
        steps.append(len(clock_ticks) - before)
        assert fin.finish_reason in ("abort", "length"), fin
    intervals = [b[0] - a[0] for a, b in itertools.pairwise(clock_ticks)]
    for rid in [clock_id, *others]:
        llm.abort(rid)
    await asyncio.gather(clock, *background)
    step = statistics.median(intervals)
    return {
        "abort_ms_p50": 1000 * statistics.median(ms),
        "abort_ms_p99": 1000 * pct(ms, 0.99),
        "abort_steps_p50": statistics.median(steps),
        "abort_steps_max": max(steps),
        "step_ms": 1000 * step,
        "ask_rtt_ms": 1000 * statistics.median(rtt),
        "abort_over_step": statistics.median(ms) / step,
    }


async def tokens_of_id(llm: AsyncLLM, rid: str, sink: list | None, prompt: list[int] | None = None) -> Finished:
    async for item in llm.stream(prompt or [7, 8, 9], FOREVER, rid):
        if sink is not None:
            sink.append((time.perf_counter(), len(item.token_ids)))
        if isinstance(item, Finished):
            return item
    raise AssertionError("unreachable")


async def stop_strings(llm: AsyncLLM, batch: int, rng: random.Random) -> dict[str, float]:
    from tests.cancel_harness import stop_string_at

    cases = []
    for _ in range(batch):
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(2, 20))]
        free = await llm.generate_one(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        stop, _j = stop_string_at(llm.tokenizer, free.token_ids, first=rng.randint(5, 20))
        cases.append((prompt, stop))
    engine0, detok0 = await llm.fresh_stats()
    params = [SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True, stop=[s]) for _, s in cases]
    outs = await llm.generate([p for p, _ in cases], params)
    assert all(o.finish_reason == "stop" for o in outs)
    for _ in range(200):
        reports = await llm.idle_reports()
        if not any(v for d in reports.values() for v in d.values()):
            break
        await asyncio.sleep(0.02)
    engine1, detok1 = await llm.fresh_stats()
    stale = detok1.stale_outputs_dropped_total - detok0.stale_outputs_dropped_total
    discarded = engine1.discarded_samples_total - engine0.discarded_samples_total
    return {"stale_sent_per_stop": stale / batch, "discarded_per_stop": discarded / batch}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--aborts", type=int, default=40)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--model")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from tests.tiny_model import make_tiny_model_dir

        model = str(make_tiny_model_dir(Path(tempfile.mkdtemp(prefix="sluice-bench-")) / "model"))
    for mode in ("sync", "async"):
        config = EngineConfig(model=model, max_num_seqs=32, max_model_len=4096, engine_threads=1)
        config.async_scheduling = mode == "async"
        async with AsyncLLM(config) as llm:
            for batch in args.batch:
                rng = random.Random(batch)
                row = await explicit_aborts(llm, max(batch, 2), args.aborts, rng)
                row |= await stop_strings(llm, batch, rng)
                print(f"{mode:5} batch {batch:3}: " + "  ".join(f"{k}={v:.2f}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    asyncio.run(main())

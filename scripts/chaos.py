"""Seeded chaos for the cancellation protocol, at the engine level (AsyncLLM over the real processes).

    python scripts/chaos.py --requests 5000 --seed 7 [--model DIR] [--drops 0.01] [--kills 2] [--worker process]
                            [--batch-invariant]

Many concurrent requests (Poisson arrivals) with random explicit aborts (after k tokens, or after a
random delay), stop strings, sibling requests (one prompt, derived seeds: n > 1 style), a long prompt
(chunked prefill) and a KV cache small enough to preempt, under a fault plan that delays,
duplicates and reorders StepOutputs, TextOutputs, AbortAcks and Aborts (with --drops, loses StepOutputs
and TextOutputs too; with --kills, kill -9s the engine or the detokenizer at seeded times: both are
repaired by resuming requests, DESIGN I6/I8; with --worker process, the worker too, and its lost, duplicated or
reordered ExecuteSteps and StepResults: the engine recomputes its requests). Checked afterwards: every
stream ended (no hang), no output after a Finished, the idle invariant; every stream holds exactly
the tokens the engine sent for it (recorded before the faulty links, EngineConfig.record_outputs),
all of them when it ended with "length", a prefix otherwise; its text is what those tokens decode to (a fault never
corrupts text); and its tokens are a fault-free run's of the same workload (a prefix, unless it ended naturally).

Tokens may legitimately differ from the fault-free run: CPU matmuls are not batch-invariant, so the logits move in
their last bits with the batch composition, and a near-tie can flip a greedy token or a seeded draw (the 8th/9th
logits of top_k=8 tie within 5e-7 in ~1e-4 of draws on the random model). Such requests are counted as `diverged`
(none with --batch-invariant, where a row's logits do not depend on the batch), and each must be explained: its
first differing token at a near-tie of an independent reference (HF transformers' logits,
scripts/chaos_reference.py), every later one the reference sampler's. An unexplained one is a problem (a seed or row
mix-up changes most seeded requests); so is a text that is not what the stream's own tokens decode to, diverged or
not (scripts/chaos_check.py).

The seed fixes the workload, the abort schedule and the fault decisions per link message (faults.py);
which requests a faulty message carries depends on batching, i.e. on timing, so a failure is
reproduced by its seed only statistically. Run without --model, it uses the tiny random Llama.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine.config import EngineConfig, SpeculativeConfig
from actors.runtime import FaultPlan, FaultRule
from frontend.offline import AsyncLLM
from messages.sampling_params import SamplingParams
from scripts.chaos_check import Job, Outcome, Report, compare, sent_tokens
from scripts.chaos_reference import Reference

STOPS = ["e", "a,", "ing", " the", "\n", "s "]


def workload(seed: int, n: int, rate: float = 150.0) -> list[Job]:
    """`n` jobs arriving at `rate` per second; siblings share a prompt and differ by seed; about one in six is
    guided by classifier-free guidance (a companion sequence each: pairs preempted and aborted together)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40_000) for _ in range(rng.randint(1, 40))] for _ in range(12)]
    prompts.append(list(range(2000, 2100)))  # chunked prefill
    jobs, t = [], 0.0
    while len(jobs) < n:
        prompt, max_tokens = rng.choice(prompts), rng.randint(1, 40)
        stop = [rng.choice(STOPS)] if rng.random() < 0.3 else []
        siblings = 3 if rng.random() < 0.15 else 1
        sampled, base_seed = siblings > 1 or rng.random() < 0.4, rng.randrange(1 << 30)
        guidance_scale = 2.5 if rng.random() < 0.15 else 1.0
        for k in range(siblings):
            params = SamplingParams(
                temperature=0.8 if sampled else 0.0,
                top_k=8,
                seed=base_seed + k if sampled else None,
                max_tokens=max_tokens,
                stop=stop,
                ignore_eos=rng.random() < 0.8,
                guidance_scale=guidance_scale,
            )
            t += rng.expovariate(rate)
            r = rng.random()
            after_tokens = rng.randint(0, max_tokens) if r < 0.1 else None
            after_s = rng.uniform(0.0, 0.05) if 0.1 <= r < 0.2 else None
            jobs.append(Job(len(jobs), prompt, params, t, after_tokens, after_s))
    return jobs[:n]


def fault_plan(seed: int, drops: float = 0.0) -> FaultPlan:
    """Duplicates, reorders and delays on every request-path link; with `drops`, StepOutputs and TextOutputs
    are lost with that probability too, ExecuteSteps and StepResults with a fifth of it."""
    rules = []
    for link, msg_type in (
        ("scheduler->detokenizer", "StepOutputs"),
        ("scheduler->detokenizer", "AbortAck"),
        ("detokenizer->client", "TextOutputs"),
        ("*", "Abort"),
    ):
        rules += [
            FaultRule(link=link, msg_type=msg_type, action="duplicate", probability=0.05),
            FaultRule(link=link, msg_type=msg_type, action="reorder", probability=0.01, delay_ms=20),
            FaultRule(link=link, msg_type=msg_type, action="delay", probability=0.03, delay_ms=10),
        ]
    for msg_type in ("ExecuteStep", "StepResult"):  # (a worker in a process of its own: a loss resets it)
        rules += [
            FaultRule(msg_type=msg_type, action="duplicate", probability=0.02),
            FaultRule(msg_type=msg_type, action="reorder", probability=0.002, delay_ms=20),
            FaultRule(msg_type=msg_type, action="drop", probability=drops / 5),
        ]
    if drops:
        rules += [
            FaultRule(link="scheduler->detokenizer", msg_type="StepOutputs", action="drop", probability=drops),
            FaultRule(link="detokenizer->client", msg_type="TextOutputs", action="drop", probability=drops),
        ]
    return FaultPlan(seed=seed, rules=rules)


def chaos_config(
    model: str,
    record_outputs: str | None = None,
    speculative: SpeculativeConfig | None = None,
    worker="inline",
    batch_invariant: bool = False,
) -> EngineConfig:
    return EngineConfig(
        worker=worker,
        batch_invariant=batch_invariant,
        step_timeout_s=10.0,
        speculative=speculative,
        record_outputs=record_outputs,
        model=model,
        max_num_seqs=32,
        num_kv_blocks=60,  # less than 32 running requests need: preemption happens
        block_size=16,
        max_model_len=256,
        max_num_batched_tokens=64,
        engine_threads=1,
    )


async def run(llm: AsyncLLM, jobs: list[Job], aborts: bool) -> list[Outcome]:
    """Every job through `llm` at its arrival time; with `aborts`, its abort schedule too."""
    loop, tag = asyncio.get_running_loop(), uuid.uuid4().hex[:6]
    start = loop.time()

    async def one(job: Job) -> Outcome:
        await asyncio.sleep(max(0.0, start + job.arrival_s - loop.time()))
        rid, sent = f"chaos-{tag}-{job.index}", False
        out = Outcome(rid)
        if aborts and job.abort_after_s is not None:
            loop.call_later(job.abort_after_s, llm.abort, rid)
        async for item in llm.stream(job.prompt, job.params, rid):
            out.add(item)
            if aborts and not sent and not out.finished and len(out.token_ids) >= (job.abort_after_tokens or 1 << 30):
                llm.abort(rid)
                sent = True
        return out

    return list(await asyncio.gather(*(one(job) for job in jobs)))


def kill_schedule(seed: int, n: int, kills: int, procs: list[str], rate: float = 150.0) -> list[tuple[float, str]]:
    """`kills` kills at seeded times within the workload's arrivals, of each of `procs` in turn (a seeded order):
    (seconds from its start, process)."""
    rng = random.Random(seed ^ 0x5EED)
    span, order = n / rate, rng.sample(procs, len(procs))
    return sorted((rng.uniform(0.1, 0.9) * span, order[i % len(order)]) for i in range(kills))


async def chaos(
    reference_llm: AsyncLLM, chaos_llm: AsyncLLM, seed: int, n: int, timeout_s: float = 300, kills: int = 0
) -> Report:
    """The workload of `seed` on a fault-free engine, then with aborts (and `kills` kill -9 of an engine-side
    process at seeded times) on the faulty one; compared."""
    jobs = workload(seed, n)
    reference = await asyncio.wait_for(run(reference_llm, jobs, aborts=False), timeout_s)
    loop = asyncio.get_running_loop()
    procs = sorted(chaos_llm.system.specs)  # the engine's, the detokenizer's (and the worker's, in a process)
    for at, proc in kill_schedule(seed, n, kills, procs):
        loop.call_later(at, chaos_llm.system.kill, proc)
    try:
        got = await asyncio.wait_for(run(chaos_llm, jobs, aborts=True), timeout_s)
    except TimeoutError:
        stuck = [
            f"{rid}: attempt {s.record.attempt}, {s.record.num_tokens} tokens, heard {s.record.heard}"
            for rid, s in list(chaos_llm.client.streams.live.items())[:5]
        ]
        reports = await chaos_llm.idle_reports()
        return Report(
            problems=[f"hang: {len(chaos_llm.client.streams.live)} streams never ended", *stuck, str(reports)]
        )
    client = chaos_llm.client.streams.counts
    after = client.violations["after_finished"]
    problems = [f"{after} outputs after a Finished"] if after else []
    for _ in range(500):
        reports = await chaos_llm.idle_reports()
        if not any(v for details in reports.values() for v in details.values()):
            break
        await asyncio.sleep(0.02)
    else:
        problems.append(f"not idle: {reports}")
    sent = sent_tokens(chaos_llm.config.record_outputs)
    report = compare(jobs, reference, got, sent, chaos_llm.tokenizer.hf, Reference(chaos_llm.config.model).explain)
    report.problems += problems
    engine, detok = await chaos_llm.fresh_stats()
    report.counts |= {
        "client_duplicates": client.violations["duplicate"],
        "client_gaps": client.violations["gap"],
        "client_resumes": client.resumes.total(),
        "detok_repairs": detok.repairs_total,
        "restarts": chaos_llm.system.num_restarts,
        "late_aborts": engine.late_aborts_total,
        "stale_outputs": detok.stale_outputs_dropped_total,
        "violations": detok.protocol_violations_total,
        "preemptions": engine.num_preemptions_total,
        "prefix_cache_hits": engine.prefix_cache_hits_total,  # (prompt tokens: caching is on, its default)
        "worker_resets": engine.worker_resets_total,
        "spec_drafts": engine.spec_num_drafts,
        "spec_accepted_tokens": engine.spec_num_accepted_tokens,
    }
    return report


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--model", help="an HF-style model directory (default: a tiny random Llama)")
    parser.add_argument("--drops", type=float, default=0.0, help="probability a StepOutputs / TextOutputs is lost")
    parser.add_argument("--kills", type=int, default=0, help="kill -9 an engine-side process this many times")
    parser.add_argument("--worker", choices=["inline", "process"], default="inline", help="the worker's placement")
    parser.add_argument("--batch-invariant", action="store_true", help="both engines batch-invariant: none diverges")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from tests.tiny_model import make_tiny_model_dir

        model = str(make_tiny_model_dir(Path(tempfile.mkdtemp(prefix="sluice-chaos-")) / "model"))
    record = str(Path(tempfile.mkdtemp(prefix="sluice-chaos-")) / "sent.jsonl")
    t0 = time.perf_counter()
    async with (
        AsyncLLM(chaos_config(model, batch_invariant=args.batch_invariant)) as clean,
        AsyncLLM(
            chaos_config(model, record, worker=args.worker, batch_invariant=args.batch_invariant),
            fault_plan=fault_plan(args.seed, args.drops),
        ) as faulty,
    ):
        report = await chaos(clean, faulty, args.seed, args.requests, kills=args.kills)
    if args.batch_invariant and report.counts["diverged"]:
        report.problems.append(f"{report.counts['diverged']} streams diverged under --batch-invariant")
    print(f"{args.requests} requests, seed {args.seed}, {time.perf_counter() - t0:.1f} s")
    print(report)
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

"""Tensor parallelism on this machine: TP = 2 (one thread per rank) against TP = 1 (every thread in one worker), in
the same run, on the bundled model (or --model):

    python scripts/bench_tp.py [--model DIR] [--max-tokens 64] [--concurrency 1 16]

Reported: each engine's startup (until it serves), its output tokens/s per concurrency (greedy, ignore_eos, every
request's prompt distinct), the ratio TP = 2 / TP = 1 and whether their greedy outputs agree; and the gang's
collectives alone (two gloo ranks in two processes, the step's shapes): an all-reduce of [rows, hidden], the logits'
gather of [rows, vocab / 2] on the first rank, a step's broadcast, and the step's total (2 all-reduces per layer and
the embedding's, one gather, one broadcast).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import tempfile
import time

import msgspec
import torch

from actors.engine.config import EngineConfig
from frontend.offline import AsyncLLM
from frontend.preflight import resolve_model
from gpu.batch import BatchSpec, ScheduledRow
from gpu.distributed.group import join, leave, rendezvous
from messages.sampling_params import SamplingParams

ROWS = (1, 16, 64)


def collectives(rank: int, store: str, hidden: int, vocab: int, repeats: int, out) -> None:
    torch.set_num_threads(1)
    tp = join(rank, 2, rendezvous(store, 2, rank == 0)[0], torch.device("cpu"), 60)
    result = {}
    for rows in ROWS:
        x, logits = torch.randn(rows, hidden), torch.randn(rows, vocab // 2)
        batch = BatchSpec(1, [ScheduledRow(f"r{i}", i, [-1], 100, list(range(8)), True) for i in range(rows)])
        calls = {"all_reduce": (tp.all_reduce, x), "gather": (tp.gather_first, logits)}
        calls["broadcast"] = (tp.broadcast_bytes, msgspec.msgpack.encode(batch))
        for name, (fn, arg) in calls.items():
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn(arg)
                times.append(time.perf_counter() - t)
            result[name, rows] = 1e6 * statistics.median(times)
    if rank == 0:
        out.put(result)
    leave()


def bench_collectives(hidden: int, vocab: int, layers: int, repeats: int = 200) -> None:
    ctx, tmp = multiprocessing.get_context("spawn"), tempfile.mkdtemp()
    out = ctx.Queue()
    ranks = [
        ctx.Process(target=collectives, args=(r, f"file://{tmp}/store", hidden, vocab, repeats, out)) for r in (0, 1)
    ]
    for p in ranks:
        p.start()
    us = out.get(timeout=300)
    for p in ranks:
        p.join()
    print(f"\ncollectives, two gloo ranks (median us; a step: {2 * layers + 1} all-reduces, a gather, a broadcast)")
    print(f"{'rows':>5} {'all_reduce':>11} {'gather':>9} {'broadcast':>10} {'per step (ms)':>14}")
    for rows in ROWS:
        step = ((2 * layers + 1) * us["all_reduce", rows] + us["gather", rows] + us["broadcast", rows]) / 1e3
        print(f"{rows:>5} {us['all_reduce', rows]:>11.0f} {us['gather', rows]:>9.0f} {us['broadcast', rows]:>10.0f}"
              f" {step:>14.2f}")  # fmt: skip


async def engine(model: str, tp: int, threads: int, max_tokens: int, levels: list[int]) -> dict:
    config = EngineConfig(model=model, tensor_parallel_size=tp, worker="process" if tp > 1 else "inline",
                          engine_threads=threads, max_model_len=1024, max_num_seqs=max(levels))  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    out = {}
    async with AsyncLLM(config, log_level="WARNING") as llm:
        out["startup"] = time.perf_counter() - t
        await llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # (warm)
        for n in levels:
            prompts = [[1, *range(100 + 7 * i, 140 + 7 * i)] for i in range(n)]
            t = time.perf_counter()
            outs = await llm.generate(prompts, params)
            out[n] = (n * max_tokens / (time.perf_counter() - t), [o.token_ids for o in outs])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    model = resolve_model(args.model)
    cores = len(os.sched_getaffinity(0))
    print(f"{model.name} on {cores} cores; TP = 1 with {cores} threads, TP = 2 with {max(1, cores // 2)} per rank")
    one = asyncio.run(engine(str(model.path), 1, cores, args.max_tokens, args.concurrency))
    two = asyncio.run(engine(str(model.path), 2, max(1, cores // 2), args.max_tokens, args.concurrency))
    print(f"startup: TP=1 {one['startup']:.1f} s, TP=2 {two['startup']:.1f} s")
    print(f"{'concurrency':>11} {'TP=1 tok/s':>11} {'TP=2 tok/s':>11} {'ratio':>6} {'same greedy':>12}")
    for n in args.concurrency:
        same = sum(a == b for a, b in zip(one[n][1], two[n][1], strict=True))
        print(f"{n:>11} {one[n][0]:>11.1f} {two[n][0]:>11.1f} {two[n][0] / one[n][0]:>6.2f} {same:>9}/{n}")
    bench_collectives(model.hidden_size, model.vocab_size, model.num_hidden_layers)


if __name__ == "__main__":
    main()

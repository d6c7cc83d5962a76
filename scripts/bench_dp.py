"""Data parallelism on this machine, served over HTTP, in one run on the bundled model (or --model):

    python scripts/bench_dp.py [--model DIR] [--concurrency 16 32] [--requests-per-slot 3] [--max-tokens 64]

Servers, one after the other: DP = 1 with every core's thread in its engine (the baseline), DP = 2 with one thread
per replica (cache_aware routing, the default), and DP = 2 with least_loaded routing. Workloads, streamed, greedy,
ignore_eos: "chat", chat completions over 8 system prompts of ~150 words, each request a user's short question under
one of them (as many users as requests); "random", completions of distinct ~150-word prompts. Reported per server,
workload and concurrency: output tokens/s, mean TTFT, p99 ITL, the prefix cache's hit rate over the run (hits /
queried prompt tokens, every replica's), and the ratio of output tokens/s to the baseline's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random

import aiohttp

from actors.engine.config import EngineConfig
from frontend.bench_serve import WORDS, random_prompts, send_request, summarize
from frontend.http_base import HttpConfig
from frontend.launch import start_server
from frontend.preflight import resolve_model

SYSTEMS = 8
QUESTIONS = ["What should I pack for a trip to {}?", "Explain {} in one paragraph.", "Write a haiku about {}."]


def chat_bodies(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    systems = [f"You are assistant {i}. " + " ".join(rng.choices(WORDS, k=150)) for i in range(SYSTEMS)]
    return [
        {"messages": [{"role": "system", "content": rng.choice(systems)},
                      {"role": "user", "content": rng.choice(QUESTIONS).format(rng.choice(WORDS))}]}
        for _ in range(n)
    ]  # fmt: skip


async def load(url: str, bodies: list[dict], chat: bool, concurrency: int, max_tokens: int) -> dict:
    endpoint = f"{url}/v1/{'chat/completions' if chat else 'completions'}"
    extra = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    extra["stream_options"] = {"include_usage": True}
    slots = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:

        async def one(body: dict):
            async with slots:
                return await send_request(session, endpoint, {**body, **extra}, chat)

        loop = asyncio.get_running_loop()
        t = loop.time()
        outputs = await asyncio.gather(*(one(b) for b in bodies))
        return summarize(outputs, loop.time() - t, 0)


async def cache_counts(url: str) -> tuple[float, float]:
    """The prefix cache's (hits, queries) in prompt tokens, summed over the replicas."""
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as resp:
        text = await resp.text()
    sums = {"sluice:prefix_cache_hits_total": 0.0, "sluice:prefix_cache_queries_total": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in sums:
                sums[sample.name] += sample.value
    return sums["sluice:prefix_cache_hits_total"], sums["sluice:prefix_cache_queries_total"]


async def serve(model: str, dp: int, threads: int, routing: str, args) -> dict:
    engine = EngineConfig(model=model, data_parallel_size=dp, engine_threads=threads, max_model_len=1024,
                          max_num_seqs=max(args.concurrency), kv_cache_memory_gb=1.0)  # fmt: skip
    server = await start_server(engine, HttpConfig(port=0, dp_routing=routing), log_level="WARNING")
    results = {}
    try:
        await load(server.url, random_bodies(4, 99), False, 4, 4)  # (warm)
        for workload in ("chat", "random"):
            for c in args.concurrency:
                n = c * args.requests_per_slot
                bodies = chat_bodies(n, c) if workload == "chat" else random_bodies(n, c)
                hits, queries = await cache_counts(server.url)
                result = await load(server.url, bodies, workload == "chat", c, args.max_tokens)
                hits2, queries2 = await cache_counts(server.url)
                result["hit_rate"] = (hits2 - hits) / max(1.0, queries2 - queries)
                results[workload, c] = result
    finally:
        await server.stop()
    return results


def random_bodies(n: int, seed: int) -> list[dict]:
    return [{"prompt": p} for p in random_prompts(n, 150, seed)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--requests-per-slot", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    model = resolve_model(args.model)
    cores = len(os.sched_getaffinity(0))
    runs = {  # name -> (replicas, threads each, routing)
        f"DP=1 x {cores} threads": (1, cores, "cache_aware"),
        f"DP=2 x {max(1, cores // 2)} cache_aware": (2, max(1, cores // 2), "cache_aware"),
        f"DP=2 x {max(1, cores // 2)} least_loaded": (2, max(1, cores // 2), "least_loaded"),
    }
    print(f"{model.name} on {cores} cores; {args.requests_per_slot} requests per concurrency slot, "
          f"{args.max_tokens} output tokens each")  # fmt: skip
    results = {name: asyncio.run(serve(str(model.path), *run, args)) for name, run in runs.items()}
    base = results[next(iter(runs))]
    print(f"{'server':<28} {'workload':<7} {'conc':>4} {'tok/s':>7} {'x base':>6} {'TTFT ms':>8} {'p99 ITL ms':>10} "
          f"{'hit rate':>8} {'failed':>6}")  # fmt: skip
    for name, result in results.items():
        for (workload, c), r in result.items():
            ratio = r["output_throughput"] / base[workload, c]["output_throughput"]
            print(f"{name:<28} {workload:<7} {c:>4} {r['output_throughput']:>7.1f} {ratio:>6.2f} "
                  f"{r['ttft_ms']['mean']:>8.0f} {r['itl_ms']['p99']:>10.0f} {r['hit_rate']:>8.2f} {r['failed']:>6}")  # fmt: skip


if __name__ == "__main__":
    main()

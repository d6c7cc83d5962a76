"""Speculative decoding (n-gram): output tokens/s with and without it, same build, same run.

    python scripts/bench_spec.py [--model DIR] [--k 4] [--max-tokens 96] [--requests 4]

Two servers in turn (speculation off, then `{"method": "ngram", "num_speculative_tokens": K}`), each
driven through HTTP (greedy chat completions, streamed) at concurrency 1 and 8, on two workloads: a
repetitive one ("repeat / edit this passage": prompt lookup pays) and an open one (free writing: it must
cost little). Reports output tokens/s, the ratio spec / plain, and the acceptance rate and mean accepted
length from the server's sluice:spec_decode_* counters. Targets: >= 1.8x at concurrency 1 on the
repetitive workload, >= 0.95x on the open one.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from actors.engine.config import EngineConfig, SpeculativeConfig
from frontend.bench_serve import send_request
from frontend.http_base import HttpConfig
from frontend.launch import start_server
from frontend.preflight import resolve_model

PASSAGES = [
    "The old lighthouse keeper climbed the stairs every evening. He lit the lamp, wound the clock, and watched "
    "the ships pass the rocks below. In winter the storms were fierce, and the waves broke over the wall.",
    "To make bread, mix flour, water, salt and yeast. Knead the dough for ten minutes, let it rise for an hour, "
    "shape it into a loaf, and bake it in a hot oven until the crust is brown and sounds hollow.",
    "The committee met on Tuesday to review the budget. After a long discussion, they agreed to fund the new "
    "library, repair the school roof, and delay the road project until the spring.",
    "Our solar system has eight planets. Mercury is the closest to the sun, and Neptune is the farthest. "
    "Jupiter is the largest planet, and Saturn is famous for its bright rings.",
]
WORKLOADS = {
    "repetitive": [
        *(f"Repeat this passage exactly:\n\n{p}" for p in PASSAGES),
        *(f"Fix any typos and return the full text:\n\n{p.replace('the', 'teh', 2)}" for p in PASSAGES),
    ],
    "open": [
        "Write a short story about a dragon who learns to cook.",
        "Explain how a rainbow forms.",
        "Give me three tips for learning a new language.",
        "Describe a walk through a forest in autumn.",
        "What are the benefits of regular exercise?",
        "Write a letter to a friend about your weekend.",
        "Why is the sky blue?",
        "Invent a new board game and explain its rules.",
    ],
}


async def spec_counters(url: str) -> tuple[float, float, float]:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as resp:
        text = await resp.text()
    got = {x.name: x.value for f in text_string_to_metric_families(text) for x in f.samples}
    names = ("drafts", "draft_tokens", "accepted_tokens")
    return tuple(got.get(f"sluice:spec_decode_num_{n}_total", 0.0) for n in names)


async def workload(url: str, prompts: list[str], concurrency: int, n: int, max_tokens: int) -> dict:
    before = await spec_counters(url)
    sem = asyncio.Semaphore(concurrency)

    async def one(session, prompt):
        payload = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
        payload |= {"stream": True, "stream_options": {"include_usage": True}}
        async with sem:
            out = await send_request(session, f"{url}/v1/chat/completions", payload, chat=True)
        assert out.success, out.error
        return out.output_tokens

    start = time.perf_counter()
    async with aiohttp.ClientSession() as s:
        tokens = await asyncio.gather(*(one(s, prompts[i % len(prompts)]) for i in range(n)))
    elapsed = time.perf_counter() - start
    await asyncio.sleep(0.6)  # one stats interval: the counters include the last steps
    drafts, draft_tokens, accepted = (b - a for a, b in zip(before, await spec_counters(url), strict=True))
    return {
        "tok_s": sum(tokens) / elapsed,
        "acceptance": accepted / draft_tokens if draft_tokens else None,
        "mean_len": 1 + accepted / drafts if drafts else None,
    }


async def main(args: argparse.Namespace) -> None:
    model = resolve_model(args.model)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=args.k)
    results = {}
    for name, speculative in (("plain", None), ("ngram", spec)):
        engine = EngineConfig(model=str(model.path), speculative=speculative, max_model_len=1024)
        server = await start_server(engine, HttpConfig(port=0), log_level="WARNING")
        try:
            for load, prompts in WORKLOADS.items():
                for conc in (1, 8):
                    n = args.requests * (1 if conc == 1 else 2)
                    results[name, load, conc] = await workload(server.url, prompts, conc, n, args.max_tokens)
                    print(f"{name:6s} {load:10s} c={conc}: {results[name, load, conc]}", flush=True)
        finally:
            await server.stop()
    print(f"\nK = {args.k}, greedy, max_tokens {args.max_tokens}")
    print(
        f"{'workload':12s}{'conc':>5s}{'plain tok/s':>13s}{'ngram tok/s':>13s}{'ratio':>8s}{'accept':>8s}{'mean len':>10s}"
    )
    for load in WORKLOADS:
        for conc in (1, 8):
            p, s = results["plain", load, conc], results["ngram", load, conc]
            acc = f"{s['acceptance']:.0%}" if s["acceptance"] is not None else "-"
            mean = f"{s['mean_len']:.2f}" if s["mean_len"] is not None else "-"
            ratio = s["tok_s"] / p["tok_s"]
            print(f"{load:12s}{conc:5d}{p['tok_s']:13.1f}{s['tok_s']:13.1f}{ratio:7.2f}x{acc:>8s}{mean:>10s}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--requests", type=int, default=4, help="requests at concurrency 1 (twice as many at 8)")
    asyncio.run(main(p.parse_args()))

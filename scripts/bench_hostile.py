"""Hostile input: how fast bad requests are refused, and what they do to a stream in flight.

    python scripts/bench_hostile.py [--model DIR] [--reps 5] [--rate 2] [--canary-tokens 200]

1. Time to reject (median and max of --reps, client-side, body already encoded): a 15 MB prompt,
   12 MB of chat messages, a 15 MB body of token ids, a 50,000-deep array, 1000 stop strings of
   1000 characters. Baselines from the same run: a 1-byte malformed body (the HTTP floor), and
   tokenizing the 15 MB prompt in this process without the GIL released (the first thing a server
   without the length bound would pay, holding its event loop meanwhile).
2. A canary: one greedy stream of --canary-tokens tokens, its inter-token gaps (p50, p99, max) alone;
   while ordinary small completions arrive at --rate per second; while the hostile requests above
   arrive at the same rate. The target: hostile no worse than ordinary.

Serves the bundled SmolLM2 unless --model is given (engine threads: the cores left over).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import numpy as np

from actors.engine.config import EngineConfig
from frontend.bench_serve import random_prompts, send_request
from frontend.http_base import HttpConfig
from frontend.launch import start_server
from frontend.preflight import resolve_model
from frontend.tokenizer import Tokenizer

WORDS = "the quick brown fox jumps over the lazy dog "


def hostile_bodies() -> dict[str, tuple[str, bytes]]:
    chat = {"messages": [{"role": "user", "content": WORDS * ((12 << 20) // len(WORDS))}]}
    return {
        "15 MB prompt": ("completions", json.dumps({"prompt": "x" * (15 << 20), "max_tokens": 4}).encode()),
        "12 MB of messages": ("chat/completions", json.dumps(chat).encode()),
        "15 MB of token ids": ("completions", json.dumps({"prompt": [1000] * ((15 << 20) // 6)}).encode()),
        "50,000-deep array": ("completions", b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"),
        "1000 stop strings x 1000": ("completions", json.dumps({"prompt": "hi", "stop": ["s" * 1000] * 1000}).encode()),
    }


async def post(session: aiohttp.ClientSession, url: str, endpoint: str, data: bytes) -> tuple[int, float]:
    start = time.perf_counter()
    async with session.post(f"{url}/v1/{endpoint}", data=data) as resp:
        await resp.read()
        return resp.status, time.perf_counter() - start


async def rejection_times(url: str, bodies: dict[str, tuple[str, bytes]], reps: int) -> None:
    print(f"\n1. time to reject, ms (median / max of {reps})")
    cases = {"1-byte malformed body (floor)": ("completions", b"{"), **bodies}
    async with aiohttp.ClientSession() as s:
        for name, (endpoint, data) in cases.items():
            runs = [await post(s, url, endpoint, data) for _ in range(reps)]
            statuses = sorted({status for status, _ in runs})
            times = [t * 1000 for _, t in runs]
            print(f"   {name:30s} {statistics.median(times):8.1f} / {max(times):8.1f}   HTTP {statuses}")


async def canary_gaps(url: str, tokens: int, traffic=None) -> list[float]:
    payload = {"prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    payload |= {"stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(send_request(s, f"{url}/v1/completions", payload, chat=False))
        background = asyncio.ensure_future(traffic(s, task)) if traffic else None
        out = await task
        if background is not None:
            sent = await background
            print(f"   ({sent} requests sent meanwhile)")
    assert out.success, out.error
    return out.itl


def at_rate(rate: float, make):
    """Traffic: `make(session)` every 1/rate seconds until the canary is done; returns the count sent."""

    async def traffic(session: aiohttp.ClientSession, canary: asyncio.Future) -> int:
        pending, sent = set(), 0
        while not canary.done():
            pending.add(asyncio.ensure_future(make(session, sent)))
            sent += 1
            await asyncio.wait([canary], timeout=1 / rate)
        await asyncio.gather(*pending)
        return sent

    return traffic


def show(name: str, gaps: list[float]) -> float:
    ms = np.asarray(gaps) * 1000
    p99 = float(np.percentile(ms, 99))
    print(f"   {name:22s} p50 {np.percentile(ms, 50):7.1f}  p99 {p99:7.1f}  max {ms.max():7.1f} ms")
    return float(ms.max())


async def main(args: argparse.Namespace) -> None:
    model = resolve_model(args.model)
    tokenizer = Tokenizer.from_model_dir(model.path)
    bodies = hostile_bodies()
    start = time.perf_counter()
    tokenizer.hf.encode("x" * (15 << 20))
    print(f"baseline: tokenizing the 15 MB prompt (GIL held): {(time.perf_counter() - start) * 1000:.0f} ms")
    server = await start_server(EngineConfig(model=str(model.path)), HttpConfig(port=0), log_level="WARNING")
    try:
        url = server.url
        await rejection_times(url, bodies, args.reps)
        print(f"\n2. canary inter-token gaps ({args.canary_tokens} tokens), traffic at {args.rate}/s")
        prompts = random_prompts(64, 40, seed=0)

        async def ordinary(s, i):
            return await post(s, url, "completions", json.dumps({"prompt": prompts[i % 64], "max_tokens": 16}).encode())

        kinds = list(bodies.values())

        async def hostile(s, i):
            return await post(s, url, *kinds[i % len(kinds)])

        show("alone", await canary_gaps(url, args.canary_tokens))
        calm = show("ordinary traffic", await canary_gaps(url, args.canary_tokens, at_rate(args.rate, ordinary)))
        rough = show("hostile traffic", await canary_gaps(url, args.canary_tokens, at_rate(args.rate, hostile)))
        print(f"   worst gap, hostile / ordinary: {rough / calm:.2f}x")
    finally:
        await server.stop()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--canary-tokens", type=int, default=200)
    asyncio.run(main(p.parse_args()))

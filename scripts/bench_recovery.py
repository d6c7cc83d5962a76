"""What a process death costs the clients (DESIGN I8): the real server and `openai` client, N streams mid-flight,
kill -9 of the engine process, then of the detokenizer's (with `--worker process`, first of the worker's);
against an undisturbed run of the same streams in the same run:

    python scripts/bench_recovery.py [--model DIR] [--streams 8] [--max-tokens 256] [--worker process]

Reported per kind of death: the pause (kill to the first chunk every stream got after it, the longest), the
time all streams took against the undisturbed run, and whether every stream's text equals the undisturbed one
(greedy and seeded streams, half each).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import openai

from actors.engine.config import EngineConfig
from frontend.http_base import HttpConfig
from frontend.launch import start_server
from frontend.preflight import resolve_model


async def stream(client: openai.AsyncOpenAI, i: int, max_tokens: int, started: asyncio.Event, stamps: list[float]):
    sampled = {"temperature": 1.0, "seed": i} if i % 2 else {"temperature": 0.0}
    out = await client.completions.create(
        model=None,
        prompt=f"Tell me story number {i} about a lighthouse.",
        max_tokens=max_tokens,
        stream=True,
        extra_body={"ignore_eos": True},
        **sampled,
    )
    text = ""
    async for chunk in out:
        text += chunk.choices[0].text
        stamps.append(time.monotonic())
        if len(stamps) >= 4:
            started.set()
    return text


async def run(server, n: int, max_tokens: int, kill: str | None) -> tuple[list[str], float, float]:
    """Texts, seconds from start to the last stream's end, and the pause a kill cost (0 without)."""
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)
    started = [asyncio.Event() for _ in range(n)]
    stamps: list[list[float]] = [[] for _ in range(n)]
    t0 = time.monotonic()
    tasks = [asyncio.ensure_future(stream(client, i, max_tokens, started[i], stamps[i])) for i in range(n)]
    pause = 0.0
    if kill:
        await asyncio.gather(*(e.wait() for e in started))
        killed = time.monotonic()
        server.kill(kill)
        texts = await asyncio.gather(*tasks)
        pause = max(min(t for t in s if t > killed) - killed for s in stamps)
    else:
        texts = await asyncio.gather(*tasks)
    return texts, time.monotonic() - t0, pause


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="an HF-style model directory (default: the bundled SmolLM2)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--worker", choices=["inline", "process"], default="inline", help="the worker's placement")
    args = parser.parse_args()
    model = resolve_model(args.model)
    engine = EngineConfig(model=str(model.path), max_model_len=1024, worker=args.worker)
    server = await start_server(engine, HttpConfig(port=0), log_level="ERROR")
    try:
        await run(server, 2, 8, None)  # warm up
        want, took, _ = await run(server, args.streams, args.max_tokens, None)
        print(f"{args.streams} streams x {args.max_tokens} tokens, undisturbed: {took:.2f} s")
        for proc in ("worker", "engine", "detokenizer")[args.worker == "inline" :]:
            got, took_k, pause = await run(server, args.streams, args.max_tokens, proc)
            same = sum(g == w for g, w in zip(got, want, strict=True))
            print(
                f"kill -9 {proc}: longest pause {pause:.2f} s, all done in {took_k:.2f} s "
                f"({took_k / took:.2f}x undisturbed), {same}/{len(want)} texts identical"
            )
    finally:
        await server.stop()


if __name__ == "__main__":
    asyncio.run(main())

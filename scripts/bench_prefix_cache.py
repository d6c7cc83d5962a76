"""Prefix caching's effect, caching on against off in the same run (the offline engine: scheduler + detokenizer
processes, no HTTP; greedy, random-token prompts):

    python scripts/bench_prefix_cache.py [--model DIR] [--prefix-len 1000] [--chats 8] [--turns 4]

1. A cached prefix: a request sharing a `--prefix-len`-token prefix with the one before it: its time to first
   token (three fresh prefixes, median), on / off.
2. Multi-turn chats on a shared system prompt: `--chats` conversations at once, `--turns` turns each, every turn's
   prompt the whole conversation so far (system prompt, earlier questions and answers): mean TTFT and output
   tokens/s, on / off.
3. No sharing: a batch of 16 random prompts decoding 64 tokens: output tokens/s, on / off (the bookkeeping's cost).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from actors.engine.config import EngineConfig
from frontend.offline import AsyncLLM
from frontend.preflight import resolve_model
from messages.sampling_params import SamplingParams

RNG = random.Random(0)


def tokens(n: int) -> list[int]:
    return [RNG.randrange(1000, 40000) for _ in range(n)]


async def ttft(llm: AsyncLLM, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Seconds to the first token, and the tokens."""
    start, first, out = time.perf_counter(), None, []
    async for item in llm.stream(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)):
        if first is None and item.token_ids:
            first = time.perf_counter() - start
        out += item.token_ids
    return first, out


async def cached_prefix(llm: AsyncLLM, prefix_len: int) -> float:
    times = []
    for _ in range(3):
        prefix = tokens(prefix_len)
        await ttft(llm, prefix + tokens(8), 1)
        times.append((await ttft(llm, prefix + tokens(8), 1))[0])
    return statistics.median(times)


async def chats(llm: AsyncLLM, n: int, turns: int) -> tuple[float, float]:
    system, firsts, generated = tokens(200), [], 0
    start = time.perf_counter()

    async def chat() -> None:
        nonlocal generated
        history = list(system)
        for _ in range(turns):
            history += tokens(30)
            first, answer = await ttft(llm, history, 32)
            firsts.append(first)
            generated += len(answer)
            history += answer

    await asyncio.gather(*(chat() for _ in range(n)))
    return statistics.mean(firsts), generated / (time.perf_counter() - start)


async def no_sharing(llm: AsyncLLM) -> float:
    prompts = [tokens(64) for _ in range(16)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    start = time.perf_counter()
    outs = await llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


async def main(args: argparse.Namespace) -> None:
    model = resolve_model(args.model)
    results = {}
    for caching in (True, False):
        config = EngineConfig(model=str(model.path), enable_prefix_caching=caching, kv_cache_memory_gb=2.0)
        async with AsyncLLM(config) as llm:
            await ttft(llm, tokens(16), 2)  # warm-up
            prefix = await cached_prefix(llm, args.prefix_len)
            chat_ttft, chat_tps = await chats(llm, args.chats, args.turns)
            plain = max([await no_sharing(llm) for _ in range(2)])
            results[caching] = (prefix, chat_ttft, chat_tps, plain)
    on, off = results[True], results[False]
    print(f"{'':>42} {'on':>9} {'off':>9} {'on / off':>9}")
    rows = [
        (f"TTFT, a cached {args.prefix_len}-token prefix (s)", 0),
        ("multi-turn chats: mean TTFT (s)", 1),
        ("multi-turn chats: output tok/s", 2),
        ("no sharing, batch 16: output tok/s", 3),
    ]
    for name, i in rows:
        print(f"{name:>42} {on[i]:>9.3f} {off[i]:>9.3f} {on[i] / off[i]:>8.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: the bundled SmolLM2)")
    parser.add_argument("--prefix-len", type=int, default=1000)
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    asyncio.run(main(parser.parse_args()))

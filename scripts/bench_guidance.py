"""Classifier-free guidance's cost: output tokens/s of guided requests against the same requests unguided, measured
in one engine in the same run (the seed says CFG costs exactly 2x: a companion sequence per request).

    python scripts/bench_guidance.py [--model DIR] [--concurrency 1 16] [--max-tokens 64] [--prompt-len 128]

Each measurement runs `concurrency` greedy requests at once (random-token prompts, ignore_eos) through the offline
engine (`AsyncLLM`: scheduler + detokenizer processes, no HTTP), unguided then guided (guidance_scale 3, BOS as
the negative prompt), twice each, and prints the best tokens/s of each and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from actors.engine.config import EngineConfig
from frontend.offline import AsyncLLM
from frontend.preflight import resolve_model
from messages.sampling_params import SamplingParams


async def tokens_per_s(llm: AsyncLLM, prompts: list[list[int]], params: SamplingParams) -> float:
    start = time.perf_counter()
    outs = await llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


async def main(args: argparse.Namespace) -> None:
    model = resolve_model(args.model)
    rng = random.Random(0)
    config = EngineConfig(model=str(model.path), max_num_seqs=2 * max(args.concurrency))
    async with AsyncLLM(config) as llm:
        print(f"{'concurrency':>11} {'unguided tok/s':>15} {'guided tok/s':>13} {'unguided / guided':>18}")
        for c in args.concurrency:
            prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt_len)] for _ in range(c)]
            plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
            guided = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, guidance_scale=3.0)
            await tokens_per_s(llm, prompts[:1], plain)  # warm-up
            best = {"plain": 0.0, "guided": 0.0}
            for _ in range(2):
                for name, params in (("plain", plain), ("guided", guided)):
                    best[name] = max(best[name], await tokens_per_s(llm, prompts, params))
            print(f"{c:>11} {best['plain']:>15.1f} {best['guided']:>13.1f} {best['plain'] / best['guided']:>17.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: the bundled SmolLM2)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    asyncio.run(main(parser.parse_args()))

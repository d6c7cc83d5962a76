"""Beam search's cost, in one server in the same run: a search of `width` beams (one engine request, its beams
sharing the prompt's blocks) against `width` sampled choices of the same length (the same sequences to compute,
without the search), and against vLLM's way, a client loop of one-token requests per beam and step (here through
this server, with prefix caching: what vLLM's frontend beam search does).

    python scripts/bench_beam.py [--model DIR] [--widths 2 4] [--max-tokens 32] [--rounds 5]

Output length is fixed (ignore_eos); medians over the rounds, and ratios against the sampled choices.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import aiohttp

from actors.engine.config import EngineConfig
from frontend.http_base import HttpConfig
from frontend.launch import start_server
from frontend.preflight import resolve_model

PROMPT = "The history of the river Thames begins"


async def post(s: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with s.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def client_loop(s: aiohttp.ClientSession, url: str, prompt: list[int], width: int, max_tokens: int) -> list:
    """Beam search as vLLM's frontend runs it: each step, a one-token request per beam for its top 2 x width."""
    beams = [([], 0.0)]
    for _ in range(max_tokens):
        bodies = [{"prompt": prompt + out, "max_tokens": 1, "logprobs": 2 * width, "temperature": 0,
                   "return_tokens_as_token_ids": True} for out, _ in beams]  # fmt: skip
        answers = await asyncio.gather(*(post(s, url, b) for b in bodies))
        ranked = []
        for (out, cum), answer in zip(beams, answers, strict=True):
            top = answer["choices"][0]["logprobs"]["top_logprobs"][0]
            ranked += [(cum + lp, [*out, int(tok.split(":")[1])]) for tok, lp in top.items()]
        beams = [(seq, cum) for cum, seq in sorted(ranked, key=lambda c: -c[0])[:width]]
    return beams


async def main(args: argparse.Namespace) -> None:
    model = resolve_model(args.model)
    engine = EngineConfig(model=str(model.path), max_model_len=1024, max_num_seqs=max(args.widths) * 2)
    server = await start_server(engine, HttpConfig(port=0), log_level="WARNING")
    url = f"{server.url}/v1/completions"
    try:
        async with aiohttp.ClientSession() as s:
            prompt = (await post(s, f"{server.url}/tokenize", {"prompt": PROMPT}))["tokens"]
            fixed = {"prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True}
            for width in args.widths:
                calls = {
                    "sampled choices": lambda w=width: post(s, url, {**fixed, "n": w, "seed": 1}),
                    "beam search": lambda w=width: post(s, url, {**fixed, "n": w, "use_beam_search": True}),
                    "client loop (vLLM's way)": lambda w=width: client_loop(s, url, prompt, w, args.max_tokens),
                }
                times = {name: [] for name in calls}
                for _ in range(args.rounds + 1):  # (the first round warms up)
                    for name, call in calls.items():
                        start = time.perf_counter()
                        await call()
                        times[name].append(time.perf_counter() - start)
                base = statistics.median(times["sampled choices"][1:])
                print(f"\nwidth {width}, {args.max_tokens} output tokens per sequence, {args.rounds} rounds")
                for name, ts in times.items():
                    med = statistics.median(ts[1:])
                    print(f"  {name:26s} median {med * 1e3:8.1f} ms  ({med / base:.2f}x the sampled choices)")
    finally:
        await server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    asyncio.run(main(parser.parse_args()))

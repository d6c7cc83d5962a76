"""Weight-only quantization: speed and quality against float32, measured in one run through the real engine.

    python scripts/bench_quant.py [--modes int8 int4] [--tokens 64]

Quality: one ~300-token English text fed as a prompt with prompt_logprobs, so every position's next-token
distribution is scored teacher-forced: the mean and p99 |logprob difference| of the text's actual tokens against
float32, and how often the top-1 (greedy) token agrees. Speed: batch-1 decode, ms per output token (wall).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine.config import EngineConfig
from frontend.offline import AsyncLLM
from gpu.convert import default_model_dir
from messages.sampling_params import SamplingParams

TEXT = (
    "The history of the Roman Empire spans many centuries. It began with the founding of the city of Rome and grew "
    "through conquest and diplomacy into one of the largest empires of the ancient world. Its legacy includes law, "
    "language, architecture and engineering. Roads, aqueducts and cities built by the Romans can still be seen "
    "across Europe, North Africa and the Middle East today. Historians still debate the causes of its decline. "
    "Some point to economic troubles, others to military defeats, political instability or the pressure of "
    "migrating peoples on its borders. In the east, the empire survived for another thousand years, with its "
    "capital at Constantinople, until the city fell in 1453. Latin, the language of Rome, became the ancestor of "
    "Italian, French, Spanish, Portuguese and Romanian, and its alphabet is used by many languages around the world "
    "today. Roman law shaped the legal systems of much of Europe, and Roman ideas about citizenship and government "
    "influenced the founders of modern republics."
)


async def measure(model_dir: Path, mode: str | None, tokens: int) -> dict:
    config = EngineConfig(model=str(model_dir), quantization=mode, engine_threads=1)
    async with AsyncLLM(config, log_level="WARNING") as llm:
        ids = llm.tokenizer.encode(TEXT)
        scored = await llm.generate_one(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
        gen = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        await llm.generate_one(ids[:32], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        times = []
        for _ in range(3):
            start = time.perf_counter()
            await llm.generate_one(ids[:32], gen)
            times.append((time.perf_counter() - start) / tokens * 1e3)
    plp = scored.prompt_logprobs
    return {"sampled": plp.sampled, "top": [t[0] for t in plp.top_ids], "ms": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["int8", "int4"], choices=["int8", "int4"])
    ap.add_argument("--tokens", type=int, default=64, help="output tokens of the timed batch-1 requests")
    args = ap.parse_args()
    model_dir = default_model_dir()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")  # fmt: skip
    print(f"# bench_quant {time.strftime('%Y-%m-%d %H:%M')}: {model_dir.name}, {cpu}, {os.cpu_count()} cores, "
          f"engine 1 thread, load {Path('/proc/loadavg').read_text().split()[0]}")  # fmt: skip
    base = asyncio.run(measure(model_dir, None, args.tokens))
    print(f"{'weights':8s} {'ms/token':>9s} {'speed-up':>9s} {'mean |dlogprob|':>16s} {'p99':>7s} {'top-1 agree':>12s}")
    print(f"{'float32':8s} {base['ms']:9.1f} {1.0:8.2f}x {0:16.4f} {0:7.4f} {1:12.1%}")
    for mode in args.modes:
        r = asyncio.run(measure(model_dir, mode, args.tokens))
        deltas = sorted(abs(a - b) for a, b in zip(r["sampled"], base["sampled"], strict=True))
        agree = statistics.mean(a == b for a, b in zip(r["top"], base["top"], strict=True))
        p99 = deltas[int(0.99 * (len(deltas) - 1))]
        print(f"{mode:8s} {r['ms']:9.1f} {base['ms'] / r['ms']:8.2f}x {statistics.mean(deltas):16.4f} {p99:7.4f} "
              f"{agree:12.1%}")  # fmt: skip
    print(f"({len(base['sampled'])} scored positions)")


if __name__ == "__main__":
    main()

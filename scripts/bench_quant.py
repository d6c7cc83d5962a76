"""Weight-only quantization against float32, measured in one run: served throughput, per-layer paths, quality.

    python scripts/bench_quant.py [--part served layers quality] [--modes int8 int4 bfloat16] [--concurrency 1 8 16]
                                  [--repeats 2] [--tokens 64] [--threads N] [--rows 1 8 16 64 256]

served:  the real engine (AsyncLLM, engine threads as `sluice serve` sets them unless --threads), closed loop:
         c clients each send requests one after another (2 each, at least 3 in all; ~32-token prompts, --tokens
         output tokens, ignore_eos); output tok/s over the wall time of the wave. The weight kinds are interleaved
         (float32, then each mode, per repeat, a fresh engine each) and each figure is the median over repeats;
         the ratio is against float32 from the same run. The load average is printed beside every row.
layers:  the real model's linear layers in model order (30 x q k v o gate up down, then the LM head), each called
         on `rows` rows, swept 3 times (the first discarded), so weights come from memory as in a step: ms per
         sweep for float32 (gpu/layers/linear.py), and for each mode its quantized kernel and its forward
         (gpu/layers/quant.py: the kernel up to each layer's kernel_rows, the float32 GEMM on the dequantized weight
         above). One torch thread unless --threads, timed in this process's CPU time, which other processes' load
         inflates far less than wall time (with more threads CPU time counts their spinning too: compare on a quiet
         machine).
quality: one ~300-token English text fed as a prompt with prompt_logprobs, so every position's next-token
         distribution is scored teacher-forced: mean and p99 |logprob difference| of the text's actual tokens
         against float32, how often the top-1 (greedy) token agrees, and batch-1 decode ms per output token
         (engine on 1 thread).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine.config import EngineConfig
from frontend.offline import AsyncLLM
from gpu.layers.linear import Linear
from gpu.layers.quant import QuantLinear
from gpu.loading.config import ModelConfig
from gpu.loading.convert import default_model_dir
from gpu.loading.weights import load_model
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
# each kind's (--quantization, --dtype): bfloat16 is the 16-bit weights (float32 activations)
KINDS = {"float32": (None, "float32"), "int8": ("int8", "float32"), "int4": ("int4", "float32"),
         "bfloat16": (None, "bfloat16")}  # fmt: skip


def engine_config(model_dir: Path, kind: str, **kw) -> EngineConfig:
    quantization, dtype = KINDS[kind]
    return EngineConfig(model=str(model_dir), quantization=quantization, dtype=dtype, **kw)


def load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


async def serve_waves(model_dir: Path, mode: str, levels: list[int], tokens: int, threads: int | None) -> dict:
    """Output tok/s at each concurrency level, one engine for all of them."""
    config = engine_config(model_dir, mode, engine_threads=threads)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    async with AsyncLLM(config, log_level="WARNING") as llm:
        ids = llm.tokenizer.encode(TEXT)
        await llm.generate_one(ids[:32], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        prompts = iter([ids[(7 * i) % 150 :][: 28 + i % 5] for i in range(10_000)])  # distinct, 28-32 tokens
        rates = {}
        for c in levels:
            per_client = max(2, -(-3 // c))

            async def client() -> int:
                done = [await llm.generate_one(next(prompts), params) for _ in range(per_client)]  # noqa: B023
                return sum(len(o.token_ids) for o in done)

            start = time.perf_counter()
            out = sum(await asyncio.gather(*(client() for _ in range(c))))
            rates[c] = out / (time.perf_counter() - start)
    return rates


def served(model_dir: Path, args: argparse.Namespace) -> None:
    kinds = ["float32", *args.modes]
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for rep in range(args.repeats):
        for kind in kinds:
            before = load()
            rates = asyncio.run(serve_waves(model_dir, kind, args.concurrency, args.tokens, args.threads))
            runs[kind].append(rates)
            cells = " ".join(f"c{c} {r:6.1f}" for c, r in rates.items())
            print(f"  repeat {rep + 1} {kind:8s} {cells}  (load {before} -> {load()})", flush=True)
    median = {k: {c: statistics.median(r[c] for r in runs[k]) for c in args.concurrency} for k in kinds}
    print(f"{'weights':8s} " + " ".join(f"{f'c{c} tok/s':>10s} {'ratio':>6s}" for c in args.concurrency))
    for kind in kinds:
        cells = (f"{median[kind][c]:10.1f} {median[kind][c] / median['float32'][c]:5.2f}x" for c in args.concurrency)
        print(f"{kind:8s} " + " ".join(cells))


def sweep(calls: list, rows: int) -> float:
    """CPU ms per sweep of `calls` (each on a rows x in_features input), the median of two after a warm one."""
    inputs = {n: torch.randn(rows, n) for n in {c[0] for c in calls}}
    times = []
    for _ in range(3):
        start = time.process_time()
        for in_features, call in calls:
            call(inputs[in_features])
        times.append(time.process_time() - start)
    return statistics.median(times[1:]) * 1e3


@torch.no_grad()
def layers(model_dir: Path, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads or 1)
    config = ModelConfig.from_path(model_dir)
    columns: dict[str, list] = {}
    kernel_rows: dict[str, int] = {}
    for kind in ["float32", *args.modes]:
        quantization, dtype = KINDS[kind]
        weights = getattr(torch, dtype)
        model = load_model(config, torch.device("cpu"), torch.float32, quantization, weight_dtype=weights)
        mods = [m for m in model.modules() if isinstance(m, Linear | QuantLinear)]
        if kind == "float32":
            columns["float32"] = [(m.in_features, m) for m in mods]
        else:
            if quantization:  # (16-bit weights have no kernel of their own: the dense one on their panels)
                columns[f"{kind} kernel"] = [(m.in_features, m.kernel) for m in mods]
                kernel_rows[kind] = mods[0].kernel_rows
            columns[kind] = [(m.in_features, m) for m in mods]
        del model
    print(f"CPU ms per sweep of the {len(columns['float32'])} linear layers ({torch.get_num_threads()} threads); "
          f"forward: kernel up to {kernel_rows} rows")  # fmt: skip
    print(f"{'rows':>5s} " + " ".join(f"{name:>12s}" for name in columns) + "  load")
    for rows in args.rows:
        cells = [sweep(calls, rows) for calls in columns.values()]
        print(f"{rows:5d} " + " ".join(f"{ms:12.1f}" for ms in cells) + f"  {load()}", flush=True)


async def score(model_dir: Path, mode: str, tokens: int) -> dict:
    config = engine_config(model_dir, mode, engine_threads=1)
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


def quality(model_dir: Path, args: argparse.Namespace) -> None:
    base = asyncio.run(score(model_dir, "float32", args.tokens))
    print(f"{'weights':8s} {'ms/token':>9s} {'speed-up':>9s} {'mean |dlogprob|':>16s} {'p99':>7s} {'top-1 agree':>12s}")
    print(f"{'float32':8s} {base['ms']:9.1f} {1.0:8.2f}x {0:16.4f} {0:7.4f} {1:12.1%}")
    for mode in args.modes:
        r = asyncio.run(score(model_dir, mode, args.tokens))
        deltas = sorted(abs(a - b) for a, b in zip(r["sampled"], base["sampled"], strict=True))
        agree = statistics.mean(a == b for a, b in zip(r["top"], base["top"], strict=True))
        p99 = deltas[int(0.99 * (len(deltas) - 1))]
        print(f"{mode:8s} {r['ms']:9.1f} {base['ms'] / r['ms']:8.2f}x {statistics.mean(deltas):16.4f} {p99:7.4f} "
              f"{agree:12.1%}")  # fmt: skip
    print(f"({len(base['sampled'])} scored positions)")


PARTS = {"served": served, "layers": layers, "quality": quality}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", nargs="+", default=list(PARTS), choices=PARTS)
    ap.add_argument("--modes", nargs="+", default=["int8", "int4", "bfloat16"], choices=[*KINDS][1:])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 16])
    ap.add_argument("--repeats", type=int, default=2, help="served: runs of every weight kind, interleaved")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request (served, quality's timing)")
    ap.add_argument("--threads", type=int, default=None, help="engine threads (served: default sluice's; layers: 1)")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 9, 12, 16, 24, 32, 64, 256])
    args = ap.parse_args()
    model_dir = default_model_dir()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")  # fmt: skip
    print(f"# bench_quant {time.strftime('%Y-%m-%d %H:%M')}: {model_dir.name}, {cpu}, {os.cpu_count()} cores, "
          f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), load {load()}")  # fmt: skip
    for part in args.part:
        print(f"## {part}", flush=True)
        PARTS[part](model_dir, args)


if __name__ == "__main__":
    main()

"""The native linear kernels' speed on Llama-3.2-3B's shapes, every weight format, against the machine's read bandwidth
measured first in the same run (the native row_sum over 4 GiB: one read of every byte, as a decode step reads its
weights): GEMV GB/s at 1 row (the weight's bytes over the time) and its ratio to that bandwidth, then tok/s (rows
over the time) at more rows (batched decode, prefill).

    python scripts/bench_blocks.py [--threads 2] [--rows 1 8 64 512] [--repeats 10]

Weights are random (speed does not depend on values): float32/bfloat16/float16 panels (gpu/layers/linear.py),
Q8_0/Q4_K/Q6_K blocks (csrc/blocks.cpp) of random bytes with finite scales. Shapes: q/k/v 3072 -> 5120, o 3072 ->
3072, gate/up 3072 -> 16384, down 8192 -> 3072: one layer's four projections, timed as the model calls them.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGML_QUANT_SIZES

from gpu.kernels import native
from gpu.layers.linear import BLOCK_FORMATS

SHAPES = [(5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192)]  # (out, in) of qkv, o, gate_up, down


def read_bandwidth(ops, repeats: int) -> float:
    x = torch.ones(64, 1 << 24)  # 4 GiB, far past the caches
    return x.numel() * 4 / min(timed(lambda: ops.row_sum(x)) for _ in range(repeats))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def layers(ops, fmt) -> list[tuple[torch.Tensor, int]]:
    """One layer's weights in `fmt` (a torch dtype: panels; else a block format): (held tensor, out) each."""
    rng = np.random.default_rng(0)
    made = []
    for out, inp in SHAPES:
        if isinstance(fmt, torch.dtype):
            made.append((ops.pack(torch.randn(out, inp).to(fmt)), out))
            continue
        elems, size = GGML_QUANT_SIZES[fmt]
        b = rng.integers(0, 256, (out, inp // elems, size), dtype=np.uint8)
        for offset in {2: [0], 3: [0, 2], 6: [0], 7: [0, 2], 8: [0], 12: [0, 2], 13: [0, 2], 14: [208]}[int(fmt)]:
            b[:, :, offset : offset + 2] = (
                np.full((out, inp // elems), 1e-3, np.float16).view(np.uint8).reshape(out, -1, 2)
            )
        made.append((ops.huge_copy(torch.from_numpy(b.reshape(out, -1))), out))
    return made


def step(ops, fmt, held, x_of) -> None:
    for (w, out), (_, inp) in zip(held, SHAPES, strict=True):
        x = x_of[inp]
        if isinstance(fmt, torch.dtype):
            ops.linear(x, w, out, None)
        else:
            ops.block_linear(x, w, int(fmt), None)


def name_of(fmt) -> str:
    return str(fmt).removeprefix("torch.") if isinstance(fmt, torch.dtype) else fmt.name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--formats", nargs="+", help="the formats to time (default: all), by name: bfloat16 Q4_K ...")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = native.ops()
    bandwidth = read_bandwidth(ops, 4)
    cpu = next(
        ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in ln
    )
    print(f"# bench_blocks {time.strftime('%Y-%m-%d %H:%M')}, {cpu}, {args.threads} threads, load "
          f"{Path('/proc/loadavg').read_text().split()[0]}; read bandwidth {bandwidth / 1e9:.1f} GB/s")  # fmt: skip
    print(
        f"{'format':8s} {'bytes/w':>8s} {'GEMV GB/s':>10s} {'/ read':>7s}"
        + "".join(f"{f'{r} rows tok/s':>16s}" for r in args.rows)
    )
    for fmt in [torch.float32, torch.bfloat16, torch.float16, *BLOCK_FORMATS]:
        if args.formats and name_of(fmt) not in args.formats:
            continue
        held = layers(ops, fmt)
        nbytes = sum(w.numel() * w.element_size() for w, _ in held)
        cells, gemv = [], 0.0
        for rows in args.rows:
            x_of = {inp: torch.randn(rows, inp) for inp in {i for _, i in SHAPES}}
            step(ops, fmt, held, x_of)  # (warm)
            call = functools.partial(step, ops, fmt, held, x_of)
            s = statistics.median(timed(call) for _ in range(args.repeats))
            gemv = nbytes / s if rows == 1 else gemv
            cells.append(f"{rows / s:16.1f}")
        name = name_of(fmt)
        weights = sum(o * i for o, i in SHAPES)
        print(f"{name:8s} {nbytes / weights:8.3f} {gemv / 1e9:10.1f} {gemv / bandwidth:7.2f}" + "".join(cells))


if __name__ == "__main__":
    main()

"""Stacked against separate projection weights on CPU (issue 30: the GPU path stacks q/k/v and gate/up into one GEMM
each; this measured whether the CPU path should too: it does, docs/performance-history.md, "GPU step kernels (issue
30): launches per step, stacked weights").

    python scripts/bench_layouts.py [--threads 2 1] [--rows 1 8 64 512] [--repeats 200]

SmolLM2-135M's shapes (hidden 576, 9 query heads and 3 KV heads of 64, intermediate 1536), float32, through
gpu/layers/linear.py's packed Linear as the model runs them: q, k, v as three Linears against one stacked qkv Linear and
its split; gate and up as two Linears with silu(gate) * up against one gate_up Linear with the torch kernel set's
act_and_mul. Calls alternate (separate, stacked) so both see the same machine load; the median time of each over
--repeats and the ratio stacked / separate (below 1: stacking is faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu.kernels.reference import ACTIVATIONS, TORCH_KERNELS
from gpu.layers.linear import Linear
from gpu.layers.mlp import stack_linears

HIDDEN, Q, KV, INTER = 576, 9 * 64, 3 * 64, 1536


def linears(*outs: int) -> list[Linear]:
    made = [Linear(HIDDEN, n, bias=False).requires_grad_(False) for n in outs]
    return made


def packed(*layers: Linear) -> Linear:
    for layer in layers:
        layer.pack()
    return layers[0]


def pairs(rows: int):
    """(name, separate, stacked) callables on one input of `rows` rows."""
    x = torch.randn(rows, HIDDEN)
    q, k, v = linears(Q, KV, KV)
    qkv = packed(stack_linears(q, k, v))
    gate, up = linears(INTER, INTER)
    gate_up = packed(stack_linears(gate, up))
    packed(q, k, v, gate, up)
    yield "qkv", lambda: (q(x), k(x), v(x)), lambda: qkv(x).split([Q, KV, KV], -1)
    yield "gate_up", lambda: ACTIVATIONS["silu"](gate(x)) * up(x), lambda: TORCH_KERNELS.act_and_mul(gate_up(x), "silu")


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    print(f"{'threads':>7} {'rows':>5} {'weights':>8} {'separate us':>12} {'stacked us':>11} {'stacked/sep':>11}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            for name, separate, stacked in pairs(rows):
                for _ in range(10):
                    separate(), stacked()
                times = [(timed(separate), timed(stacked)) for _ in range(args.repeats)]
                sep, st = (statistics.median(t) * 1e6 for t in zip(*times, strict=True))
                print(f"{threads:>7} {rows:>5} {name:>8} {sep:>12.1f} {st:>11.1f} {st / sep:>11.2f}")


if __name__ == "__main__":
    main()

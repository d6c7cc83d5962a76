"""Paged attention on CPU, float32: the native kernel (gpu/kernels/native/csrc/attention.cpp) against the torch path's
padded segments (gpu/attention/torch_backend.py), one layer's call at SmolLM2-135M's shape (9 query heads over 3 KV
heads of 64, blocks of 16), in the same run. The torch path is planned once per shape, as a step plans once for all its
layers; only the call is timed.

    python scripts/bench_attention.py [--threads 2]

Prints each path's median time and the ratio torch / native (above 1: native is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from gpu.attention.metadata import AttentionMetadata
from gpu.attention.torch_backend import TorchAttention
from gpu.kernels import native

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16
CASES = {  # label: rows of (queries, keys)
    "decode, batch 1, 128 keys": [(1, 128)],
    "decode, batch 1, 1,024 keys": [(1, 1024)],
    "decode, batch 8, 1,024 keys": [(1, 1024)] * 8,
    "decode, batch 32, 256 keys": [(1, 256)] * 32,
    "decode, batch 32, 16-512 keys": [(1, 16 + 16 * i) for i in range(32)],
    "verify K=4, batch 8, 512 keys": [(5, 512)] * 8,
    "chunk of 8 at 1,024 keys": [(8, 1024)],
    "chunk of 16 at 1,024 keys": [(16, 1024)],
    "chunk of 64 at 1,024 keys": [(64, 1024)],
    "prefill 1 x 128": [(128, 128)],
    "prefill 4 x 128": [(128, 128)] * 4,
    "prefill 1 x 512": [(512, 512)],
    "chunk of 256 at 1,024 keys": [(256, 1024)],
}


def case_inputs(rows: list[tuple[int, int]], g: torch.Generator):
    need = [-(-k // BLOCK) for _, k in rows]
    k_cache = torch.randn(sum(need), BLOCK, KV_HEADS, DIM, generator=g)
    v_cache = torch.randn(k_cache.shape, generator=g)
    tables = np.zeros((len(rows), max(need)), np.int64)
    for r, n in enumerate(need):
        tables[r, :n] = np.arange(sum(need[:r]), sum(need[:r]) + n)
    query_lens, seq_lens = (np.array(x, np.int64) for x in zip(*rows, strict=True))
    qsl = np.concatenate([[0], np.cumsum(query_lens)])
    q = torch.randn(int(qsl[-1]), HEADS, DIM, generator=g)
    return q, (k_cache, v_cache), query_lens, seq_lens, qsl, tables


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(args: argparse.Namespace) -> None:
    ops = native.ops()
    if ops is None:
        raise SystemExit("the native kernels are not built for this CPU: make setup")
    torch.set_num_threads(args.threads)
    g, backend = torch.Generator().manual_seed(0), TorchAttention(torch.device("cpu"), torch.float32, BLOCK)
    print(f"{native.cpu_isas()[-1]} build, {args.threads} thread(s); ms per layer call, median of {args.repeats}")
    print(f"{'':32} {'torch':>8} {'native':>8} {'ratio':>6}  max |diff|")
    for label, rows in CASES.items():
        q, kv, query_lens, seq_lens, qsl, tables = case_inputs(rows, g)
        t = [torch.from_numpy(a) for a in (qsl, seq_lens, tables)]
        meta = AttentionMetadata(torch.empty(0), *t, int(query_lens.max()), int(seq_lens.max()))
        plans = backend.plan(query_lens, seq_lens, qsl, tables)
        backend.finish(meta, plans, [{k: torch.from_numpy(v) for k, v in p.arrays.items()} for p in plans])
        paths = {
            "torch": lambda q=q, kv=kv, meta=meta: backend(q, kv, meta, DIM**-0.5, None, None),
            "native": lambda q=q, kv=kv, t=t: ops.paged_attention(q, *kv, *t, DIM**-0.5, 0, 0.0),
        }
        ms = {name: median_ms(fn, args.repeats) for name, fn in paths.items()}
        diff = (paths["torch"]() - paths["native"]()).abs().max().item()
        print(f"{label:32} {ms['torch']:8.3f} {ms['native']:8.3f} {ms['torch'] / ms['native']:5.2f}x  {diff:.1e}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    main(ap.parse_args())

"""The native CPU linear kernels (gpu/kernels/native) against torch's two float32 paths (oneDNN's packed weight, and
`x @ W^T` from the [in, out] copy, the layouts Sluice held before its native kernels), on SmolLM2-135M's layer shapes, in the same run: one pass over
a layer of each shape (qkv, o, gate_up, down, the LM head: 31.9 M weights, 127 MB) per row count.

    python scripts/bench_native.py [--threads 1 2] [--rows 1 2 4 8 16 32 64 128 512]

Prints each path's median time and the native kernels' weight-read rate, also as a share of the machine's read
bandwidth (a plain read of as many bytes, measured first: `read_rate`); the ratio is torch's best over native's
(above 1: native is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gpu.kernels import native

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # [out, in]


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's layout of a float32 [out, in] weight, for `onednn_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def transposed_linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + bias from the [in, out] contiguous copy."""
    return x @ weight_t if bias is None else torch.addmm(bias, x, weight_t)


def main(args: argparse.Namespace) -> None:
    ops = native.ops()
    if ops is None:
        raise SystemExit("the native kernels are not built for this CPU: make setup")
    weights = [torch.randn(out, inp) for out, inp in SHAPES]
    packed = [(ops.pack(w), onednn_pack(w), w.t().contiguous()) for w in weights]
    size = sum(w.numel() for w in weights) * 4
    print(f"{native.cpu_isas()[-1]} build, {size / 1e6:.0f} MB of float32 weights")
    for threads in args.threads:
        torch.set_num_threads(threads)
        floor = read_rate(ops, size, threads, args.repeats)
        print(f"\n{threads} thread(s): a plain read of as many bytes {floor / 1e9:.1f} GB/s (native's % of it below)")
        for rows in args.rows:
            calls = [(p, w.shape[0], torch.randn(rows, w.shape[1])) for p, w in zip(packed, weights, strict=True)]
            paths = {
                "native": lambda calls=calls: [ops.linear(x, p[0], out, None) for p, out, x in calls],
                "oneDNN": lambda calls=calls: [onednn_linear(x, p[1], None) for p, _, x in calls],
                "x @ W^T": lambda calls=calls: [transposed_linear(x, p[2], None) for p, _, x in calls],
            }
            times = {}
            for name, run in paths.items():
                run()
                samples = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    run()
                    samples.append(time.perf_counter() - start)
                times[name] = statistics.median(samples)
            best = min(times["oneDNN"], times["x @ W^T"])
            cols = "  ".join(f"{name} {t * 1e3:7.2f} ms" for name, t in times.items())
            print(
                f"  rows {rows:4d}: {cols}  native {size / times['native'] / 1e9:5.1f} GB/s"
                f" ({size / times['native'] / floor:4.0%})  {best / times['native']:.2f}x"
            )


def read_rate(ops, size: int, threads: int, repeats: int) -> float:
    """The machine's read bandwidth, the floor a batch-1 GEMV can reach: bytes a second of the native row sum (one
    stream a thread, sixteen float lanes) over `size` bytes in the memory the kernels stream weights from, best of
    `repeats`."""
    x = ops.huge_copy(torch.ones(threads, size // 4 // threads))
    samples = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        ops.row_sum(x)
        samples.append(time.perf_counter() - start)
    return x.nbytes / min(samples[1:])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    parser.add_argument("--repeats", type=int, default=9)
    main(parser.parse_args())

"""Decode step time on one device: the dynamic (eager) path against CUDA graphs, with host launches and kernels per
step, the weight-read floor, and HF transformers' static-cache `generate` (compiled on CUDA) as the baseline measured
in the same run on the same device, model, batch and lengths.

    python scripts/bench_step.py [--model DIR] [--device cuda] [--dtype auto] [--batches 1 16 64] [--steps 32]
                                 [--prompt-len 128] [--no-hf] [--cpu-kernels torch|native] [--batch-invariant]
                                 [--attention-backend torch|triton|native] [--quantization q8_0|q4_0|q4_k] [--json FILE]
                                 [--python-loop]

For each batch B: B random prompts of --prompt-len tokens prefilled in one step, then --steps decode steps through
`ModelRunner.execute` (greedy ids fed back; each step synchronised, wall time; median). Modes: "eager" (the dynamic
path, `--enforce-eager`) and, on CUDA with the triton backend, "graphs" (decode steps replayed). Per step, from
torch.profiler over one more step: host launches (cudaLaunchKernel, cuLaunchKernel, cudaGraphLaunch calls) and
device kernels. Floor: the weights' bytes over the device's copy bandwidth (a 1 GiB device-to-device copy, read and
write counted), the time one step must take to read every weight once. HF: `generate(max_new_tokens=steps,
min_new_tokens=steps, cache_implementation="static")` on the same prompts (transformers compiles the forward for a
static cache on CUDA), run twice, the second timed; ms per token = time / steps (its prefill included).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from frontend.preflight import resolve_model
from gpu.batch import BatchSpec, ScheduledRow
from gpu.layers.linear import Linear
from gpu.loading.config import ModelConfig
from gpu.runner.model_runner import ModelRunner

BLOCK = 16
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy, read and write counted."""
    src = torch.empty(1 << 28, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    sync(device)
    return 2 * src.nbytes * 5 / (time.perf_counter() - start)


def counts(runner: ModelRunner, batch: BatchSpec) -> tuple[int, int]:
    """(host launches, device kernels) of one step, from the profiler."""
    from torch.profiler import DeviceType, ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.execute(batch)
        sync(runner.device)
    events = prof.events()
    launches = sum(e.name in LAUNCH_CALLS for e in events)
    return launches, sum(e.device_type == DeviceType.CUDA and e.name not in LAUNCH_CALLS for e in events)


def streamed_bytes(model: torch.nn.Module) -> int:
    """What a decode step reads at least: each linear layer's weight as held (blocks, panels or its parameter; the LM
    head's included, the embedding's looked-up rows not)."""
    held = (
        [b for *_, b in m.blocks] if m.blocks is not None else [m.weight if m.native is None else m.native]
        for m in model.modules()
        if isinstance(m, Linear)
    )
    return sum(t.nbytes for ts in held for t in ts)


def decode_steps(runner: ModelRunner, prompts: torch.Tensor, steps: int) -> tuple[float, list[float], BatchSpec]:
    """Prefill the prompts, then time `steps` greedy decode steps: the prefill's time and the steps' (s), and one
    more decode batch."""
    n, length = prompts.shape
    per_row = -(-(length + steps + 2) // BLOCK)
    tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(n)]
    rows = [ScheduledRow(f"r{i}", i, prompts[i].tolist(), 0, tables[i], True) for i in range(n)]
    sync(runner.device)
    start = time.perf_counter()
    tokens = runner.execute(BatchSpec(0, rows)).argmax(-1)
    sync(runner.device)
    prefill = time.perf_counter() - start

    def decode(step: int) -> BatchSpec:  # every row feeds its last sampled token at position length + step
        ids = tokens.tolist()
        return BatchSpec(
            step + 1, [ScheduledRow(f"r{i}", i, [ids[i]], length + step, tables[i], True) for i in range(n)]
        )

    times = []
    for step in range(steps + 1):
        batch = decode(step)
        sync(runner.device)
        start = time.perf_counter()
        tokens = runner.execute(batch).argmax(-1)
        sync(runner.device)
        times.append(time.perf_counter() - start)
    last = decode(steps + 1)
    return prefill, times[1:], last


def hf_ms_per_token(model_dir, device, dtype, prompts: torch.Tensor, steps: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    ids = prompts.to(device)
    kwargs = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, cache_implementation="static")
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        sync(device)
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        sync(device)
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="an HF-style directory (default: the bundled SmolLM2)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    ap.add_argument("--cpu-kernels", default=None, choices=["torch", "native"])
    ap.add_argument("--batch-invariant", action="store_true", help="the runner in batch-invariant mode")
    ap.add_argument("--attention-backend", default=None, choices=["torch", "triton", "native"])
    ap.add_argument("--quantization", default=None, choices=["q8_0", "q4_0", "q4_k"], help="CPU, at load")
    ap.add_argument("--python-loop", action="store_true", help="the Python layer loop, not the native one")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    model_dir = Path(args.model) if args.model else resolve_model(None).path
    device = torch.device(args.device)
    config = ModelConfig.from_path(model_dir).served(args.prompt_len + args.steps + 16)
    modes = ["eager", "graphs"] if device.type == "cuda" else ["eager"]
    bandwidth, results = copy_bandwidth(device), []
    g = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(3, config.vocab_size, (b, args.prompt_len), generator=g) for b in args.batches}
    biggest, per_row = max(args.batches), -(-(args.prompt_len + args.steps + 2) // BLOCK)
    for mode in modes:
        runner = ModelRunner(
            config, device, args.dtype, num_blocks=biggest * per_row, max_num_seqs=biggest,
            max_num_batched_tokens=biggest * args.prompt_len, decode_graphs="capture" if mode == "graphs" else "off",
            cpu_kernels=args.cpu_kernels, batch_invariant=args.batch_invariant,
            attention_backend=args.attention_backend, quantization=args.quantization,
        )  # fmt: skip
        activations = runner.dtype  # (HF's reference runs in it)
        if args.python_loop:  # (gpu/runner/native_loop.py)
            runner.model.model.native_loop = None
        weights = streamed_bytes(runner.model)
        for b in args.batches:
            prefill, times, last = decode_steps(runner, prompts[b], args.steps)
            launches, kernels = counts(runner, last) if device.type == "cuda" else (None, None)
            ms = statistics.median(times) * 1e3
            results.append(
                dict(mode=mode, batch=b, ms=ms, tok_s=b / ms * 1e3, launches=launches, kernels=kernels,
                     prefill_ms=prefill * 1e3)  # (the first batch's prefill includes warming up)
            )  # fmt: skip
            save(args.json, device, weights / bandwidth * 1e3, results)  # (so far: a timeout keeps what ran)
        runner.graphs = None  # (the graphs refer to the runner: freed with it, before the next mode's)
        del runner
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    floor_ms = weights / bandwidth * 1e3
    if not args.no_hf:
        for b in args.batches:
            ms = hf_ms_per_token(model_dir, device, activations, prompts[b], args.steps)
            results.append(dict(mode="hf-static", batch=b, ms=ms, tok_s=b / ms * 1e3, launches=None, kernels=None))
            save(args.json, device, floor_ms, results)
    name = device_name(device)
    print(f"{model_dir.name} on {name}, {args.dtype}; weights {weights / 1e6:.0f} MB, copy {bandwidth / 1e9:.0f} GB/s")
    print(f"floor (weights read once): {floor_ms:.3f} ms/step")
    print(
        f"{'mode':>10} {'batch':>5} {'ms/step':>8} {'tok/s':>9} {'x floor':>7} {'launches':>8} {'kernels':>7} prefill ms"
    )
    for r in results:
        extra = " ".join(f"{r[k] if r[k] is not None else '-':>8}" for k in ("launches", "kernels"))
        extra += f" {r['prefill_ms']:>10.1f}" if "prefill_ms" in r else ""
        print(f"{r['mode']:>10} {r['batch']:>5} {r['ms']:>8.2f} {r['tok_s']:>9.0f} {r['ms'] / floor_ms:>7.1f} {extra}")
    save(args.json, device, floor_ms, results)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def save(path: str | None, device: torch.device, floor_ms: float, results: list[dict]) -> None:
    if path:
        Path(path).write_text(
            json.dumps(dict(device=device_name(device), floor_ms=floor_ms, results=results), indent=2)
        )


if __name__ == "__main__":
    main()

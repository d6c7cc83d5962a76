"""Multi-LoRA throughput: output tokens/s of 16 concurrent greedy streams on SmolLM2-135M with LoRA adapters (rank 8
and 16 on all seven projections) spread over them, 1 / 4 / 16 adapters, divided by the base model alone in the same
run (issue 51's target: >= 0.8). The engine's step loop in this process (Scheduler + StepExecutor, no actors: the
serving overhead is the same with or without adapters), synchronous, each case on a fresh executor, measured
--repeats times against a base run just before it (the median ratio printed); the adapters are
random PEFT ones (PEFT builds and saves them), held as each `--lora-dtypes` says (auto: the float32 base's format).

    python scripts/bench_lora.py [--streams 16] [--tokens 64] [--threads 2] [--ranks 8 16] [--adapters 1 4 16]
                                 [--lora-dtypes auto bfloat16]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine.block_manager import BlockManager
from actors.engine.config import EngineConfig, LoraConfig, LoraModule
from actors.engine.executor import StepExecutor
from actors.engine.request import EngineRequest
from actors.engine.scheduler import Scheduler
from gpu.loading.config import ModelConfig
from gpu.loading.convert import default_model_dir
from gpu.loading.lora import adapter_digest
from gpu.sampling import SamplingRow
from messages.sampling_params import SamplingParams

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base: Path, root: Path, rank: int, n: int) -> list[LoraModule]:
    from peft import LoraConfig as PeftConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = get_peft_model(model, PeftConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
    out = []
    for i in range(n):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.02)
        model.save_pretrained(path := root / f"r{rank}-{i}")
        out.append(LoraModule(name=f"r{rank}-{i}", path=str(path), digest=adapter_digest(path)))
    return out


def run(
    model: ModelConfig, adapters: list[LoraModule], streams: int, tokens: int, threads: int, rank=16, dtype="auto"
) -> float:
    """Output tokens/s of `streams` greedy requests, round-robin over `adapters` (none: the base model)."""
    lora = (
        LoraConfig(modules=adapters, max_loras=len(adapters), max_lora_rank=rank, lora_dtype=dtype)
        if adapters
        else None
    )
    config = EngineConfig(model=str(model.path), max_num_seqs=streams, max_model_len=512, num_kv_blocks=512,
                          engine_threads=threads, lora=lora)  # fmt: skip
    executor = StepExecutor(config, model, config.num_kv_blocks)
    sched = Scheduler(BlockManager(512, config.block_size, False), streams, 2048, 512, model.eos_token_ids,
                      max_loras=lora and lora.max_loras)  # fmt: skip
    for i in range(streams):
        digest = adapters[i % len(adapters)].digest if adapters else None
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, lora=digest)
        sched.add_request(EngineRequest(str(i), list(range(100 + i, 132 + i)), params))
    start, emitted = time.perf_counter(), 0
    while sched.has_unfinished():
        batch = sched.schedule()
        reqs = [sched.requests[r.request_id] for r in batch.rows if r.sample]
        rows = [SamplingRow(q.params, q.prompt_token_ids, [], None, list(model.eos_token_ids)) for q in reqs]
        for out in sched.update(batch, executor.run(batch, rows).host()[0]):
            emitted += len(out.new_token_ids)
    return emitted / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--lora-dtypes", nargs="+", default=["auto"], choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=3, help="rounds, each case against the base measured just before it")
    args = p.parse_args()
    model = ModelConfig.from_path(default_model_dir())
    load = Path("/proc/loadavg").read_text().split()[0]
    print(f"SmolLM2-135M, {args.streams} streams x {args.tokens} tokens, {args.threads} threads, load {load}")
    ratios: dict[tuple, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        made = {rank: make_adapters(model.path, Path(tmp), rank, max(args.adapters)) for rank in args.ranks}
        for _ in range(args.repeats):  # (this VM's speed drifts by tens of percent over minutes: ratios to a neighbour)
            for rank, dtype, n in itertools.product(args.ranks, args.lora_dtypes, args.adapters):
                base = run(model, [], args.streams, args.tokens, args.threads)
                tps = run(model, made[rank][:n], args.streams, args.tokens, args.threads, rank, dtype)
                ratios.setdefault((rank, dtype, n), []).append(tps / base)
                print(f"rank {rank:3d}, {n:2d} adapters, {dtype:8s}: {tps:6.1f} tok/s, base {base:6.1f}", flush=True)
    print("median ratio to the base (range):")
    for (rank, dtype, n), got in ratios.items():
        print(
            f"rank {rank:3d}, {n:2d} adapters, {dtype:8s}: {statistics.median(got):.2f}x ({min(got):.2f}-{max(got):.2f})"
        )


if __name__ == "__main__":
    main()

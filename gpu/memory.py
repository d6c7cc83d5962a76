"""The KV cache sized to the device (`--gpu-memory-utilization`, vLLM's flag and meaning).

The engine may use `utilization` of the device's total memory. Everything in use on the device at the peak of a
worst-case step is subtracted (this process's weights, its activations, the CUDA context, and other processes'
memory: a second server on the card counts against the fraction), then a reserve for the CUDA graphs (their pool
holds about one decode step's activations at the largest capture size, measured the same way); what is left is KV
blocks, each with a paired block of every draft model's cache, whose weights are subtracted too (they load after
the profile).

The worst case is one step of `max_num_batched_tokens` tokens over as many rows as may sample (up to max_num_seqs),
with the LM head and float32 logits of every row. It runs on a scratch KV cache just large enough for it, before the
real one is allocated. `DeviceMemory` is where the numbers come from: CUDA's, or a fake in the tests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from gpu.batch import BatchSpec, ScheduledRow
from gpu.config import ModelConfig
from gpu.kv_cache import KVCache, bytes_per_block

if TYPE_CHECKING:
    from gpu.runner import ModelRunner

log = logging.getLogger("sluice.memory")


class DeviceMemory(Protocol):
    def info(self) -> tuple[int, int]:
        """(free, total) bytes of the device."""

    def reset_peak(self) -> None: ...

    def peak_growth(self) -> int:
        """Bytes this process's allocator held at its peak since reset_peak beyond what it holds now."""


class CudaMemory:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def info(self) -> tuple[int, int]:
        torch.cuda.synchronize(self.device)
        return torch.cuda.mem_get_info(self.device)

    def reset_peak(self) -> None:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_growth(self) -> int:
        return torch.cuda.max_memory_reserved(self.device) - torch.cuda.memory_reserved(self.device)


@dataclass(frozen=True)
class MemoryPlan:
    total: int  # the device's bytes
    used_at_peak: int  # in use on the device (every process) at the worst-case step's peak
    graphs: int  # reserved for the CUDA graphs' pool
    drafts: int  # draft models' weights, loaded after the profile
    per_block: int  # one KV block of the model's cache and of each draft's

    def blocks(self, utilization: float) -> int:
        """KV blocks that fit in `utilization` of the device; ValueError naming the shortfall when none do."""
        if not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
        budget = int(self.total * utilization) - self.used_at_peak - self.graphs - self.drafts
        if budget < self.per_block:
            gib = 1 << 30
            raise ValueError(
                f"no KV cache fits in gpu_memory_utilization {utilization} of {self.total / gib:.1f} GiB: "
                f"{self.used_at_peak / gib:.2f} GiB in use at the worst-case step, {self.graphs / gib:.2f} GiB for "
                f"CUDA graphs, {self.drafts / gib:.2f} GiB of draft weights; raise it or lower max_num_batched_tokens"
            )
        return budget // self.per_block


def weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    from gpu.models import REGISTRY

    with torch.device("meta"):
        model = REGISTRY[config.architecture](config)
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


def profile(runner: ModelRunner, memory: DeviceMemory, drafts: list[ModelConfig], graph_size: int) -> MemoryPlan:
    """Run the worst-case step (and, where graphs will be captured, a decode step of `graph_size` rows) on a scratch
    KV cache; the plan of what the device holds at its peak."""
    c, bs = runner.config, runner.block_size
    rows = max(1, min(runner.max_num_seqs, runner.max_num_batched_tokens))
    lens = [runner.max_num_batched_tokens // rows + (i < runner.max_num_batched_tokens % rows) for i in range(rows)]
    per_row = [-(-n // bs) for n in lens]
    scratch = KVCache(c, sum(per_row) + 1, bs, runner.dtype, runner.device)
    scratch_bytes = (sum(per_row) + 1) * bytes_per_block(c, bs, runner.dtype)
    kept, runner.kv_cache = runner.kv_cache, scratch
    starts = [sum(per_row[:i]) for i in range(rows)]
    batch = BatchSpec(
        0,
        [
            ScheduledRow(f"profile-{i}", i, [0] * n, 0, list(range(starts[i], starts[i] + per_row[i])), True)
            for i, n in enumerate(lens)
        ],
    )
    try:
        memory.reset_peak()
        runner.execute(batch)
        free, total = memory.info()
        used_at_peak = total - free + memory.peak_growth() - scratch_bytes  # (the real cache replaces the scratch)
        graphs = 0
        if graph_size:
            decode = BatchSpec(1, [ScheduledRow("graph", 0, [0], 0, [0], True)] * graph_size)
            memory.reset_peak()
            runner.execute(decode)
            graphs = memory.peak_growth()
    finally:
        runner.kv_cache = kept
        del scratch
    drafts_bytes = sum(weight_bytes(d, runner.dtype) for d in drafts)
    per_block = sum(bytes_per_block(m, bs, runner.dtype) for m in (c, *drafts))
    return MemoryPlan(total, used_at_peak, graphs, drafts_bytes, per_block)


def log_plan(plan: MemoryPlan, blocks: int, block_size: int, max_model_len: int) -> None:
    gib = 1 << 30
    log.info(
        "KV cache: %d blocks of %d tokens (%.2f GiB), max concurrency %.1f at %d tokens a request; the device: "
        "%.1f GiB, %.2f GiB in use at the worst-case step, %.2f GiB for CUDA graphs",
        blocks, block_size, blocks * plan.per_block / gib, blocks * block_size / max_model_len, max_model_len,
        plan.total / gib, plan.used_at_peak / gib, plan.graphs / gib,
    )  # fmt: skip

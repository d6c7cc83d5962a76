"""The KV cache sized to the device (`--gpu-memory-utilization`, vLLM's flag and meaning).

This engine may use `utilization` of the device's total memory; what other processes hold does not count against
it, but the device must have that much free when the engine starts (vLLM's check). From it are subtracted what this
engine holds at the peak of a worst-case step (weights, activations, the CUDA context's growth since the start),
a reserve for the CUDA graphs (the growth of a decode step of the largest capture size with every row at
max_model_len keys, as a captured step plans its attention, plus that of a step of the largest mixed graph's tokens:
the graphs share one pool, but its blocks of one family's sizes seldom serve the other's) and the weights of draft
models (they load after the profile); what is left is KV blocks, each with a paired block of every draft's cache.

The worst case is one step of `max_num_batched_tokens` tokens over as many rows as may sample (up to max_num_seqs),
with the LM head and float32 logits of every row. It runs on a scratch KV cache just large enough for it, before the
real one is allocated. Not profiled (left to the margin of 1 - utilization): the sampler's temporaries, prompt
logprobs' logits, a draft model's own activations and graphs. `DeviceMemory` is where the numbers come from: CUDA's,
or a fake in the tests.

`served_weight_bytes` is a floor of what a model's weights hold as they are served, from its config alone (a meta
model): what the launcher checks against the host's memory before any process starts (frontend/memory_check.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from gpu.attention.kv_cache import KVCache, bytes_per_block
from gpu.batch import BatchSpec, ScheduledRow
from gpu.loading.config import ModelConfig, weight_files
from gpu.runner.view import RunnerView

log = logging.getLogger("sluice.memory")


class DeviceMemory(Protocol):
    def info(self) -> tuple[int, int]:
        """(free, total) bytes of the device."""

    def reset_peak(self) -> None:
        """Release cached blocks and measure the peak from what is held now."""

    def peak_growth(self) -> int:
        """Bytes this process's allocator held at its peak since reset_peak beyond what it held then."""


class CudaMemory:
    def __init__(self, device: torch.device) -> None:
        self.device, self.base = device, 0

    def info(self) -> tuple[int, int]:
        torch.cuda.synchronize(self.device)
        return torch.cuda.mem_get_info(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = torch.cuda.memory_reserved(self.device)

    def peak_growth(self) -> int:
        return torch.cuda.max_memory_reserved(self.device) - self.base


@dataclass(frozen=True)
class MemoryPlan:
    total: int  # the device's bytes
    free_at_start: int  # free when the engine started (before its weights)
    used_at_peak: int  # held by this engine at the worst-case step's peak (its scratch cache not counted)
    graphs: int  # reserved for the CUDA graphs' pool
    drafts: int  # draft models' weights, loaded after the profile
    per_block: int  # one KV block of the model's cache and of each draft's

    def blocks(self, utilization: float) -> int:
        """KV blocks that fit in `utilization` of the device; ValueError naming the shortfall when none do."""
        if not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
        gib, requested = 1 << 30, int(self.total * utilization)
        if self.free_at_start < requested:
            raise ValueError(
                f"gpu_memory_utilization {utilization} asks for {requested / gib:.2f} GiB of the device's "
                f"{self.total / gib:.1f}, but only {self.free_at_start / gib:.2f} GiB were free at startup: lower it"
            )
        budget = requested - self.used_at_peak - self.graphs - self.drafts
        if budget < self.per_block:
            raise ValueError(
                f"no KV cache fits in gpu_memory_utilization {utilization} of {self.total / gib:.1f} GiB: "
                f"{self.used_at_peak / gib:.2f} GiB in use at the worst-case step, {self.graphs / gib:.2f} GiB for "
                f"CUDA graphs, {self.drafts / gib:.2f} GiB of draft weights; raise it or lower max_num_batched_tokens"
            )
        return budget // self.per_block


def _meta_model(config: ModelConfig) -> torch.nn.Module:
    from gpu.models import REGISTRY

    with torch.device("meta"):
        return REGISTRY[config.architecture](config)


def weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    return sum(p.numel() for p in _meta_model(config).parameters()) * dtype.itemsize


def served_weight_bytes(
    config: ModelConfig, dtype: torch.dtype, quantization: str | None, device: str, weights: torch.dtype | None = None
) -> int:
    """A floor of the bytes the weights hold as gpu/loading/weights.py's `load_model` serves them, activations in
    `dtype`: each linear layer's weight and the embedding table in `weights` (default `dtype`: the native panels' on
    CPU; a tied LM head's panels are the table, counted once), the rest in `dtype`; a GGUF's on CPU from its tensor
    table (block formats in their own bytes); with `quantization` (CPU) each matrix in the first of its block formats
    (gpu/layers/quant.py) whose blocks its input width is whole of, else in `weights`, an MoE layer's experts too.
    Nothing is held twice, not even while loading. (SmolLM2-135M: float32 513 MiB, bfloat16 257, q8_0 145.)"""
    from gguf import GGML_QUANT_SIZES

    from gpu.layers.linear import Linear
    from gpu.layers.moe import Experts
    from gpu.layers.quant import BLOCK_QUANTIZATIONS

    files = weight_files(config.path)
    if files[0].suffix == ".gguf" and device == "cpu" and not quantization:
        return _gguf_bytes(files, dtype, weights or dtype)
    model = _meta_model(config)
    model.tie_weights()
    held = weights or dtype

    def matrix(rows: int, cols: int) -> float:
        kinds = [GGML_QUANT_SIZES[k] for k in BLOCK_QUANTIZATIONS.get(quantization, ())]
        size = next((b / e for e, b in kinds if cols % e == 0), held.itemsize)
        return rows * cols * size

    total = sum(p.numel() for p in model.parameters())  # (a tied LM head is the embedding: counted once)
    linears = [m.weight for m in model.modules() if isinstance(m, Linear)]  # (the head's included)
    table = [] if config.tie_word_embeddings else [model.model.embed_tokens.weight]
    experts = [p.flatten(0, 1) for m in model.modules() if isinstance(m, Experts) for p in (m.gate, m.up, m.down)]
    matrices = [*linears, *table, *(experts if quantization else ())]  # (else the experts are dense in `dtype`)
    rest = total - sum(w.numel() for w in matrices)  # norms, biases, the router (and dense experts)
    return int(sum(matrix(*w.shape) for w in matrices)) + dtype.itemsize * rest


def _gguf_bytes(files: list, dtype: torch.dtype, weights: torch.dtype) -> int:
    """A GGUF's weights as the native kernels hold them, from its tensor table: a matrix in a block format they run
    in its own bytes, another matrix in `weights`, a layer's experts in their blocks where all three projections' are
    ones the kernels run (else dense in `dtype`, as gpu/loading/weights.py holds them), the rest (norms, biases) in
    `dtype`."""
    from gguf import GGML_QUANT_SIZES

    from gpu.layers.linear import BLOCK_FORMATS
    from gpu.loading.gguf_file import GGUFFile

    tables, meta = [], None
    for file in files:
        f = GGUFFile(file, meta=meta)
        meta = meta or f.meta
        tables += f.header.items()
    experts = {}  # layer -> whether its experts are held in their blocks
    for name, (kind, *_) in tables:
        if name.endswith("_exps.weight"):
            layer = name.split(".")[1]
            experts[layer] = experts.get(layer, True) and kind in BLOCK_FORMATS
    total = 0
    for name, (kind, shape, _) in tables:
        n = int(torch.Size(shape).numel())
        elems, size = GGML_QUANT_SIZES[kind]
        held = experts.get(name.split(".")[1], True) if name.endswith("_exps.weight") else len(shape) == 2
        if kind in BLOCK_FORMATS and held:
            total += n // elems * size
        else:
            total += n * (weights if len(shape) == 2 else dtype).itemsize
    return total


def profile(
    runner: RunnerView, memory: DeviceMemory, free_at_start: int, drafts: list[ModelConfig], graphs: tuple[int, int]
) -> MemoryPlan:
    """Run the worst-case step and a decode step at max_model_len keys on a scratch KV cache, and, where graphs will
    be captured (`graphs`: their largest decode and mixed sizes, else zeros), the decode step at the largest decode
    size and a step of the largest mixed size's tokens: the plan of what this engine holds at its peak."""
    graph_size, mixed_size = graphs
    c, bs = runner.config, runner.block_size
    rows = max(1, min(runner.max_num_seqs, runner.max_num_batched_tokens))
    lens = [runner.max_num_batched_tokens // rows + (i < runner.max_num_batched_tokens % rows) for i in range(rows)]
    per_row, width = [-(-n // bs) for n in lens], -(-c.max_model_len // bs)
    starts = [sum(per_row[:i]) for i in range(rows)]
    worst = BatchSpec(0, [
        ScheduledRow(f"profile-{i}", -1, [0] * n, 0, list(range(starts[i], starts[i] + per_row[i])), True)
        for i, n in enumerate(lens)
    ])  # fmt: skip
    longest = ScheduledRow("graph", -1, [0], c.max_model_len - 1, [0] * width, True)  # (one block read throughout)
    runner.kv_cache = KVCache(runner.kv_config, sum(per_row) + 1, bs, runner.dtype, runner.device)
    try:
        worst_growth = _growth(memory, runner, worst)
        decode_growth = _growth(memory, runner, BatchSpec(1, [longest] * (graph_size or rows)))
        mixed = ScheduledRow("mixed", -1, [0] * mixed_size, 0, list(range(-(-mixed_size // bs))), True)
        mixed_growth = _growth(memory, runner, BatchSpec(2, [mixed])) if mixed_size else 0
    finally:
        runner.kv_cache = None
        memory.reset_peak()  # (the scratch cache and the profile's activations go back to the device)
    free, total = memory.info()  # (after the steps: what they left loaded outside the allocator counts too)
    if graph_size:  # the graphs' one pool: both families' activations (a conservative sum); the LM head runs outside
        row_logits = c.vocab_size * (runner.dtype.itemsize + 4)
        peak, graphs = worst_growth, max(0, decode_growth - graph_size * row_logits) + max(0, mixed_growth - row_logits)
    else:  # decode steps run eagerly: theirs may be the peak (split-K scratch at max_model_len keys)
        peak, graphs = max(worst_growth, decode_growth), 0
    used_at_peak = free_at_start - free + peak
    drafts_bytes = sum(weight_bytes(d, runner.dtype) for d in drafts)
    per_block = sum(bytes_per_block(m, bs, runner.dtype) for m in (runner.kv_config, *drafts))
    return MemoryPlan(total, free_at_start, used_at_peak, graphs, drafts_bytes, per_block)


def _growth(memory: DeviceMemory, runner: RunnerView, batch: BatchSpec) -> int:
    memory.reset_peak()
    runner.execute(batch)
    return memory.peak_growth()


def log_plan(plan: MemoryPlan, blocks: int, block_size: int, max_model_len: int) -> None:
    gib = 1 << 30
    log.info(
        "KV cache: %d blocks of %d tokens (%.2f GiB), max concurrency %.1f at %d tokens a request; the device: "
        "%.1f GiB, %.2f GiB in use at the worst-case step, %.2f GiB for CUDA graphs",
        blocks, block_size, blocks * plan.per_block / gib, blocks * block_size / max_model_len, max_model_len,
        plan.total / gib, plan.used_at_peak / gib, plan.graphs / gib,
    )  # fmt: skip

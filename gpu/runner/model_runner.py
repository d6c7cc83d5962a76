"""The model runner: turns a BatchSpec into device tensors, runs one forward step, returns the sampling rows' logits.

Host-side arrays are built with numpy and copied to the device in one transfer (pinned, non-blocking on CUDA).
For async scheduling, last step's sampled ids live on the device in `prev_sampled` (indexed by the request's stable
slot); PLACEHOLDER input tokens are filled from it on the device, so the host never waits for them.
With LoRA on (`lora_slots` adapters at most, of `max_lora_rank`), the runner holds the adapters it was given
(`add_adapter`, by digest) and tells the layers each step which tokens run which (gpu/layers/lora.py): its rows' `lora`.
"""

from __future__ import annotations

import gc
from itertools import chain

import numpy as np
import torch

from gpu.attention.backend import BackendName, choose_attention_backend
from gpu.attention.kv_cache import KVCache
from gpu.attention.metadata import AttentionMetadata
from gpu.attention.torch_backend import TorchAttention
from gpu.batch import PLACEHOLDER, BatchSpec
from gpu.distributed.group import current
from gpu.kernels import native
from gpu.layers.lora import LoraSlots
from gpu.layers.parallel import local_config
from gpu.layers.quant import Quantization, check_invariant
from gpu.loading.config import ModelConfig
from gpu.loading.lora import lora_tables, targetable
from gpu.loading.weights import load_model
from gpu.runner.adapters import RunnerAdapters, lora_kernels
from gpu.runner.graphs import MAX_MIXED, GraphMode, StepGraphs, capture_sizes
from gpu.runner.memory import CudaMemory, DeviceMemory, log_plan, profile
from gpu.runner.native_loop import native_loop
from gpu.runner.slot_tables import SlotTables


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """The device, indexed on CUDA ("auto" and "cuda" mean the current one): the runner, its sampler and a draft
    model's runner resolve the same config to the same device."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtypes(
    dtype: str | torch.dtype, device: torch.device, checkpoint: torch.dtype, native_weights: bool
) -> tuple[torch.dtype, torch.dtype]:
    """(activations, weights) for `--dtype`. On CUDA both are `dtype` ("auto": bfloat16). On CPU with the native
    kernels (`native_weights`: `native_cpu_weights`) activations, the KV cache and every sum are float32 and `dtype`
    names the weights' format: "auto" keeps a bfloat16 or float16 checkpoint's 16 bits (half float32's memory and
    bytes streamed a token), else float32. On torch's CPU kernels both are `dtype` ("auto": float32)."""
    named = None
    if dtype != "auto":
        named = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
        if not isinstance(named, torch.dtype) or not named.is_floating_point:
            raise ValueError(f"unsupported dtype {dtype!r}")
    if device.type != "cpu":
        return (named or torch.bfloat16,) * 2
    if native_weights:
        sixteen = checkpoint if checkpoint in (torch.bfloat16, torch.float16) else torch.float32
        return torch.float32, named or sixteen
    return (named or torch.float32,) * 2


def native_cpu_weights(device: torch.device, cpu_kernels: str | None, load: bool = True) -> bool:
    """Whether the linear layers hold their weights in the native kernels' panels or blocks (activations float32): on
    CPU, unless --cpu-kernels torch, where the kernels are built (and, with `load`, load: a process that only sizes a
    cache passes False and leaves the library unloaded). (--quantization needs them: gpu/loading/weights.py.)"""
    built = native.ops() is not None if load else native.available()
    return device.type == "cpu" and cpu_kernels != "torch" and built


class ModelRunner(RunnerAdapters):
    def __init__(
        self,
        model_config: ModelConfig,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        num_blocks: int | None = 1024,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        num_threads: int | None = None,
        quantization: Quantization | None = None,
        attention_backend: BackendName | None = None,
        cpu_kernels: str | None = None,
        batch_invariant: bool = False,
        decode_graphs: GraphMode | None = None,
        gpu_memory_utilization: float = 0.9,
        drafts: tuple[ModelConfig, ...] = (),
        memory: DeviceMemory | None = None,
        lora_slots: int = 0,
        max_lora_rank: int = 16,
        lora_dtype: str = "auto",
    ) -> None:
        """num_blocks None: as many as fit in `gpu_memory_utilization` of the device, with a paired block for each
        of `drafts` (draft models loaded after this runner), measured by `memory` (CUDA's: gpu/runner/memory.py)."""
        if num_threads:
            torch.set_num_threads(num_threads)
        self.config = model_config
        self.kv_config = local_config(model_config, current())  # the heads this rank holds (tensor parallelism)
        self.device = resolve_device(device)
        native_weights = native_cpu_weights(self.device, "native" if batch_invariant else cpu_kernels)
        self.dtype, weight_dtype = resolve_dtypes(dtype, self.device, model_config.dtype, native_weights)
        if self.device.type == "cuda":
            # Bind the calling thread (the runner is built on the device thread that runs its steps) before anything
            # is made on the device: the current device is per thread, and each step's pinned copies and the event
            # the host waits on belong to the current one (with cuda:N unbound, cuda:0's stream).
            torch.cuda.set_device(self.device)
            # cuDNN's SDPA spent ~450 us of host time per call in bf16 (torch 2.11, H100, profiler): 35 % of a
            # launch-bound decode step's CPU time. The memory-efficient kernel takes our masks too.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.block_size, self.max_num_seqs, self.max_num_batched_tokens = (
            block_size,
            max_num_seqs,
            max_num_batched_tokens,
        )
        # chosen once (the layers call it; each step's metadata is what it needs: gpu/attention/backend.py), and
        # before the model is built, which imports triton (torch._dynamo): the triton backend on CPU sets its
        # interpreter switch first
        c = self.kv_config
        heads = (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        self.attention = choose_attention_backend(
            attention_backend, self.device, self.dtype, block_size, batch_invariant, heads
        )
        if batch_invariant and cpu_kernels == "torch":
            raise ValueError("batch-invariant mode runs the native kernels, not --cpu-kernels torch")
        if batch_invariant and (model_config.moe is not None or current().size > 1):  # (routing; all-reduce chunks)
            raise ValueError("batch-invariant mode runs dense models on one device (for now)")
        if lora_slots and batch_invariant and not native_weights:
            raise ValueError("batch-invariant LoRA runs on the native CPU kernels")
        if num_blocks is None:  # sized to the device: what it has free before this engine's weights
            if memory is None and self.device.type != "cuda":
                raise ValueError("a KV cache sized to the device needs a CUDA device: give num_blocks on CPU")
            memory = memory or CudaMemory(self.device)
            gc.collect()  # (what this process dropped, still cached, is free to this engine: as vLLM's snapshot)
            memory.reset_peak()
            free_at_start = memory.info()[0]
        kernels = "native" if batch_invariant else cpu_kernels
        self.model = load_model(
            model_config, self.device, self.dtype, quantization, self.attention, kernels, weight_dtype
        )
        if batch_invariant:
            check_invariant(self.model)
        tables = lora_tables(lora_dtype, weight_dtype)
        self.lora = LoraSlots(lora_slots, max_lora_rank, tables, self.device, lora_kernels(native_weights, self))
        if lora_slots and self.device.type == "cuda":  # (counted by the memory plan, captured in place by graphs)
            self.lora.reserve(self.model, targetable(self.model))
        self.model.model.native_loop = native_loop(self.model, self.attention, self.lora)
        host_plans = model_config.moe is not None or (lora_slots > 0 and self.lora.ops is None)
        mode = graph_mode(decode_graphs, self.device, self.attention, host_plans)
        self.prev_sampled = torch.zeros(max_num_seqs, dtype=torch.int64, device=self.device)
        self.tables = SlotTables(max_num_seqs)  # each slot's block table, as its rows left it
        self.graphs = self.kv_cache = None
        if num_blocks is None:
            largest = (
                capture_sizes(min(max_num_seqs, max_num_batched_tokens))[-1],
                min(MAX_MIXED, max_num_batched_tokens),
            )
            plan = profile(self, memory, free_at_start, list(drafts), largest if mode == "capture" else (0, 0))
            num_blocks = plan.blocks(gpu_memory_utilization)
            log_plan(plan, num_blocks, block_size, model_config.max_model_len)
        self.num_blocks = num_blocks  # the scheduler's; steps on static buffers (graphs.py) have their pad rows
        # write one block more
        self.kv_cache = KVCache(self.kv_config, num_blocks + (mode != "off"), block_size, self.dtype, self.device)
        self.graphs = StepGraphs(self, mode == "capture") if mode != "off" else None

    @torch.inference_mode()
    def set_prev_sampled(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Record the ids sampled for `slots` on the device; the next step's PLACEHOLDER inputs read them."""
        slots = slots.to(self.device, torch.int64, non_blocking=True)
        self.prev_sampled.index_copy_(0, slots, token_ids.to(self.device, torch.int64, non_blocking=True))

    @torch.inference_mode()
    def execute(self, batch: BatchSpec, states: bool = False) -> torch.Tensor | None:
        """Run one step (None on a tensor-parallel rank that does not sample: the logits are gathered on the first); float32 logits [num logit positions + num prompt targets, vocab]: each row's
        `num_logits` positions in batch order (1 + K for a row verifying K drafts, as many for its CFG companion),
        then, row by row, the first fed tokens of rows with prompt_targets (one per target). `states`: the last
        layer's hidden states of every fed token instead (a pooling model's step: gpu/runner/pooling.py)."""
        if not batch.rows:
            return torch.empty(0, self.config.vocab_size, device=self.device)
        n, num_tokens = len(batch.rows), batch.num_tokens
        if n > self.max_num_seqs or num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"step {batch.step}: {n} rows / {num_tokens} tokens exceed the runner's limits")
        key = self.graphs and not states and self.graphs.key_for(batch)
        if key:
            batch = self.graphs.pad(batch, key[1])
        host, plans, max_query_len, max_seq_len = self._prepare(batch)
        tensors = iter(self._upload([*host.values(), *(a for p in plans for a in p.arrays.values())]))
        t = {name: next(tensors) for name in host}
        uploaded = [{name: next(tensors) for name in p.arrays} for p in plans]
        if "placeholders" in t:
            t["input_ids"][t["placeholders"]] = self.prev_sampled[t["placeholder_slots"]]
        self.lora.tokens = t.get("lora_slots")
        self.lora.groups = [(int(key[5:]), None if rows.numel() == len(host["input_ids"]) else rows)
                            for key, rows in t.items() if key.startswith("lora:")]  # fmt: skip
        if key:
            return self.graphs.run(key, t, plans, uploaded)
        meta = AttentionMetadata(
            slot_mapping=t["slot_mapping"],
            query_start_loc=t["query_start_loc"],
            seq_lens=t["seq_lens"],
            block_tables=t["block_tables"],
            max_query_len=max_query_len,
            # a decode step's attention is planned for the longest servable row: split-K's layout is then the same
            # whatever the batch, and in a graph or out of one (gpu/runner/graphs.py)
            max_seq_len=max(self.config.max_model_len, max_seq_len) if max_query_len == 1 else max_seq_len,
        )
        self.attention.finish(meta, plans, uploaded)
        hidden = self.model(t["input_ids"], t["positions"], meta, self.kv_cache)
        return hidden if states else self.logits(hidden[t["logits_indices"]])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits of these hidden states (None on a rank that does not sample)."""
        logits = self.model.compute_logits(hidden)
        return None if logits is None else logits.float()

    def _prepare(self, batch: BatchSpec):
        rows, bs = batch.rows, self.block_size
        n, num_tokens = len(rows), batch.num_tokens
        query_lens = np.array([len(r.token_ids) for r in rows], np.int64)
        seq_lens = query_lens + np.array([r.num_computed for r in rows], np.int64)
        query_start_loc = np.zeros(n + 1, np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        token_row = np.repeat(np.arange(n), query_lens)
        positions = np.arange(num_tokens) - query_start_loc[token_row] + (seq_lens - query_lens)[token_row]
        block_tables, lens = self.tables.resolve(batch.step, rows)  # (the slots' kept blocks, and the rows')
        if (short := np.flatnonzero(lens * bs < seq_lens)).size:
            raise ValueError(f"step {batch.step}: block table of {rows[short[0]].request_id} does not cover "
                             f"{seq_lens[short[0]]} tokens")  # fmt: skip
        input_ids = np.fromiter(chain.from_iterable(r.token_ids for r in rows), np.int64, num_tokens)
        num_logits = np.array([r.num_logits for r in rows], np.int64)  # a sampling row's last 1 (+ K) positions
        offset = np.arange(num_logits.sum()) - np.repeat(np.cumsum(num_logits) - num_logits, num_logits)
        host = dict(
            input_ids=input_ids,
            positions=positions,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            slot_mapping=block_tables[token_row, positions // bs] * bs + positions % bs,
            block_tables=block_tables,
            logits_indices=np.repeat(query_start_loc[1:] - num_logits, num_logits) + offset,
        )
        targets = [(i, len(r.prompt_targets)) for i, r in enumerate(rows) if r.prompt_targets]
        if targets:
            extra = [np.arange(query_start_loc[i], query_start_loc[i] + k) for i, k in targets]
            host["logits_indices"] = np.concatenate([host["logits_indices"], *extra])
        if any(r.lora is not None for r in rows):  # each token's slot; each slot's tokens (the torch path's only)
            slots = [-1 if r.lora is None else self.lora.slot_of(r.lora) for r in rows]
            if None in slots:
                raise ValueError(f"step {batch.step}: no LoRA adapter {rows[slots.index(None)].lora} is held")
            host["lora_slots"] = np.array(slots, np.int64)[token_row]
            for s in dict.fromkeys(s for s in slots if s >= 0 and self.lora.ops is None):
                host[f"lora:{s}"] = np.flatnonzero(host["lora_slots"] == s)
        placeholders = np.flatnonzero(input_ids == PLACEHOLDER)
        if placeholders.size:
            host["placeholders"] = placeholders
            host["placeholder_slots"] = np.array([r.slot for r in rows], np.int64)[token_row[placeholders]]
        plans = self.attention.plan(query_lens, seq_lens, query_start_loc, block_tables)
        return host, plans, int(query_lens.max()), int(seq_lens.max())

    def _upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """One host→device copy for all step arrays; returns device views shaped like the inputs."""
        flat = torch.from_numpy(np.concatenate([a.ravel() for a in arrays]).astype(np.int64, copy=False))
        if self.device.type != "cpu":
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        views, offset = [], 0
        for a in arrays:
            views.append(flat[offset : offset + a.size].view(a.shape))
            offset += a.size
        return views


def graph_mode(mode: GraphMode | None, device: torch.device, attention, moe: bool = False) -> GraphMode:
    """The decode-step mode (gpu/runner/graphs.py): None is "capture" where graphs can be had (CUDA, a backend without
    host-side plans: triton, a dense model: MoE routing reads expert counts back to the host, as LoRA on torch's
    matmuls groups its tokens there (`moe`: either); one device: the collectives of a tensor-parallel step are not
    captured yet), else "off"."""
    capturable = device.type == "cuda" and not isinstance(attention, TorchAttention) and not moe and current().size == 1
    if mode is None:
        return "capture" if capturable else "off"
    if mode == "capture" and not capturable:
        raise ValueError(
            "CUDA graphs need a CUDA device, the triton attention backend, a dense (not MoE) model and one device"
        )
    return mode

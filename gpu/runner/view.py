"""What the runner's parts (graphs.py, memory.py) read of the ModelRunner (model_runner.py), as a Protocol: they are
handed the runner itself, and typing it here keeps their imports pointing down (model_runner.py imports them)."""

from __future__ import annotations

from typing import Protocol

import torch

from gpu.attention.backend import AttentionBackend
from gpu.attention.kv_cache import KVCache
from gpu.batch import BatchSpec
from gpu.loading.config import ModelConfig


class RunnerView(Protocol):
    config: ModelConfig
    kv_config: ModelConfig  # the heads this rank holds
    device: torch.device
    dtype: torch.dtype
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    attention: AttentionBackend
    model: torch.nn.Module
    kv_cache: KVCache | None
    lora: object  # the model's LoRA slot tables (gpu/layers/lora.py LoraSlots)

    def execute(self, batch: BatchSpec) -> torch.Tensor | None: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None: ...

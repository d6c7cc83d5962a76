"""The paged KV cache: per layer, K and V tensors shaped (num_blocks, block_size, num_kv_heads, head_dim).

A token's cache slot is `block_id * block_size + offset`; the scheduler's block manager owns the block ids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # gpu.config imports gpu.layers, whose kernels write through this module
    from gpu.config import ModelConfig


class KVCache:
    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        # Zeros, not empty: padded attention reads unused slots under a mask, and NaN garbage would poison it.
        self.layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_hidden_layers)
        ]


def write_kv(kv: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor):
    """Store new keys/values [num_tokens, num_kv_heads, head_dim] at their slots."""
    k_cache, v_cache = kv
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype.itemsize
    return block_size * per_token


def num_blocks_for_memory(
    config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int, *paired: ModelConfig
) -> int:
    """How many KV blocks fit in `budget_bytes`, each with a block of each `paired` model's cache (a draft model's)."""
    per_block = sum(bytes_per_block(c, block_size, dtype) for c in (config, *paired))
    return max(0, budget_bytes // per_block)

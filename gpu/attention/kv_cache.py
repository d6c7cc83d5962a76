"""The paged KV cache: per layer, K and V tensors shaped (num_blocks, block_size, num_kv_heads, head_dim).

A token's cache slot is `block_id * block_size + offset`; the scheduler's block manager owns the block ids.
"""

from __future__ import annotations

import math
import mmap
from typing import Protocol

import torch


class KVShape(Protocol):
    """What the cache reads of a model's config (gpu/loading/config.py's ModelConfig; a draft model's too)."""

    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int


class KVCache:
    def __init__(
        self, config: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        # Zeros, not empty: padded attention reads unused slots under a mask, and NaN garbage would poison it.
        self.layers = [
            (zeros(shape, dtype, device), zeros(shape, dtype, device)) for _ in range(config.num_hidden_layers)
        ]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros; on the host an anonymous mapping, whose pages the kernel zeroes as they are first written (a
    start does not write the whole cache: 0.2 s of the bundled model's). Its bytes are counted as a cache's are (the
    memory check and the block count), though the process's resident size grows only as blocks are used."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, math.prod(shape) * dtype.itemsize), dtype=dtype).view(shape)


def bytes_per_block(config: KVShape, block_size: int, dtype: torch.dtype) -> int:
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype.itemsize
    return block_size * per_token


def num_blocks_for_memory(
    config: KVShape, block_size: int, dtype: torch.dtype, budget_bytes: int, *paired: KVShape
) -> int:
    """How many KV blocks fit in `budget_bytes`, each with a block of each `paired` model's cache (a draft model's)."""
    per_block = sum(bytes_per_block(c, block_size, dtype) for c in (config, *paired))
    return max(0, budget_bytes // per_block)

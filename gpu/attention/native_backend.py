"""The native attention backend (CPU, float32): gpu/kernels/native's paged attention kernel
(gpu/kernels/native/csrc/attention.cpp) reads each row's keys and values in place through its block table, one query
token at a time, in a fixed order, so a token's result is the same bits in any batch.

It takes the rows of at most SHORT_ROW queries (decode, speculative verification, short chunks), where it is 1.05-6.6x
the torch path's speed (no gather, no padding to the longest row); longer rows (prefills) go to the torch path's padded
segments, whose blocked SDPA is up to 1.7x faster there at long contexts (docs/performance-history.md, "Native paged
attention, and the native kernels by default (issue 36, third part)"). In batch-invariant mode (`invariant`) it takes
every row, so that a token's result cannot depend on the path its row was sent down. Its kernel set is the native one
(gpu/kernels/native/kernels.py): RMSNorm, rotary + cache write and act-and-mul as one native op each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu.attention.metadata import AttentionMetadata, plan_segments
from gpu.attention.torch_backend import TorchAttention, paged_attention
from gpu.kernels.native.kernels import NativeKernels

MAX_GROUP, MAX_HEAD_DIM = 16, 256  # the kernel's limits: query heads a KV head, head dim (attention.cpp)
SHORT_ROW = 8  # queries: the native kernel's rows (measured at 1,024 keys: 1.05x torch's at 8 queries, 0.72x at 16)


@dataclass
class NativePlan:
    """Host side of the native kernel's rows: their own query_start_loc, seq_lens and block tables and their tokens'
    indices in the step (`arrays`), or nothing where they are every row of the step (`whole`: the step's own)."""

    whole: bool
    arrays: dict[str, np.ndarray]


class NativeAttention(TorchAttention):
    def __init__(self, ops, block_size: int, invariant: bool = False) -> None:
        super().__init__(torch.device("cpu"), torch.float32, block_size)
        self.ops, self.short_row = ops, None if invariant else SHORT_ROW
        self.kernels = NativeKernels(ops)

    @staticmethod
    def holds(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        return (
            num_kv_heads > 0
            and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUP
            and (0 < head_dim <= MAX_HEAD_DIM)
        )

    def plan(self, query_lens, seq_lens, query_start_loc, block_tables) -> list:
        native = np.ones_like(query_lens, bool) if self.short_row is None else query_lens <= self.short_row
        if native.all():
            return [NativePlan(True, {})]
        plans = plan_segments(query_lens, seq_lens, query_start_loc, block_tables, self.block_size, only=~native)
        if not native.any():
            return plans
        rows = np.flatnonzero(native)
        qsl = np.zeros(rows.size + 1, np.int64)
        np.cumsum(query_lens[rows], out=qsl[1:])
        tokens = np.repeat(query_start_loc[rows] - qsl[:-1], query_lens[rows]) + np.arange(qsl[-1])
        arrays = dict(qsl=qsl, seq_lens=seq_lens[rows], tables=block_tables[rows], tokens=tokens)
        return [NativePlan(False, arrays), *plans]

    def finish(self, meta: AttentionMetadata, plans: list, uploaded: list[dict[str, torch.Tensor]]) -> None:
        if plans and isinstance(plans[0], NativePlan):
            own = dict(qsl=meta.query_start_loc, seq_lens=meta.seq_lens, tables=meta.block_tables)
            meta.native = own if plans[0].whole else uploaded[0]
            plans, uploaded = plans[1:], uploaded[1:]
        super().finish(meta, plans, uploaded)

    @staticmethod
    def takes_every_row(meta: AttentionMetadata) -> bool:
        """Whether the native kernel takes every row of this step (its metadata is the step's own)."""
        return meta.native is not None and "tokens" not in meta.native

    def __call__(self, q, kv, meta: AttentionMetadata, scale: float, window: int | None, softcap: float | None):
        n = meta.native
        if n is None:  # no row of this step is short
            return paged_attention(q, kv, meta, scale, window, softcap)
        args = (scale, window or 0, softcap or 0.0)
        if self.takes_every_row(meta):
            return self.ops.paged_attention(q, *kv, n["qsl"], n["seq_lens"], n["tables"], *args)
        out = paged_attention(q, kv, meta, scale, window, softcap)  # (the long rows')
        out[n["tokens"]] = self.ops.paged_attention(q[n["tokens"]], *kv, n["qsl"], n["seq_lens"], n["tables"], *args)
        return out

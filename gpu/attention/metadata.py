"""The step's attention metadata, shared by every backend: the common tensors (slot mapping, query start offsets, key
counts, block tables) and the torch path's segment plans.

Rows are grouped into segments (decode rows, longer rows), each padded to its longest row: `plan_segments` builds the
host side (numpy arrays uploaded with the step's own), `Segment.from_plan` the device side. A row padded to the
segment's longest reads its own last key's slot at each padding key, never a slot it does not hold (past its keys in
its last block; block 0 in its table's padding, which may be another request's): masked weights are exact zeros, but
0 * NaN is NaN, so a non-finite value there would reach the row. (A key of the row's own that the mask hides from
some of its queries, later in a prefill's chunk or past a window, is still read: a non-finite one reaches those
queries of that request.) Imports nothing of gpu/.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class SegmentPlan:
    """Host side of a segment: rows attended together, padded to `max_q` queries and `max_k` keys."""

    num_rows: int
    max_q: int
    max_k: int
    masked: bool
    arrays: dict[str, np.ndarray]  # q_gather, out_index, pad_index, kv_slots, ctx_lens


@dataclass
class Segment:
    max_q: int
    # None when the segment is the whole batch with one query per row (pure decode): queries need no gather/scatter
    q_gather: torch.Tensor | None  # [rows, max_q] token index of each padded query (padding repeats the last token)
    out_index: torch.Tensor | None  # [n] token index of each real query ...
    pad_index: torch.Tensor | None  # [n] ... and its flat padded position
    kv_slots: torch.Tensor  # [rows, max_k] cache slot of each key (padding repeats the row's last key's: masked)
    mask: torch.Tensor | None  # [rows, 1, max_q, max_k] key j visible to query i iff j <= ctx_len + i
    ctx_lens: torch.Tensor  # [rows] keys before each row's first query
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> mask, built on first use

    @classmethod
    def from_plan(cls, plan: SegmentPlan, t: dict[str, torch.Tensor]) -> Segment:
        seg = cls(
            plan.max_q, t.get("q_gather"), t.get("out_index"), t.get("pad_index"), t["kv_slots"], None, t["ctx_lens"]
        )
        if plan.masked:
            seg.mask = (seg.keys() <= seg.last_key()).unsqueeze(1)
        return seg

    def keys(self) -> torch.Tensor:
        return torch.arange(self.kv_slots.shape[1], device=self.ctx_lens.device)

    def last_key(self) -> torch.Tensor:
        """[rows, max_q, 1] the position of each padded query (ctx_len + i)."""
        return (self.ctx_lens[:, None] + torch.arange(self.max_q, device=self.ctx_lens.device))[..., None]

    def mask_for(self, window: int | None) -> torch.Tensor | None:
        """The causal mask, narrowed to the last `window` keys of each query where any key falls outside it."""
        if window is None or window >= self.kv_slots.shape[1]:  # every key is within the window of every query
            return self.mask
        if window not in self.windowed:
            keys, last = self.keys(), self.last_key()
            self.windowed[window] = ((keys <= last) & (keys > last - window)).unsqueeze(1)
        return self.windowed[window]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]
    query_start_loc: torch.Tensor  # [rows + 1]
    seq_lens: torch.Tensor  # [rows]
    block_tables: torch.Tensor  # [rows, max_blocks]
    max_query_len: int
    max_seq_len: int
    segments: list[Segment] = field(default_factory=list)  # torch path
    native: dict[str, torch.Tensor] | None = None  # the native backend's rows (gpu/attention/native_backend.py)
    cu_seqlens_k: torch.Tensor | None = None  # flash-attn path


def plan_segments(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    query_start_loc: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
    only: np.ndarray | None = None,
) -> list[SegmentPlan]:
    """Decode rows (one query) and longer rows go in separate segments, so decodes are not padded to a prefill. A row
    with no keys (nor queries: a padded batch's) is in none: it has nothing to attend, and no last key to pad with.
    only: the rows to plan (a mask; default every row: the native backend takes the others)."""
    decode, keyed = query_lens == 1, seq_lens > 0
    only = keyed if only is None else only & keyed
    groups = (np.flatnonzero(decode & only), np.flatnonzero(~decode & only))
    return [
        _plan(rows, query_lens, seq_lens, query_start_loc, block_tables, block_size) for rows in groups if rows.size
    ]


def _plan(rows, query_lens, seq_lens, query_start_loc, block_tables, block_size) -> SegmentPlan:
    q, k = query_lens[rows], seq_lens[rows]
    max_q, max_k = int(q.max()), int(k.max())
    i, j = np.arange(max_q), np.arange(max_k)
    real = i < q[:, None]
    q_gather = query_start_loc[rows, None] + np.minimum(i, q[:, None] - 1)
    kv_slots = block_tables[rows][:, j // block_size] * block_size + j % block_size
    # a row's padding keys (masked) read its last key's slot, never one it does not hold: past its keys in its last
    # block, or block 0 where its table is padded, which may be another request's (a NaN there would reach the row)
    np.copyto(kv_slots, kv_slots[np.arange(len(rows)), k - 1][:, None], where=j >= k[:, None])
    arrays = dict(kv_slots=kv_slots, ctx_lens=k - q)
    if max_q > 1 or len(rows) < len(query_lens):
        arrays.update(q_gather=q_gather, out_index=q_gather[real], pad_index=np.flatnonzero(real))
    masked = max_q > 1 or bool((k != max_k).any())
    return SegmentPlan(len(rows), max_q, max_k, masked, arrays)

"""The torch attention backend (CPU, and CUDA without flash-attn): the reference every other backend is tested
against.

Each segment of the step's metadata (gpu/attention/metadata.py) gathers its rows' keys through their block tables and
is one padded `scaled_dot_product_attention` call with an explicit bottom-right causal mask (`is_causal=True` is
top-left aligned, wrong when a query is shorter than its keys). On CUDA with flash-attn installed and blocks of a
multiple of 256 tokens, its paged varlen kernel is used.

Per layer: a sliding window (query at position p sees keys p - window < j <= p, HF's rule; the mask for each window
is built once per step and shared by the layers that use it) and a logit soft-cap (scores = cap * tanh(scores /
cap) before the mask: Gemma 2; the torch path then computes attention itself, as HF's eager path, since SDPA has
no soft-cap).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu.attention.metadata import AttentionMetadata, Segment, SegmentPlan, plan_segments
from gpu.kernels.reference import TORCH_KERNELS

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None


def use_flash_attn(device: torch.device, dtype: torch.dtype, block_size: int) -> bool:
    usable_dtype = dtype in (torch.float16, torch.bfloat16)
    return flash_attn_varlen_func is not None and device.type == "cuda" and usable_dtype and block_size % 256 == 0


class TorchAttention:
    """The torch backend: the reference every other backend is tested against."""

    kernels = TORCH_KERNELS

    def __init__(self, device: torch.device, dtype: torch.dtype, block_size: int) -> None:
        self.block_size, self.flash = block_size, use_flash_attn(device, dtype, block_size)

    def plan(self, query_lens, seq_lens, query_start_loc, block_tables) -> list[SegmentPlan]:
        if self.flash:
            return []
        return plan_segments(query_lens, seq_lens, query_start_loc, block_tables, self.block_size)

    def finish(self, meta: AttentionMetadata, plans: list[SegmentPlan], uploaded: list[dict[str, torch.Tensor]]):
        if self.flash:  # flash-attn wants int32 metadata
            meta.query_start_loc, meta.block_tables = meta.query_start_loc.int(), meta.block_tables.int()
            meta.cu_seqlens_k = F.pad(meta.seq_lens.cumsum(0), (1, 0)).int()
        meta.segments = [Segment.from_plan(p, t) for p, t in zip(plans, uploaded, strict=True)]

    def __call__(self, q, kv, meta: AttentionMetadata, scale: float, window: int | None, softcap: float | None):
        return paged_attention(q, kv, meta, scale, window, softcap)


def gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [num_slots, heads, dim] rows at slots [rows, keys] -> [rows, keys, heads, dim]. index_select on the
    flattened slots: ~9x faster on CPU than advanced indexing with the 2-D tensor (measured: 16 rows x 192 keys,
    111 vs 1029 us), which was a quarter of a batch-16 decode step at those lengths."""
    return cache.index_select(0, slots.flatten()).view(*slots.shape, *cache.shape[1:])


def paged_attention(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim], with this step's keys/values already written to `kv`. Same shape out
    (the tokens of no segment left unwritten: the native backend's)."""
    k_cache, v_cache = kv
    if meta.cu_seqlens_k is not None:
        return flash_attn_varlen_func(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.query_start_loc,
            cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale,
            causal=True,  # bottom-right aligned in flash-attn >= 2.1
            window_size=(-1 if window is None else window - 1, 0),
            softcap=softcap or 0.0,
            block_table=meta.block_tables,
        )
    keys, values = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    out = torch.empty_like(q)
    for s in meta.segments:
        ks, vs = (gather(cache, s.kv_slots).transpose(1, 2) for cache in (keys, values))
        mask = s.mask_for(window)
        if s.q_gather is None:  # the only segment: token i is row i's one query
            return _attend(q[:, :, None], ks, vs, mask, scale, softcap).squeeze(2)
        qs = q[s.q_gather].transpose(1, 2)  # [rows, heads, max_q, head_dim]
        out[s.out_index] = _attend(qs, ks, vs, mask, scale, softcap).transpose(1, 2).flatten(0, 1)[s.pad_index]
    return out


def _attend(q, k, v, mask: torch.Tensor | None, scale: float, softcap: float | None) -> torch.Tensor:
    """[rows, heads, q, d] queries over [rows, kv_heads, k, d] keys and values."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    rows, heads, num_q, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads  # a KV head's query heads, stacked along the queries: no copy of K and V per head
    scores = torch.tanh((q.reshape(rows, kv_heads, group * num_q, dim) @ k.transpose(-1, -2)) * (scale / softcap))
    scores = scores.view(rows, kv_heads, group, num_q, -1) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype).view(rows, kv_heads, group * num_q, -1)
    return (probs @ v).view(rows, heads, num_q, dim)

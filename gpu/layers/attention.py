"""Self-attention over the paged KV cache, with every family's quirks as parameters: q/k/v and o biases, per-head
q/k RMSNorm before rotary (Qwen3, Gemma 3), a sliding window, a logit soft-cap and a query scale (Gemma). The
attention over the cache is `attend`, the backend the runner chose at load (gpu/attention/backend.py; the torch path
until then); rotary and the cache write are one step of the layer's kernel set (gpu/kernels/reference.py).

q, k and v are three weights in most checkpoints, one `qkv_proj` with [q; k; v] rows in Phi-3's
(`FusedQKVAttention`); the layer holds one qkv_proj either way (the loader writes the three into its rows,
gpu/loading/weights.py): one GEMM. Under tensor parallelism a rank
holds its query heads and their KV heads (gpu/layers/parallel.py) and all-reduces o_proj's output."""

from __future__ import annotations

import torch
from torch import nn

from gpu.attention.metadata import AttentionMetadata
from gpu.attention.torch_backend import paged_attention
from gpu.distributed.group import current
from gpu.kernels.reference import TORCH_KERNELS
from gpu.layers.linear import Linear
from gpu.layers.norm import RMSNorm
from gpu.layers.parallel import column, heads, row, stacked


class Attention(nn.Module):
    kernels = TORCH_KERNELS

    def __init__(self, c, layer: int, norm_offset: float = 0.0) -> None:
        super().__init__()
        self.tp, d = current(), c.head_dim
        h = heads(c.num_attention_heads, c.num_key_value_heads, self.tp)
        self.num_heads, self.num_kv_heads, self.head_dim = h.num_q, h.num_kv, d
        # this rank's rows of q, k and v in their checkpoint tensors, and those tensors' sizes
        self.ranges = [(h.q * d, h.num_q * d), *[(h.kv * d, h.num_kv * d)] * 2]
        self.full = [c.num_attention_heads * d, *[c.num_key_value_heads * d] * 2]
        self.scale = c.attn_scale or c.head_dim**-0.5
        self.window = c.layer_windows[layer] if c.layer_windows else None
        self.softcap = c.attn_softcap
        self.attend = paged_attention
        self.sizes = [n for _, n in self.ranges]
        self.make_projections(c)
        o_proj = Linear(self.num_heads * d, c.hidden_size, bias=c.o_bias)
        self.o_proj = row(o_proj, self.ranges[:1], self.full[0], self.tp)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, norm_offset)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, norm_offset)

    def make_projections(self, c) -> None:
        parts = [([r], full) for r, full in zip(self.ranges, self.full, strict=True)]
        self.qkv_proj = stacked(Linear(c.hidden_size, sum(self.sizes), bias=c.qkv_bias), parts)

    def forward(self, x, rope, meta: AttentionMetadata, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (t.view(n, -1, self.head_dim) for t in self.qkv_proj(x).split(self.sizes, dim=-1))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.kernels.rope_and_write_kv(q, k, v, *rope, kv, meta.slot_mapping)
        out = self.attend(q, kv, meta, self.scale, self.window, self.softcap)
        return self.tp.all_reduce(self.o_proj(out.flatten(1)))


class FusedQKVAttention(Attention):
    def make_projections(self, c) -> None:
        offsets = [0, self.full[0], self.full[0] + self.full[1]]  # [q; k; v] rows
        ranges = [(offset + start, n) for offset, (start, n) in zip(offsets, self.ranges, strict=True)]
        self.qkv_proj = column(Linear(c.hidden_size, sum(self.sizes), bias=c.qkv_bias), ranges, sum(self.full))

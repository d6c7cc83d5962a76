"""Self-attention over the paged KV cache, with every family's quirks as parameters: q/k/v and o biases, per-head
q/k RMSNorm before rotary (Qwen3, Gemma 3), a sliding window, a logit soft-cap and a query scale (Gemma). The
attention over the cache is `attend`, the backend the runner chose at load (gpu/attention_backend.py; the torch path
until then); rotary and the cache write are one step of the layer's kernel set (gpu/layers/kernels.py).

q, k and v are three weights in most checkpoints, one `qkv_proj` with [q; k; v] rows in Phi-3's
(`FusedQKVAttention`); `fuse()` stacks them at load (gpu/weights.py): one GEMM."""

from __future__ import annotations

import torch
from torch import nn

from gpu.attention import AttentionMetadata, paged_attention
from gpu.layers.kernels import TORCH_KERNELS
from gpu.layers.mlp import stack_linears
from gpu.layers.norm import RMSNorm
from gpu.linear import Linear


class Attention(nn.Module):
    kernels = TORCH_KERNELS

    def __init__(self, c, layer: int, norm_offset: float = 0.0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.scale = c.attn_scale or c.head_dim**-0.5
        self.window = c.layer_windows[layer] if c.layer_windows else None
        self.softcap = c.attn_softcap
        self.attend = paged_attention
        self.sizes = [self.num_heads * c.head_dim, *[self.num_kv_heads * c.head_dim] * 2]
        self.make_projections(c)
        self.o_proj = Linear(self.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, norm_offset)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, norm_offset)

    def make_projections(self, c) -> None:
        self.q_proj, self.k_proj, self.v_proj = (Linear(c.hidden_size, n, bias=c.qkv_bias) for n in self.sizes)

    def fuse(self) -> None:
        """Stack the loaded q, k and v weights into one qkv_proj."""
        if not hasattr(self, "qkv_proj"):
            self.qkv_proj = stack_linears(self.q_proj, self.k_proj, self.v_proj)
            del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, rope, meta: AttentionMetadata, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (t.view(n, -1, self.head_dim) for t in self.qkv_proj(x).split(self.sizes, dim=-1))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.kernels.rope_and_write_kv(q, k, v, *rope, kv, meta.slot_mapping)
        out = self.attend(q, kv, meta, self.scale, self.window, self.softcap)
        return self.o_proj(out.flatten(1))


class FusedQKVAttention(Attention):
    def make_projections(self, c) -> None:
        self.qkv_proj = Linear(c.hidden_size, sum(self.sizes), bias=c.qkv_bias)

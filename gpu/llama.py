"""A plain-torch Llama-block causal LM (Llama, SmolLM, Mistral, Qwen2) over a flat token batch.

Tokens of all rows are concatenated ([num_tokens, hidden]); rows only meet in attention, through the paged KV cache
and the AttentionMetadata. Module names mirror the HF checkpoints, so weights load by name.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gpu.attention import AttentionMetadata, paged_attention
from gpu.config import ModelConfig
from gpu.kv_cache import KVCache, write_kv
from gpu.linear import Linear


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised in float32, scaled in the model's dtype (as HF); float32 input is one fused op."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class RotaryEmbedding:
    """cos/sin for each token's position (half-split rotation, as in HF checkpoints); computed in float32."""

    def __init__(self, config: ModelConfig) -> None:
        dim = config.head_dim
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
        self.inv_freq = _scale_inv_freq(inv_freq, config.rope_scaling)

    def to(self, device: torch.device) -> None:
        """Move the frequencies to the model's device once, at load (a lazy move would block the first step)."""
        self.inv_freq = self.inv_freq.to(device)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and the sign-folded sin (-sin on the first half: see apply_rope), [num_tokens, 1, head_dim]."""
        freqs = positions.float()[:, None] * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), -1)[:, None].to(dtype), torch.cat((-sin, sin), -1)[:, None].to(dtype)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type != "llama3":
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1) as the halves swapped times the
    sign-folded sin: three kernels instead of five."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return torch.addcmul(x * cos, swapped, sin)


class LlamaAttention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.scale = c.head_dim**-0.5
        self.q_proj = Linear(c.hidden_size, self.num_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = Linear(c.hidden_size, self.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = Linear(c.hidden_size, self.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = Linear(self.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        n = x.shape[0]
        q = apply_rope(self.q_proj(x).view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        write_kv(kv, k, v, meta.slot_mapping)
        return self.o_proj(paged_attention(q, kv, meta, self.scale).flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(c)
        self.mlp = LlamaMLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = RotaryEmbedding(c)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer, kv in zip(self.layers, kv_cache.layers, strict=True):
            x = layer(x, cos, sin, meta, kv)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share embed_tokens with lm_head if the config says so (again after any tensor conversion)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a flat batch; writes this step's K/V into `kv_cache`."""
        return self.model(input_ids, positions, meta, kv_cache)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

"""Rotary position embeddings: the scalings HF checkpoints use, over the whole head or its first `rotary_dim` dims.

Frequencies are computed once, on the host in float32, from (theta, scaling, rotary_dim); `attention_factor`
(yarn, longrope) scales cos and sin. Scalings whose HF form depends on the current sequence length (longrope's
short/long factors, dynamic NTK) are fixed here once from the served `max_len`, so a request's keys never mix two
rotations and a row's result does not depend on the batch around it (vLLM decides longrope the same way):
- longrope: the long factors iff max_len > original_max_position_embeddings (HF switches per forward call: equal
  to ours whenever every sequence is on the same side of that length);
- dynamic: NTK-scaled to max_len when it passes max_position_embeddings, else the default.

| rope_type | inv_freq                                                               | attention factor           |
|-----------|------------------------------------------------------------------------|----------------------------|
| default   | theta^(-2i/d)                                                          | 1                          |
| linear    | default / factor                                                       | 1                          |
| llama3    | low frequencies / factor, high kept, a smooth blend between            | 1                          |
| yarn      | interpolated (/ factor) and extrapolated blended by a ramp over dims   | 0.1 ln(factor) + 1 or given|
| longrope  | default / (long or short factor per dim)                               | sqrt(1 + ln f / ln orig)   |
| dynamic   | default with theta scaled by ((factor L / max_pos) - factor + 1)^(d/(d-2)) | 1                      |
"""

from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


class RotaryEmbedding:
    """cos/sin for each token's position (half-split rotation, as in HF checkpoints)."""

    def __init__(self, rotary_dim: int, theta: float, scaling: dict, max_pos: int, max_len: int) -> None:
        self.rotary_dim = rotary_dim
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
        self.inv_freq, self.factor = _inv_freq(exponents, theta, dict(scaling), max_pos, max_len)

    def to(self, device: torch.device) -> None:
        """Move the frequencies to the model's device once, at load (a lazy move would block the first step)."""
        self.inv_freq = self.inv_freq.to(device)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and the sign-folded sin (-sin on the first half: see gpu/kernels/reference.py apply_rope),
        [num_tokens, 1, rotary_dim]."""
        freqs = positions.float()[:, None] * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        if self.factor != 1.0:
            cos, sin = cos * self.factor, sin * self.factor
        return torch.cat((cos, cos), -1)[:, None].to(dtype), torch.cat((-sin, sin), -1)[:, None].to(dtype)


def _inv_freq(exponents: torch.Tensor, theta: float, s: dict, max_pos: int, max_len: int) -> tuple[torch.Tensor, float]:
    rope_type, dim = s.get("rope_type", "default"), 2 * len(exponents)
    factor = s.get("factor", 1.0)
    if rope_type == "dynamic" and max_len > max_pos:
        theta *= (factor * max_len / max_pos - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / theta**exponents
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, factor, s), 1.0
    if rope_type == "yarn":
        return _yarn(inv_freq, theta, factor, dim, s)
    if rope_type == "longrope":
        orig = s["original_max_position_embeddings"]
        factors = s["long_factor"] if max_len > orig else s["short_factor"]
        f = s.get("factor") or max_pos / orig
        attention = s.get("attention_factor") or (math.sqrt(1 + math.log(f) / math.log(orig)) if f > 1 else 1.0)
        return inv_freq / torch.tensor(factors, dtype=torch.float32, device="cpu"), attention
    return inv_freq, 1.0


def _llama3(inv_freq: torch.Tensor, factor: float, s: dict) -> torch.Tensor:
    low, high, old_len = s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(inv_freq: torch.Tensor, theta: float, factor: float, dim: int, s: dict) -> tuple[torch.Tensor, float]:
    orig = s["original_max_position_embeddings"]
    attention = s.get("attention_factor")
    if attention is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = _mscale(factor, mscale) / _mscale(factor, mscale_all) if mscale and mscale_all else _mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = (
        (torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low if high != low else 0.001)
    ).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp), attention


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

"""Fused Triton kernels for the decoder's small steps: rotary + KV-cache write, residual add + RMSNorm, act-and-mul,
and `TritonKernels`, the kernel set they make (gpu/kernels/reference.py).

Each wrapper equals the torch step of gpu/kernels/reference.py (TorchKernels), with that step's rounding order in
bf16/fp16: math in float32, rounded to the model's dtype exactly where the torch step rounds. All tensors on one device; the last dim of every tensor contiguous; other strides are read.

Interpreter rule: `@triton.jit` reads TRITON_INTERPRET when this module is imported, so a CPU run (tests,
debugging) sets TRITON_INTERPRET=1 before its first import of this module. Nothing under gpu/ imports it at import
time: the backend that uses it imports it once it is chosen.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ACT_IDS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1}


@triton.jit
def _rope_tile(src, tok, stride_t, stride_h, heads, cos, sin, offs_h, offs_d, partner, HEAD_DIM, ROT_DIM):
    """One token's [heads, head_dim] tile rotated in float32: round(round(x cos) + x[partner] sin) as apply_rope."""
    rows = src + tok * stride_t + offs_h[:, None] * stride_h
    h_ok = offs_h[:, None] < heads
    x = tl.load(rows + offs_d[None, :], mask=h_ok & (offs_d[None, :] < HEAD_DIM))
    rot = h_ok & (offs_d[None, :] < ROT_DIM)
    xp = tl.load(rows + partner[None, :], mask=rot, other=0.0).to(tl.float32)
    xc = (x.to(tl.float32) * cos[None, :]).to(x.dtype).to(tl.float32)
    return tl.where(rot, (xc + xp * sin[None, :]).to(x.dtype), x)


@triton.jit
def _rope_kv_kernel(
    q, k, v, q_out, k_cache, v_cache, cos, sin, slots,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_ct,
    stride_cs, stride_ch, q_heads, kv_heads,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    half: tl.constexpr = ROT_DIM // 2
    partner = tl.where(offs_d < half, offs_d + half, offs_d - half)
    rot = offs_d < ROT_DIM
    cos_r = tl.load(cos + tok * stride_ct + offs_d, mask=rot, other=0.0).to(tl.float32)
    sin_r = tl.load(sin + tok * stride_ct + offs_d, mask=rot, other=0.0).to(tl.float32)
    d_ok = offs_d[None, :] < HEAD_DIM

    offs_hq = tl.arange(0, BLOCK_HQ)
    q_rot = _rope_tile(q, tok, stride_qt, stride_qh, q_heads, cos_r, sin_r, offs_hq, offs_d, partner, HEAD_DIM, ROT_DIM)
    q_dst = q_out + tok * stride_ot + offs_hq[:, None] * stride_oh + offs_d[None, :]
    tl.store(q_dst, q_rot, mask=(offs_hq[:, None] < q_heads) & d_ok)

    slot = tl.load(slots + tok).to(tl.int64)
    if slot >= 0:  # a padding token (slot -1) writes no K/V
        offs_hk = tl.arange(0, BLOCK_HKV)
        kv_ok = (offs_hk[:, None] < kv_heads) & d_ok
        k_rot = _rope_tile(
            k, tok, stride_kt, stride_kh, kv_heads, cos_r, sin_r, offs_hk, offs_d, partner, HEAD_DIM, ROT_DIM
        )
        cache_off = slot * stride_cs + offs_hk[:, None] * stride_ch + offs_d[None, :]
        tl.store(k_cache + cache_off, k_rot, mask=kv_ok)
        v_val = tl.load(v + tok * stride_vt + offs_hk[:, None] * stride_vh + offs_d[None, :], mask=kv_ok)
        tl.store(v_cache + cache_off, v_val, mask=kv_ok)


def rope_and_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
    q_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q, rotate k and store it and v at their cache slots: one launch, grid (num_tokens,).

    q [T, Hq, D], k and v [T, Hkv, D], of one dtype with the caches and q_out (views of a fused qkv output are
    fine; any Hq, Hkv: heads are independent); cos and the sign-folded sin [T, 1, R] or [T, R] as RotaryEmbedding
    returns them, R <= D even (dims R..D pass through); kv = (k_cache, v_cache) [num_blocks, block_size, Hkv, D],
    contiguous; slot_mapping [T] int32/int64, a slot < 0 (a padding token) writes nothing. Any D and R (masked,
    not padded). The rotated q goes to q_out [T, Hq, D] if given, else into q in place; returns it. k and v are
    read, never written. Equals TorchKernels.rope_and_write_kv (bit for bit in bf16/fp16: the same two roundings).
    One program holds a token's heads at once: sized for Hq * D up to ~8k elements.
    """
    num_tokens, q_heads, head_dim = q.shape
    kv_heads, rot_dim = k.shape[1], cos.shape[-1]
    k_cache, v_cache = kv
    assert rot_dim % 2 == 0 and rot_dim <= head_dim and k.shape == v.shape == (num_tokens, kv_heads, head_dim)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (kv_heads, head_dim)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype == q.dtype == k.dtype
    assert all(t.stride(-1) == 1 for t in (q, k, v, cos, sin))
    cos, sin = cos.reshape(num_tokens, rot_dim), sin.reshape(num_tokens, rot_dim)
    assert cos.stride() == sin.stride()
    q_out = q if q_out is None else q_out
    assert q_out.shape == q.shape and q_out.dtype == q.dtype and q_out.stride(-1) == 1
    if num_tokens:
        _rope_kv_kernel[(num_tokens,)](
            q, k, v, q_out, k_cache, v_cache, cos, sin, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            q_out.stride(0), q_out.stride(1), cos.stride(0), kv_heads * head_dim, head_dim, q_heads, kv_heads,
            HEAD_DIM=head_dim, ROT_DIM=rot_dim, BLOCK_HQ=triton.next_power_of_2(q_heads),
            BLOCK_HKV=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        )  # fmt: skip
    return q_out


@triton.jit
def _add_rms_norm_kernel(
    x, residual, weight, out, stride_x, stride_xh, stride_r, stride_rh, stride_o, stride_oh, heads, hidden, eps,
    offset, HAS_RESIDUAL: tl.constexpr, ROUND_NORMED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    tok, head = row // heads, row % heads
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    val = tl.load(x + tok * stride_x + head * stride_xh + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r_ptr = residual + tok * stride_r + head * stride_rh + cols
        val = (val.to(tl.float32) + tl.load(r_ptr, mask=ok, other=0.0).to(tl.float32)).to(val.dtype)
        tl.store(r_ptr, val, mask=ok)
    xf = val.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    if ROUND_NORMED:  # Llama: the normalised row is cast to the model's dtype before the weight scales it
        normed = normed.to(val.dtype).to(tl.float32)
    w = tl.load(weight + cols, mask=ok, other=0.0).to(tl.float32) + offset
    tl.store(out + tok * stride_o + head * stride_oh + cols, (normed * w).to(out.dtype.element_ty), mask=ok)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """vLLM's fused_add_rms_norm: residual += x (rounded to its dtype, in place), returns RMSNorm(residual).

    x, residual, out [N, H] or [N, heads, H] (per-head q/k norms) and weight [H] of one dtype (the first two dims
    may be strided); offset 0 (Llama: scale by w) or 1 (Gemma: by 1 + w, in float32). residual None: a plain
    RMSNorm of x, nothing written but the output. out: where the result goes (may be x itself), else a new
    contiguous tensor. One launch, grid (N * heads,), a whole row per program.
    Equals TorchKernels.rms_norm: RMSNorm(x + residual), its rounding order in bf16/fp16.
    """
    hidden = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    assert x.dim() in (2, 3) and out.shape == x.shape and weight.shape == (hidden,)
    assert out.dtype == weight.dtype == x.dtype
    assert x.stride(-1) == out.stride(-1) == weight.stride(0) == 1
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
    x3, r3, o3 = (t if t is None or t.dim() == 3 else t[:, None] for t in (x, residual, out))
    if x.numel():
        _add_rms_norm_kernel[(x3.shape[0] * x3.shape[1],)](
            x3, x3 if r3 is None else r3, weight, out, *x3.stride()[:2], *(x3 if r3 is None else r3).stride()[:2],
            *o3.stride()[:2], x3.shape[1], hidden, eps, float(offset),
            HAS_RESIDUAL=residual is not None, ROUND_NORMED=offset == 0, BLOCK=triton.next_power_of_2(hidden),
        )  # fmt: skip
    return out


@triton.jit
def _act_and_mul_kernel(x, out, stride_x, stride_o, d, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row, cols = tl.program_id(0), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < d
    gate = tl.load(x + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x + row * stride_x + d + cols, mask=ok, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    # gelu_tanh(g) = g (1 + tanh(y)) / 2 = g sigmoid(2 y), y = sqrt(2 / pi) (g + 0.044715 g^3)
    a = g * tl.sigmoid(g if ACT == 0 else 1.5957691216057308 * (g + 0.044715 * g * g * g))
    a = a.to(gate.dtype).to(tl.float32)  # the torch path rounds act(gate) before the multiply
    tl.store(out + row * stride_o + cols, (a * up).to(out.dtype.element_ty), mask=ok)


def act_and_mul(x: torch.Tensor, act: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """act(x[:, :d]) * x[:, d:] for a fused gate_up output x [N, 2d] (rows may be strided): out [N, d], x's dtype.

    act: a key of gpu/kernels/reference.py ACTIVATIONS (silu; gelu_tanh = gelu_pytorch_tanh). out: where the result
    goes, else a new tensor. One launch, grid (N, cdiv(d, 1024)). Equals TorchKernels.act_and_mul, its rounding order.
    """
    n, d = x.shape[0], x.shape[-1] // 2
    out = x.new_empty(n, d) if out is None else out
    assert x.dim() == 2 and x.shape[-1] == 2 * d and out.shape == (n, d) and out.dtype == x.dtype
    assert x.stride(-1) == out.stride(-1) == 1
    block = min(triton.next_power_of_2(d), 1024)
    if n:
        _act_and_mul_kernel[(n, triton.cdiv(d, block))](x, out, x.stride(0), out.stride(0), d, ACT_IDS[act], block)
    return out


class TritonKernels:
    """The triton backend's kernel set (gpu/kernels/reference.py): one launch per step."""

    @staticmethod
    def rms_norm(x, residual, weight, eps: float, offset: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The sum is written into `residual` (vLLM's in-place residual stream)."""
        return fused_add_rms_norm(x, residual, weight, eps, offset), x if residual is None else residual

    @staticmethod
    def rope_and_write_kv(q, k, v, cos, sin, kv: tuple[torch.Tensor, torch.Tensor], slots) -> torch.Tensor:
        """q is rotated in place (a projection's fresh output, read by nothing else)."""
        return rope_and_write_kv(q, k, v, cos, sin, kv, slots)

    act_and_mul = staticmethod(act_and_mul)

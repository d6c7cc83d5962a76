"""gpu/kernels/triton/fused.py in the Triton interpreter (CPU): each kernel against its torch step (TorchKernels,
what the torch backend runs) and a float64 one, outputs and caches poisoned with NaN first so an unwritten element fails.
The interpreter is on where there is no CUDA GPU (tests/conftest.py, before any kernel is decorated); on a GPU the
kernels are compiled and these CPU-tensor checks are skipped: the model-level tests run them there (test_graphs,
test_launch_budget, test_attention_backends, test_triton_engine)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import triton.language as tl
from triton.runtime import interpreter

from gpu.kernels.reference import TORCH_KERNELS, apply_rope
from gpu.kernels.triton.fused import act_and_mul, fused_add_rms_norm, rope_and_write_kv
from gpu.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# ‖out − ref64‖/‖ref64‖ allowed: a few roundings to the dtype
REL64 = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}
BLOCK_SIZE = 16
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's checks (CPU)")


@pytest.fixture(autouse=True)
def bf16_rounds_to_nearest_even(monkeypatch):
    """The interpreter casts float32 to bfloat16 by truncation; a GPU (cvt.rn) and torch round to nearest even.
    Cast as the GPU does, so that bf16 results can be held to torch's bit for bit here too."""
    cast = interpreter.InterpreterBuilder.cast_impl

    def rounding_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bf16 = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(bf16.view(torch.uint16).numpy(), tl.bfloat16)
        return cast(self, src, dst_type)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", rounding_cast)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check(out: torch.Tensor, ref: torch.Tensor, exact: bool) -> None:
    """Equal to the torch path: bit for bit where the same roundings are promised, else to the dtype's tolerance."""
    assert not out.isnan().any()
    tol = {"rtol": 0, "atol": 0} if exact else {}
    torch.testing.assert_close(out, ref, **tol)


# (num_tokens, q_heads, kv_heads, head_dim, rotary_dim): token counts 1/7/33, GQA 1 and 3, head dims 24/64/80, partial
ROPE_SHAPES = [(1, 3, 1, 24, 24), (7, 4, 4, 64, 64), (33, 6, 2, 64, 32), (7, 9, 3, 24, 12), (1, 2, 2, 80, 32)]


def rope_inputs(shape, dtype, gen):
    """q/k/v as views of one fused qkv output (strided rows), cos/sin from RotaryEmbedding, slots in random order."""
    t, hq, hkv, d, r = shape
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    positions = torch.randint(0, 4000, (t,), generator=gen)
    cos, sin = RotaryEmbedding(r, 10000.0, {}, 4096, 4096)(positions, dtype)
    num_blocks = (t + 2 * BLOCK_SIZE - 1) // BLOCK_SIZE + 1
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:t]
    return q, k, v, cos, sin, slots, (num_blocks, BLOCK_SIZE, hkv, d)


def nan_cache(cache_shape, dtype):
    return torch.full(cache_shape, float("nan"), dtype=dtype), torch.full(cache_shape, float("nan"), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROPE_SHAPES)
def test_rope_and_write_kv_equals_apply_rope_and_write_kv(shape, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    q, k, v, cos, sin, slots, cache_shape = rope_inputs(shape, dtype, gen)
    q_before, k_before, v_before = q.clone(), k.clone(), v.clone()
    kv, kv_ref = nan_cache(cache_shape, dtype), nan_cache(cache_shape, dtype)
    q_out = torch.full(q.shape, float("nan"), dtype=dtype)

    got = rope_and_write_kv(q, k, v, cos, sin, kv, slots, q_out=q_out)
    ref = TORCH_KERNELS.rope_and_write_kv(q, k, v, cos, sin, kv_ref, slots)

    assert got is q_out
    exact = dtype != torch.float32  # bf16/fp16: the same two roundings as apply_rope; float32 may differ by an FMA
    check(q_out, ref, exact)
    for cache, cache_ref, new in zip(kv, kv_ref, (k, v), strict=True):
        flat, flat_ref = cache.view(-1, *new.shape[1:]), cache_ref.view(-1, *new.shape[1:])
        check(flat[slots], flat_ref[slots], exact or new is v)
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[slots] = False
        assert flat[untouched].isnan().all()  # nothing written outside this step's slots
    for before, after in ((q_before, q), (k_before, k), (v_before, v)):
        assert torch.equal(before, after)  # with q_out given, the inputs are only read
    r = cos.shape[-1]
    assert torch.equal(q_out[..., r:], q[..., r:])  # the dims past rotary_dim pass through untouched

    c64, s64 = cos.double(), sin.double()
    assert rel_err(q_out, apply_rope(q.double(), c64, s64)) <= REL64[dtype]
    k_flat = kv[0].view(-1, *k.shape[1:])
    assert rel_err(k_flat[slots], apply_rope(k.double(), c64, s64)) <= REL64[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_write_kv_in_place_skips_padding_slots(dtype):
    """Without q_out, q is rotated in place; a token whose slot is -1 (a padding row) rotates q but writes no K/V."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, cos, sin, slots, cache_shape = rope_inputs((7, 6, 2, 64, 64), dtype, gen)
    q = q.contiguous()
    slots[[1, 4]] = -1
    kv, kv_ref = nan_cache(cache_shape, dtype), nan_cache(cache_shape, dtype)
    keep = slots >= 0
    ref = TORCH_KERNELS.rope_and_write_kv(q, k, v, cos, sin, kv_ref, slots.clamp(min=0))  # q's reference
    kv_ref = nan_cache(cache_shape, dtype)
    TORCH_KERNELS.rope_and_write_kv(q[keep], k[keep], v[keep], cos[keep], sin[keep], kv_ref, slots[keep])

    assert rope_and_write_kv(q, k, v, cos, sin, kv, slots) is q
    check(q, ref, dtype != torch.float32)
    for cache, cache_ref in zip(kv, kv_ref, strict=True):  # the padding rows' slots keep their NaN
        torch.testing.assert_close(cache, cache_ref, equal_nan=True, rtol=0, atol=0 if dtype != torch.float32 else 1e-6)


HIDDEN_CASES = [(1, 64), (7, 96), (33, 24)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("rows,hidden", HIDDEN_CASES)
def test_fused_add_rms_norm_equals_rmsnorm_of_sum(rows, hidden, offset, dtype):
    gen = torch.Generator().manual_seed(rows * hidden + int(offset))
    wide = torch.randn(rows, hidden + 8, generator=gen).to(dtype)
    x = wide[:, :hidden]  # strided rows
    residual = (3 * torch.randn(rows, hidden, generator=gen)).to(dtype)
    weight = (torch.randn(hidden, generator=gen) * 0.5 + (0.0 if offset else 1.0)).to(dtype)
    residual_ref = residual.clone()
    out = torch.full((rows, hidden), float("nan"), dtype=dtype)

    assert fused_add_rms_norm(x, residual, weight, 1e-6, offset, out=out) is out
    ref, sum_ref = TORCH_KERNELS.rms_norm(x, residual_ref, weight, 1e-6, offset)

    assert torch.equal(residual, sum_ref)  # the sum, rounded once to the dtype, written back
    check(out, ref, exact=False)
    s = residual.double()
    ref64 = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * (weight.double() + offset)
    assert rel_err(out, ref64) <= REL64[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_without_residual_in_place(offset, dtype):
    """residual=None: a plain RMSNorm; out=x overwrites the input row by row."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(7, 80, generator=gen).to(dtype)
    weight = torch.randn(80, generator=gen).to(dtype)
    ref = TORCH_KERNELS.rms_norm(x.clone(), None, weight, 1e-5, offset)[0]
    assert fused_add_rms_norm(x, None, weight, 1e-5, offset, out=x) is x
    check(x, ref, exact=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_per_head_rms_norm_of_a_strided_qkv_view(offset, dtype):
    """Qwen3's / Gemma 3's q and k norms: x [N, heads, D] a view of a fused qkv output; a new contiguous output."""
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(7, (4 + 2 * 2) * 32, generator=gen).to(dtype)
    q = qkv[:, : 4 * 32].view(7, 4, 32)
    weight = torch.randn(32, generator=gen).to(dtype)
    out = fused_add_rms_norm(q, None, weight, 1e-6, offset)
    assert out.is_contiguous() and out.shape == q.shape
    check(out, TORCH_KERNELS.rms_norm(q, None, weight, 1e-6, offset)[0], exact=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("rows,d", [(1, 24), (7, 64), (33, 80), (2, 1100)])
def test_act_and_mul_equals_torch(rows, d, act, dtype):
    gen = torch.Generator().manual_seed(rows + d)
    x = (3 * torch.randn(rows, 2 * d + 4, generator=gen)).to(dtype)[:, : 2 * d]  # strided rows, a fused gate_up
    out = torch.full((rows, d), float("nan"), dtype=dtype)

    assert act_and_mul(x, act, out=out) is out
    check(out, TORCH_KERNELS.act_and_mul(x, act), exact=False)
    assert rel_err(out, TORCH_KERNELS.act_and_mul(x.double(), act)) <= REL64[dtype]
    assert torch.equal(act_and_mul(x, act), out)  # a new output when none is given


def test_empty_batches_launch_nothing():
    q, k, v = torch.empty(0, 4, 64), torch.empty(0, 2, 64), torch.empty(0, 2, 64)
    cos = sin = torch.empty(0, 1, 64)
    kv = (torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64))
    assert rope_and_write_kv(q, k, v, cos, sin, kv, torch.empty(0, dtype=torch.int64)).shape == (0, 4, 64)
    assert fused_add_rms_norm(torch.empty(0, 64), None, torch.ones(64), 1e-6).shape == (0, 64)
    assert act_and_mul(torch.empty(0, 128), "silu").shape == (0, 64)

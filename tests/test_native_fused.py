"""The native kernel set's small steps (gpu/kernels/native/csrc/fused.cpp) on each ISA's build: residual add + RMSNorm,
rotary + KV-cache write and act-and-mul against float64 references written from HF's formulas, on awkward shapes
(tails past sixteen lanes, strided views of a fused projection, partial rotary); the cache slots not written keep
their NaN poison; a row's result is the same bits alone and in any batch, and on either ISA's build."""

import math

import pytest
import torch

from gpu.kernels import native
from gpu.kernels.native.kernels import NativeKernels

BUILT = [isa for isa in native.cpu_isas() if native.ops(isa) is not None]
pytestmark = pytest.mark.skipif(not BUILT, reason="no native CPU kernels built for this CPU (make setup builds them)")
EPS = 1e-6


def rms_norm_reference(x, residual, weight, offset):
    s = x.double() + (0 if residual is None else residual.double())
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * (weight.double() + offset)


@pytest.mark.parametrize("isa", BUILT)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 64, 577])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_add_rms_norm_matches_a_float64_reference(isa, n, offset):
    """2-D rows with and without a residual (the sum written into it: x + residual rounded once), and a strided 3-D
    view (per-head q/k norms of a fused projection's output)."""
    g = torch.Generator().manual_seed(n)
    kernels = NativeKernels(native.ops(isa))
    x, residual, weight = (
        torch.randn(5, n, generator=g) * 3,
        torch.randn(5, n, generator=g),
        torch.randn(n, generator=g),
    )
    for res in (None, residual.clone()):
        want = rms_norm_reference(x, res, weight, offset)
        out, new_residual = kernels.rms_norm(x, res, weight, EPS, offset)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
        assert torch.equal(new_residual, x if res is None else x + residual)
        assert res is None or new_residual is res
    heads = torch.randn(4, 7, n + 3, generator=g)[:, 1:5, 2 : n + 2]
    want = rms_norm_reference(heads, None, weight, offset)
    torch.testing.assert_close(
        kernels.rms_norm(heads, None, weight, EPS, offset)[0].double(), want, rtol=1e-5, atol=1e-6
    )


def rope_reference(x, cos, folded_sin):
    """HF's x * cos + rotate_half(x) * sin over the first rot dims, in float64, from the float32 tables the kernel is
    given (RotaryEmbedding's cos and sign-folded sin: -sin on the first half)."""
    rot = cos.shape[-1]
    cos, sin = cos.double(), folded_sin.double() * torch.cat((-torch.ones(rot // 2), torch.ones(rot // 2))).double()
    head, rest = x.double()[..., :rot], x.double()[..., rot:]
    half = torch.cat((-head[..., rot // 2 :], head[..., : rot // 2]), -1)
    return torch.cat((head * cos + half * sin, rest), -1)


@pytest.mark.parametrize("isa", BUILT)
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "rot"), [(9, 3, 64, 64), (4, 2, 48, 24), (2, 1, 40, 38)])
def test_rope_and_write_kv_matches_a_float64_reference(isa, heads, kv_heads, dim, rot):
    """q, k and v as strided views of one projection output; q rotated in place, k rotated and v copied into their
    slots of NaN-poisoned caches, every other slot left NaN."""
    from gpu.layers.rotary import RotaryEmbedding

    g, tokens = torch.Generator().manual_seed(dim), 6
    kernels = NativeKernels(native.ops(isa))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim + 5, generator=g)[:, 5:]
    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
    positions, slots = torch.tensor([0, 1, 7, 100, 1000, 4095]), torch.tensor([0, 17, 5, 63, 33, 18])
    cos, sin = RotaryEmbedding(rot, 10000.0, {}, 8192, 8192)(positions, torch.float32)
    q_want, k_want, v_want = rope_reference(q, cos, sin), rope_reference(k, cos, sin), v.clone()
    kv = (torch.full((4, 16, kv_heads, dim), math.nan), torch.full((4, 16, kv_heads, dim), math.nan))
    q_in = q.clone()
    assert kernels.rope_and_write_kv(q_in, k, v, cos, sin, kv, slots) is q_in
    torch.testing.assert_close(q_in.double(), q_want, rtol=1e-5, atol=1e-5)
    for cache, want in zip(kv, (k_want, v_want), strict=True):
        flat = cache.view(-1, kv_heads, dim)
        torch.testing.assert_close(flat[slots].double(), want.double(), rtol=1e-5, atol=1e-5)
        unwritten = torch.ones(flat.shape[0], dtype=torch.bool)
        unwritten[slots] = False
        assert flat[unwritten].isnan().all()
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.rope_and_write_kv(q.clone(), k, v, cos, sin, kv, torch.tensor([0, 1, 2, 3, 4, 64]))


def act_reference(x, act):
    gate, up = x.double().chunk(2, -1)
    if act == "silu":
        return gate * torch.sigmoid(gate) * up
    return 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3))) * up


@pytest.mark.parametrize("isa", BUILT)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("d", [1, 17, 1536])
def test_act_and_mul_matches_a_float64_reference(isa, act, d):
    """Gates of every magnitude, the sigmoid's saturated tails included. Bound: float32's conditioning of sigmoid(z)
    (relative error ~|z| eps from rounding z itself), or 1e-12 of gate x up where the float64 reference's own
    1 + tanh cancels."""
    g = torch.Generator().manual_seed(d)
    x = torch.randn(4, 2 * d, generator=g) * 4
    x[0, : min(d, 7)] = torch.tensor([-200.0, -90.0, -20.0, 0.0, 20.0, 90.0, 200.0])[: min(d, 7)]
    out = NativeKernels(native.ops(isa)).act_and_mul(x, act)
    want = act_reference(x, act)
    gate, up = x.double().chunk(2, -1)
    z = gate if act == "silu" else 2 * math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)
    assert out.isfinite().all()
    assert ((out.double() - want).abs() <= 4e-7 * (2 + z.abs()) * want.abs() + 1e-12 * (gate * up).abs()).all()


def run_all(ops, x, residual, weight, gate_up, q, k, v, cos, sin, slots):
    kernels, kv = NativeKernels(ops), (torch.zeros(8, 16, k.shape[1], k.shape[2]), torch.zeros(8, 16, *k.shape[1:]))
    norm, total = kernels.rms_norm(x, residual.clone(), weight, EPS, 0.0)
    rotated = kernels.rope_and_write_kv(q.clone(), k, v, cos, sin, kv, slots)
    return [norm, total, rotated, kv[0].view(-1, *k.shape[1:])[slots], kernels.act_and_mul(gate_up, "silu")]


def test_a_rows_results_are_the_same_bits_alone_in_any_batch_and_on_every_isa():
    from gpu.layers.rotary import RotaryEmbedding

    g, n = torch.Generator().manual_seed(7), 120  # (120 x 577 floats: past every step's one-thread grain)
    x, residual, weight = torch.randn(n, 577, generator=g), torch.randn(n, 577, generator=g), torch.randn(577)
    gate_up = torch.randn(n, 2 * 1000, generator=g)
    q, k, v = torch.randn(n, 9, 64, generator=g), torch.randn(n, 3, 64, generator=g), torch.randn(n, 3, 64, generator=g)
    cos, sin = RotaryEmbedding(64, 10000.0, {}, 4096, 4096)(torch.arange(n) * 37, torch.float32)
    args = (x, residual, weight, gate_up, q, k, v, cos, sin, torch.arange(n))
    for isa in BUILT:
        whole = run_all(native.ops(isa), *args)
        for i in (0, 13, n - 1):
            alone = run_all(native.ops(isa), *(a if a is weight else a[i : i + 1] for a in args))
            assert all(torch.equal(a, w[i : i + 1]) for a, w in zip(alone, whole, strict=True)), (isa, i)
        assert all(torch.equal(a, b) for a, b in zip(whole, run_all(native.ops(BUILT[0]), *args), strict=True)), isa

"""`--quantization bf16` (gpu/layers/quant.py; the native kernel's bfloat16 panels, gpu/kernels/native/csrc/linear.cpp).
The
references are computed here: each weight rounded to bfloat16 to nearest, ties to even, by integer arithmetic on
its bits (not torch's conversion, which the layer uses), then x @ W^T in float64. A row's float32 fma chain over the
widened weights is within 1e-5 of that (relative to sum |x w|); the float32 weight's product differs from it by at
most 2^-8 of sum |x w| (a rounding to 8 significant bits), and does differ. The native layer keeps nothing but the
bfloat16 panels; up to WIDEN_ROWS rows a row's result is the same bits in any batch (it is the float32 kernel's
chain on the same weights widened: compared with the native float32 kernel on them), and above, the panels widen
back to exactly the rounded weight for the GEMM."""

from __future__ import annotations

import pytest
import torch

from gpu.kernels import native
from gpu.layers import quant
from gpu.layers.quant import QuantLinear

NATIVE = pytest.mark.skipif(native.ops() is None, reason="the native kernels are not built for this CPU")
ROWS = [1, 2, 3, 7, 64, 65, 200, quant.WIDEN_ROWS + 1]  # (a decode row, the tiles' sizes and tails, many rows)


def bf16_round(w: torch.Tensor) -> torch.Tensor:
    """Each float32 rounded to bfloat16 to nearest, ties to even (finite inputs), as float64."""
    bits = w.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    keep = (bits >> 16) & 1  # (the last kept bit: a tie rounds to make it 0)
    rounded = ((bits + 0x7FFF + keep) >> 16 << 16) & 0xFFFFFFFF
    return (rounded - ((rounded >> 31) << 32)).to(torch.int32).view(torch.float32).double()


def case(out: int, inp: int, rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, inp, generator=g), torch.randn(out, generator=g), torch.randn(rows, inp, generator=g)


def test_the_reference_rounding_is_to_nearest_even():
    one = 1.0 + 2.0**-8  # halfway between 1 and 1 + 2^-7: to 1 (even); 1 + 3 * 2^-8 to 1 + 2^-6 (even)
    w = torch.tensor([one, 1.0 + 3 * 2.0**-8, -one, 1.0 + 2.0**-8 + 2.0**-20, 3.0])
    assert bf16_round(w).tolist() == [1.0, 1.0 + 2.0**-6, -1.0, 1.0 + 2.0**-7, 3.0]


@pytest.mark.parametrize("native_ops", [pytest.param("native", marks=NATIVE), None])
@pytest.mark.parametrize("shape", [(96, 128), (100, 97), (1537, 33)])  # (tails past every panel and vector)
def test_every_row_count_matches_the_rounded_weight(native_ops, shape):
    w, bias, x = case(*shape, max(ROWS))
    q = QuantLinear(w, bias, "bf16", native.ops() if native_ops else None)
    assert q.kernel_rows == -1  # (no kernel of its own, not even for zero rows)
    wq = bf16_round(w)
    for rows in ROWS:
        y = q(x[:rows]).double()
        scale = x[:rows].abs().double() @ w.abs().double().t() + bias.abs().double()
        to_rounded = (y - (x[:rows].double() @ wq.t() + bias.double())).abs()
        assert (to_rounded <= 1e-5 * (scale + 1)).all(), rows
        to_float = (y - (x[:rows].double() @ w.double().t() + bias.double())).abs()
        assert (to_float <= 2.0**-8 * scale + 1e-5 * (scale + 1)).all(), rows
        assert to_float.max() > 1e-4  # it is rounded


@NATIVE
def test_the_native_layer_keeps_only_the_bfloat16_panels_and_rows_alone():
    ops = native.ops()
    w, bias, x = case(300, 576, quant.WIDEN_ROWS, seed=1)
    q = QuantLinear(w, bias, "bf16", ops)
    held = [t for t in (q.native, q.packed, q.weight_t) if t is not None]
    assert [t.dtype for t in held] == [torch.bfloat16] and q.native.numel() < 1.1 * w.numel()  # (panel padding)
    widened = ops.pack(w.to(torch.bfloat16).float())  # the float32 kernel on the same weights
    assert torch.equal(ops.unpack(q.native, 300).double(), bf16_round(w).t())  # (what many rows multiply by)
    for rows in (r for r in ROWS if r <= quant.WIDEN_ROWS):
        y = q(x[:rows])
        assert torch.equal(y, ops.linear(x[:rows].contiguous(), widened, 300, bias))
        assert torch.equal(y[:1], q(x[:1]))  # the first row: the same bits alone


def test_without_the_native_kernels_the_float32_gemm_takes_the_rounded_weight(monkeypatch):
    monkeypatch.setattr(quant, "onednn_pack", lambda weight: None)  # ([in, out]: the path where oneDNN is missing)
    w, bias, x = case(64, 96, 5)
    q = QuantLinear(w, bias, "bf16", None)
    assert q.native is None and q.weight_t.dtype == torch.float32
    torch.testing.assert_close(q(x).double(), x.double() @ bf16_round(w).t() + bias.double(), rtol=1e-5, atol=1e-5)


@NATIVE
def test_batch_invariant_mode_keeps_many_rows_on_the_native_kernel():
    """Above WIDEN_ROWS a row's result depends on the GEMM around it; with make_invariant it is the row's alone.
    The power check: without it, the same comparison differs."""
    w, bias, x = case(300, 576, quant.WIDEN_ROWS + 1, seed=2)
    q = QuantLinear(w, bias, "bf16", native.ops())
    alone = q(x[:1])
    assert not torch.equal(q(x)[:1], alone)
    q.make_invariant()
    assert torch.equal(q(x)[:1], alone)

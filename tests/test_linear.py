"""gpu/layers/linear.py: every CPU layout (one row and prefill from the [in, out] copy, 2-32 rows from the oneDNN-packed
one; with the native kernels their panels up to NATIVE_ROWS rows and the [out, in] weight beyond) computes F.linear of
the loaded weight, and packing keeps two copies of the weight, not three (a weight shared with a tied embedding keeps
its own storage)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu.kernels import native
from gpu.layers.linear import NATIVE_ROWS, Linear


def loaded(bias: bool) -> tuple[Linear, torch.Tensor, torch.Tensor | None]:
    torch.manual_seed(0)
    layer = Linear(48, 80, bias=bias).requires_grad_(False)
    return layer, layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 5, 32, 33, 200])
def test_every_layout_computes_the_loaded_linear(rows, bias):
    layer, w, b = loaded(bias)
    layer.pack()
    x = torch.randn(rows, 48)
    torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.weight, w, atol=0, rtol=0)  # the parameter still reads as [out, in]


def test_packing_leaves_no_third_copy_unless_the_weight_is_shared():
    layer, _, _ = loaded(False)
    layer.pack()
    assert layer.weight.untyped_storage().data_ptr() == layer.weight_t.untyped_storage().data_ptr()
    tied, _, _ = loaded(False)
    shared = tied.weight
    tied.pack(keep_weight=True)
    assert tied.weight is shared and shared.is_contiguous()  # the embedding's row-major table stays
    assert tied.weight.untyped_storage().data_ptr() != tied.weight_t.untyped_storage().data_ptr()


@pytest.mark.skipif(native.ops() is None, reason="no native CPU kernels built (make setup builds them)")
@pytest.mark.parametrize("rows", [1, 7, NATIVE_ROWS, NATIVE_ROWS + 1, 200])
def test_with_the_native_kernels_every_row_count_computes_the_loaded_linear_from_two_copies(rows):
    layer, w, b = loaded(True)
    layer.pack(native_ops=native.ops())
    x = torch.randn(rows, 48)
    torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    assert layer.weight_t is None and layer.packed is None  # the panels and the [out, in] weight alone
    torch.testing.assert_close(layer.weight, w, atol=0, rtol=0)

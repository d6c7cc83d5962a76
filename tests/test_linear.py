"""gpu/layers/linear.py: every CPU layout (one row and prefill from the [in, out] copy, 2-32 rows from the oneDNN-packed
one; with the native kernels their panels at every row count) computes F.linear of the loaded weight; the torch path
keeps two copies of the weight, not three (a weight shared with a tied embedding keeps its own storage), the native
one a single copy, from which a tied embedding reads its rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu.kernels import native
from gpu.layers.linear import Linear


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


NATIVE = pytest.mark.skipif(native.ops() is None, reason="no native CPU kernels built (make setup builds them)")


@NATIVE
@pytest.mark.parametrize("rows", [1, 7, 64, 65, 200])
def test_with_the_native_kernels_every_row_count_computes_the_loaded_linear_from_one_copy(rows):
    layer, w, b = loaded(True)
    layer.pack(native_ops=native.ops())
    x = torch.randn(rows, 48)
    torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(x.view(1, rows, 48)), F.linear(x, w, b)[None], atol=1e-5, rtol=1e-5)
    assert layer.weight.is_meta and layer.weight_t is None and layer.packed is None  # the panels alone
    assert layer.native.numel() * 4 < w.numel() * 4 + 64 * 48 * 4  # (at most one panel of padding)


@NATIVE
@pytest.mark.parametrize("bias", [False, True])
def test_a_tied_embedding_reads_its_rows_from_the_heads_panels(bias):
    layer, w, _ = loaded(bias)
    layer.pack(keep_weight=True, native_ops=native.ops())
    ids = torch.tensor([[0, 79, 5], [64, 63, 79]])  # (the first and last rows, either side of a panel's edge)
    assert torch.equal(layer.rows(ids), w[ids])
    with pytest.raises(RuntimeError, match=r"outside 0 \.\. 79"):
        layer.rows(torch.tensor([80]))

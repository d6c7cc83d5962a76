"""gpu/layers/linear.py: a layer holds its weight once. With the native kernels, their panels in float32, bfloat16 or
float16 at every row count, written row range by row range (a stacked weight from several tensors), the [out, in]
parameter a meta shape; without them, the [out, in] parameter on F.linear. References are computed here in float64
from the weights each format holds (a 16-bit weight widened exactly: its float64 value is the float32's): a row's
float32 fma chain is within 1e-5 of sum |x w|. A row's result is the same bits alone and in any batch, and a NaN input
reaches its own row only; a tied embedding reads its rows from the head's panels."""

from __future__ import annotations

import pytest
import torch

from gpu.kernels import native
from gpu.layers.linear import Linear

NATIVE = pytest.mark.skipif(native.ops() is None, reason="no native CPU kernels built (make setup builds them)")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROWS = [1, 2, 3, 7, 64, 65, 200, 600]  # (a decode row, the tiles' sizes and tails, many rows)


def case(out: int, inp: int, rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, inp, generator=g), torch.randn(out, generator=g), torch.randn(rows, inp, generator=g)


def held(out: int, inp: int, dtype: torch.dtype, bias: torch.Tensor | None) -> Linear:
    with torch.device("meta"):
        layer = Linear(inp, out, bias=bias is not None).requires_grad_(False)
    layer.hold_panels(native.ops(), dtype)
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias, requires_grad=False)
    return layer


def within_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    x, w = x.double(), w.double()
    exact = x @ w.t() + (0 if b is None else b.double())
    scale = x.abs() @ w.abs().t() + (0 if b is None else b.abs().double())
    return bool(((y.double() - exact).abs() <= 1e-5 * (scale + 1)).all())


@NATIVE
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(96, 128), (100, 97), (1537, 33)])  # (tails past every panel and vector)
def test_every_row_count_computes_the_held_weight_from_the_panels_alone(dtype, shape):
    w, bias, x = case(*shape, max(ROWS))
    layer = held(*shape, dtype, bias)
    layer.load_rows(w, 0)  # (float32 in: converted to the held dtype, to nearest)
    assert layer.weight.is_meta and layer.native.dtype == dtype and layer.weight.shape == w.shape
    assert layer.native.numel() < w.numel() + 64 * shape[1]  # (at most one panel of padding)
    kept = w.to(dtype)
    for rows in ROWS:
        assert within_rounding(layer(x[:rows]), x[:rows], kept, bias), rows
    assert torch.equal(layer(x.view(2, -1, shape[1])), layer(x).view(2, -1, shape[0]))  # (leading dims kept)


@NATIVE
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_stacked_weight_is_written_part_by_part_at_row_offsets(dtype):
    """q, k and v into one qkv weight, at offsets off the panels' edges: the same bits as packing the stacked whole."""
    parts = [case(n, 72, 1, seed=n)[0].to(dtype) for n in (40, 13, 13)]
    layer = held(66, 72, dtype, None)
    layer.load_rows(parts[0], 0)
    layer.load_rows(parts[1], 40)
    layer.load_rows(parts[2], 53)
    assert torch.equal(layer.native, native.ops().pack(torch.cat(parts)))
    strided = torch.cat(parts).t().contiguous().t()  # (the same values, columns not contiguous: refused)
    with pytest.raises(RuntimeError, match="rows contiguous"):
        native.ops().pack_into(layer.native, strided, 0)
    with pytest.raises(RuntimeError, match="rows past the panels"):
        native.ops().pack_into(layer.native, parts[0], 64 * 2 - 39)


@NATIVE
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_the_same_bits_in_any_batch_and_nan_stays_in_its_row(dtype):
    w, bias, x = case(300, 576, 40, seed=1)
    layer = held(300, 576, dtype, bias)
    layer.load_rows(w, 0)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(40)])
    for size in (2, 3, 7, 40):
        assert torch.equal(torch.cat([layer(x[s : s + size]) for s in range(0, 40, size)]), alone), size
    x[5, 17] = float("nan")
    y = layer(x)
    assert y[5].isnan().all() and not y[torch.arange(40) != 5].isnan().any()


@NATIVE
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tied_embedding_reads_its_rows_from_the_heads_panels(dtype):
    w = case(80, 48, 1)[0].to(dtype)
    layer = held(80, 48, dtype, None)
    layer.load_rows(w, 0)
    ids = torch.tensor([[0, 79, 5], [64, 63, 79]])  # (the first and last rows, either side of a panel's edge)
    assert torch.equal(layer.rows(ids), w.float()[ids])
    with pytest.raises(RuntimeError, match=r"outside 0 \.\. 79"):
        layer.rows(torch.tensor([80]))

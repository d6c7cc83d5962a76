"""The native CPU kernels (gpu/kernels/native): each ISA's build against a float64 reference on awkward shapes (sizes
off
the panel and tile widths), into outputs poisoned first; bitwise batch invariance (a row's result alone, in any
batch, in any tile position) and agreement across ISAs; the torch fallback when the extension is absent."""

import logging

import pytest
import torch

from gpu.kernels import native

BUILT = [isa for isa in native.cpu_isas() if native.ops(isa) is not None]  # (built, and not older than the sources)
pytestmark = pytest.mark.skipif(not BUILT, reason="no native CPU kernels built for this CPU (make setup builds them)")
SHAPES = [(1, 1, 1), (1, 576, 1536), (2, 33, 17), (5, 7, 33), (7, 100, 65), (13, 64, 577), (64, 31, 96), (70, 9, 40)]


@pytest.mark.parametrize("isa", BUILT)
@pytest.mark.parametrize("rows, in_features, out_features", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_a_float64_reference(isa, rows, in_features, out_features, bias):
    ops, g = native.ops(isa), torch.Generator().manual_seed(rows * 1000 + in_features)
    w = torch.randn(out_features, in_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    y = torch.full((rows, out_features), float("nan"))
    ops.linear_out(x, ops.pack(w), b, y)
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    bound = 4 * in_features * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().T + 1)
    assert not y.isnan().any() and ((y.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("isa", BUILT)
def test_a_rows_result_is_the_same_in_any_batch(isa):
    """Each of 40 rows alone, then in batches of every size 1..40 with other rows around it: bitwise equal."""
    ops, g = native.ops(isa), torch.Generator().manual_seed(1)
    w, b = torch.randn(300, 576, generator=g), torch.randn(300, generator=g)
    packed, x = ops.pack(w), torch.randn(40, 576, generator=g)
    alone = torch.cat([ops.linear(x[i : i + 1], packed, 300, b) for i in range(40)])
    for size in range(1, 41):
        for start in range(0, 40, size):
            batch = ops.linear(x[start : start + size], packed, 300, b)
            assert torch.equal(batch, alone[start : start + size]), (size, start)


@pytest.mark.parametrize("isa", BUILT)
def test_row_sums_are_the_same_bits_in_any_batch(isa):
    """row_sum (the logprobs' normalizer in batch-invariant mode) over 49,153 columns (a tail past every SIMD width),
    rows of a wider buffer: a row alone and among 1..8 rows is the same bits, within 1e-6 of a float64 sum; every ISA
    gives the same bits."""
    g = torch.Generator().manual_seed(3)
    x = torch.rand(8, 49168, generator=g)[:, :49153]
    alone = torch.cat([native.ops(isa).row_sum(x[i : i + 1]) for i in range(8)])
    assert all(torch.equal(native.ops(isa).row_sum(x[:size]), alone[:size]) for size in range(1, 9))
    assert torch.allclose(alone.double().squeeze(1), x.double().sum(-1), rtol=1e-6, atol=0)
    assert all(torch.equal(native.ops(other).row_sum(x), alone) for other in BUILT)


@pytest.mark.parametrize("isa", BUILT)
def test_the_gelu_epilogue_is_erfs_gelu_of_the_product_on_every_path(isa):
    """act=1 (an encoder's up projection) against torch's erf GELU in float64 of the kernel's own product (the
    activation alone): within 5e-7 + 2e-6 relative on the tiles and on one row's panel groups, over inputs from -12 to
    12, each ISA the same bits; a tanh GELU (a plausible wrong activation) is 1e-4 away. +inf stays inf, NaN NaN."""
    ops, g = native.ops(isa), torch.Generator().manual_seed(4)
    out = 4096  # (one row: a panel group per thread up to 16 threads, as decode runs it)
    w, b = torch.randn(out, 48, generator=g), torch.randn(out, generator=g)
    packed = ops.pack(w)
    for x in (torch.randn(9, 48, generator=g) * 0.8, torch.randn(1, 48, generator=g) * 0.8):
        product = ops.linear(x, packed, out, b).double()
        got = ops.linear(x, packed, out, b, 1).double()
        assert product.abs().max() > 12 and product.min() < -8  # (the far tails of both sides)
        torch.testing.assert_close(got, torch.nn.functional.gelu(product), atol=5e-7, rtol=2e-6)
        tanh = torch.nn.functional.gelu(product, approximate="tanh")
        assert not torch.allclose(got, tanh, atol=1e-4, rtol=0)
        assert all(torch.equal(native.ops(other).linear(x, native.ops(other).pack(w), out, b, 1), got.float())
                   for other in BUILT)  # fmt: skip
    special = ops.linear(
        torch.tensor([[float("inf")], [float("nan")], [-30.0]]), ops.pack(torch.ones(1, 1)), 1, None, 1
    )
    assert special[0, 0] == float("inf") and special[1, 0].isnan() and -1e-30 < special[2, 0] <= 0


def test_every_isa_computes_the_same_bits():
    if len(BUILT) < 2:
        pytest.skip("this CPU runs one ISA's build")
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(129, 77, generator=g), torch.randn(11, 77, generator=g)
    results = [native.ops(isa).linear(x, native.ops(isa).pack(w), 129, None) for isa in BUILT]
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_an_absent_build_falls_back_with_a_warning(monkeypatch, tmp_path, caplog):
    """(and `available`, which a scheduler asks without loading the library, agrees with what `ops` finds)"""
    assert native.available() == (native.ops() is not None)
    monkeypatch.setattr(native, "BUILD_DIR", tmp_path)
    native.ops.cache_clear()
    try:
        assert not native.available()
        with caplog.at_level(logging.WARNING, "sluice.native"):
            assert native.ops() is None
        assert "is not built (make setup builds it)" in caplog.text
    finally:
        native.ops.cache_clear()


def test_a_model_on_the_native_kernels_computes_what_it_does_on_torchs(tiny_model_dir):
    """`--cpu-kernels native`: every float32 linear layer runs on them (prefill chunks and decode rows), and the
    logits are torch's within float32 rounding."""
    from gpu.batch import BatchSpec
    from gpu.layers.linear import Linear
    from gpu.loading.config import ModelConfig
    from gpu.runner.model_runner import ModelRunner
    from tests.tiny_model import Request, block_pool

    logits = {}
    for kernels in ("torch", "native"):
        runner = ModelRunner(ModelConfig.from_path(tiny_model_dir), device="cpu", dtype="float32", num_blocks=64,
                             block_size=16, cpu_kernels=kernels)  # fmt: skip
        layers = [m for m in runner.model.modules() if isinstance(m, Linear)]
        assert layers and all((m.native is not None) == (kernels == "native") for m in layers)
        pool = block_pool(0, 64)
        reqs = [Request(pool, i, list(range(10 + i, 40 + 3 * i)), 16) for i in range(3)]
        first = runner.execute(BatchSpec(step=0, rows=[r.row(len(r.tokens) - 1) for r in reqs[:2]] + [reqs[2].row()]))
        logits[kernels] = torch.cat([first, runner.execute(BatchSpec(step=1, rows=[r.row() for r in reqs[:2]]))])
    assert torch.allclose(logits["native"], logits["torch"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("isa", BUILT)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_streamed_weights_lie_in_huge_page_aligned_memory(isa, dtype):
    """pack's panels and huge_copy's copies of at least 2 MB start on a 2 MB boundary (where transparent huge pages
    can back them) and hold what they were given; smaller ones are ordinary tensors, still exact."""
    ops, g = native.ops(isa), torch.Generator().manual_seed(5)
    for rows, huge in [(1024, True), (7, False)]:
        t = (torch.randn(rows, 576 * 4, generator=g) * 100).to(dtype)  # (1024 rows: 2.25 MB even as bytes)
        copy = ops.huge_copy(t)
        assert torch.equal(copy, t) and copy.dtype == dtype and copy.data_ptr() != t.data_ptr()
        assert copy.data_ptr() % (2 << 20) == 0 or not huge
        if dtype != torch.uint8:
            packed = ops.pack(t)
            assert packed.data_ptr() % (2 << 20) == 0 or not huge
            assert torch.equal(ops.linear(torch.eye(576 * 4)[:3], packed, rows, None), t.float().T[:3])

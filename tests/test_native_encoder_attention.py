"""The native bidirectional attention of packed encoder inputs (gpu/kernels/native/csrc/encoder_attention.cpp): each
ISA's build against a float64 softmax over each input alone, on awkward shapes (head dims off the vector width and
past one register tile, inputs of 1 token and across the key blocks, an offset bias as MPNet's), with strided
projections; bitwise batch invariance (an input alone or packed among others) and across ISAs; a NaN key reaches its
own input's rows alone; refusals of shapes that do not add up."""

import math

import pytest
import torch

from gpu.kernels import native

BUILT = [isa for isa in native.cpu_isas() if native.ops(isa) is not None]
pytestmark = pytest.mark.skipif(not BUILT, reason="no native CPU kernels built for this CPU (make setup builds them)")


def packed(lens, heads, dim, seed=0, longest=None):
    """q, k, v [T, heads * dim] (views of one [T, 3 * width] projection: strided rows) and a bias [heads, 2L - 1]."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lens), 3 * heads * dim, generator=g)
    bias = torch.randn(heads, 2 * (longest or max(lens)) - 1, generator=g)
    return *qkv.chunk(3, dim=1), bias


def reference(q, k, v, lens, heads, scale, bias):
    out, start = [], 0
    for n in lens:
        qi, ki, vi = (z[start : start + n].double().view(n, heads, -1).transpose(0, 1) for z in (q, k, v))
        scores = qi @ ki.transpose(1, 2) * scale
        if bias is not None:
            offset = torch.arange(n)[None, :] - torch.arange(n)[:, None]
            scores = scores + bias.double()[:, offset + (bias.shape[1] - 1) // 2]
        out.append((scores.softmax(-1) @ vi).transpose(0, 1).reshape(n, -1))
        start += n
    return torch.cat(out)


def run(isa, q, k, v, lens, heads, bias):
    return native.ops(isa).encoder_attention(q, k, v, lens, heads, 1 / math.sqrt(q.shape[1] // heads), bias)


@pytest.mark.parametrize("isa", BUILT)
@pytest.mark.parametrize(
    "lens, heads, dim, with_bias",
    [
        ([1, 5, 17, 33, 64, 100], 12, 32, False),
        ([7, 40, 31], 3, 24, True),
        ([9, 50], 2, 200, True),
        ([300], 4, 16, False),
    ],
)
def test_attention_matches_a_float64_reference(isa, lens, heads, dim, with_bias):
    q, k, v, bias = packed(lens, heads, dim, longest=max(lens) + 3)  # (a bias longer than the inputs need)
    bias = bias if with_bias else None
    want = reference(q, k, v, lens, heads, 1 / math.sqrt(dim), bias)
    torch.testing.assert_close(run(isa, q, k, v, lens, heads, bias).double(), want, atol=3e-6, rtol=1e-5)


@pytest.mark.parametrize("isa", BUILT)
def test_an_inputs_result_is_the_same_bits_alone_or_among_others(isa):
    lens = [3, 70, 1, 33, 129]
    q, k, v, bias = packed(lens, 6, 40)
    together = run(isa, q, k, v, lens, 6, bias).split(lens)
    start = 0
    for i, n in enumerate(lens):
        alone = run(isa, *(z[start : start + n] for z in (q, k, v)), [n], 6, bias)
        assert torch.equal(alone, together[i]), i
        start += n


def test_every_isa_computes_the_same_bits():
    if len(BUILT) < 2:
        pytest.skip("one ISA's build runs on this CPU")
    lens = [16, 200, 45]
    q, k, v, bias = packed(lens, 12, 32, seed=3)
    results = [run(isa, q, k, v, lens, 12, bias) for isa in BUILT]
    assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("isa", BUILT)
def test_a_nan_key_spreads_to_its_own_inputs_rows_alone(isa):
    lens = [20, 30]
    q, k, v, _ = packed(lens, 2, 16)
    k[25, :16] = float("nan")  # (input 1's sixth key, head 0)
    out = run(isa, q, k, v, lens, 2, None)
    assert out[20:, :16].isnan().all() and not out[:20].isnan().any() and not out[20:, 16:].isnan().any()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "lens": [10, 10]}, "lens sum"),
        (lambda a: {**a, "lens": [0, 30]}, "empty input"),
        (lambda a: {**a, "heads": 5}, "H \\* D"),
        (lambda a: {**a, "bias": a["bias"][:, :37].contiguous()}, "longest input"),
        (lambda a: {**a, "k": a["k"][:20]}, "q, k and v"),
        (lambda a: {**a, "q": a["q"][:, :0], "k": a["k"][:, :0], "v": a["v"][:, :0]}, "0 < D"),
    ],
)
def test_shapes_that_do_not_add_up_are_refused(change, message):
    q, k, v, bias = packed([10, 20], 4, 8)
    args = change({"q": q, "k": k, "v": v, "lens": [10, 20], "heads": 4, "bias": bias})
    with pytest.raises(RuntimeError, match=message):
        native.ops(BUILT[0]).encoder_attention(args["q"], args["k"], args["v"], args["lens"], args["heads"], 0.5,
                                               args["bias"])  # fmt: skip

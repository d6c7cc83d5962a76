"""The block formats' native kernels (gpu/kernels/native/csrc/blocks.cpp) on random valid blocks (random bytes, the f16
scales forced finite): `block_rows` is gguf-py's `dequantize` bit for bit; `block_linear` is x @ W^T of those values
within the activations' 8-bit rounding, bounded here from the scheme (per block, half a step of amax / 127 per
element, times |w|; plus float32's 1e-5 of sum |x w|), and does round (the power check: a float32 product is closer
than that bound allows the kernel to be, somewhere); a row's result is the same bits alone and in any batch; a NaN
or infinite input makes its own row NaN and no other; every output is written (into a NaN-filled buffer's columns,
as a stacked layer's parts are) and nothing else; both ISAs give the same bits where the CPU runs both."""

from __future__ import annotations

import ctypes
import mmap
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from gpu.kernels import native
from gpu.layers.linear import BLOCK_FORMATS

pytestmark = pytest.mark.skipif(native.ops() is None, reason="no native CPU kernels built (make setup builds them)")
T = gguf.GGMLQuantizationType
# the byte offsets of each block's f16 scales
SCALES = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q4_K: [0, 2], T.Q5_K: [0, 2],
          T.Q6_K: [208]}  # fmt: skip


def random_blocks(kind, out: int, inp: int, seed: int = 0) -> torch.Tensor:
    elems, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (out, inp // elems, size), dtype=np.uint8)
    for offset in SCALES[kind]:
        d = (rng.uniform(0.5, 1.5, (out, inp // elems)) * 1e-3).astype(np.float16)
        b[:, :, offset : offset + 2] = d.view(np.uint8).reshape(out, -1, 2)
    return torch.from_numpy(b.reshape(out, -1))


def bound(x: torch.Tensor, w: torch.Tensor, block: int) -> torch.Tensor:
    """|error| allowed per output: each activation within half a step (amax of its block / 127) of its value."""
    x, w = x.double(), w.double()
    step = x.view(x.shape[0], -1, block).abs().amax(-1, keepdim=True).expand(-1, -1, block).reshape(x.shape) / 127
    return (step / 2 + 1e-5 * x.abs()) @ w.abs().t() * (1 + 1e-6) + 1e-6


@pytest.mark.parametrize("kind", BLOCK_FORMATS)
def test_the_values_are_gguf_pys(kind):
    blocks = random_blocks(kind, 37, 512)
    got = native.ops().block_rows(blocks, torch.arange(37).flip(0), int(kind), 512).numpy()
    ref = gguf.quants.dequantize(blocks.numpy(), kind)[::-1]
    assert np.array_equal(got.view(np.uint32), np.ascontiguousarray(ref).view(np.uint32))


@pytest.mark.parametrize("kind", BLOCK_FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17])
def test_the_product_is_within_the_activations_rounding(kind, rows):
    blocks, inp = random_blocks(kind, 40, 768, seed=rows), 768
    w = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), kind))
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(40)
    y = native.ops().block_linear(x, blocks, int(kind), bias).double()
    exact = x.double() @ w.double().t() + bias.double()
    activation_block = gguf.GGML_QUANT_SIZES[kind][0]  # (Q8_0's activations for the 32-element formats, Q8_K's)
    assert ((y - exact).abs() <= bound(x, w, activation_block)).all()
    assert (y - exact).abs().max() > 1e-4  # (the power check: the activations really are rounded)


@pytest.mark.parametrize("kind", BLOCK_FORMATS)
def test_a_row_is_the_same_bits_in_any_batch_and_nan_stays_in_its_row(kind):
    blocks = random_blocks(kind, 70, 512, seed=3)
    x = torch.randn(48, 512, generator=torch.Generator().manual_seed(5))
    ops = native.ops()
    alone = torch.cat([ops.block_linear(x[i : i + 1], blocks, int(kind), None) for i in range(48)])
    for size in (2, 3, 5, 8, 17, 24, 48):  # (8 rows and more: the K-quants' many-row tiles, tiles_k.h)
        batched = torch.cat([ops.block_linear(x[s : s + size], blocks, int(kind), None) for s in range(0, 48, size)])
        assert torch.equal(batched, alone), size
    for bad in (float("nan"), float("inf")):
        poisoned = x.clone()
        poisoned[7, 300] = bad
        y = ops.block_linear(poisoned, blocks, int(kind), None)
        assert y[7].isnan().all() and torch.equal(y[torch.arange(48) != 7], alone[torch.arange(48) != 7])
        assert ops.block_linear(poisoned[7:8], blocks, int(kind), None).isnan().all()  # (alone: decode's kernel)


@pytest.mark.parametrize("kind", BLOCK_FORMATS)
@pytest.mark.parametrize("rows", [1, 19])  # (decode's many weight rows at once; tiles and row kernels)
def test_every_output_is_written_into_a_poisoned_buffer(kind, rows):
    """block_linear_out into columns of a NaN-filled y (a stacked layer's parts): each element written, none else."""
    blocks, x = random_blocks(kind, 33, 512, seed=4), torch.randn(rows, 512, generator=torch.Generator().manual_seed(4))
    y = torch.full((rows, 40), float("nan"))
    native.ops().block_linear_out(x, blocks, int(kind), None, y.narrow(1, 5, 33))
    assert not y[:, 5:38].isnan().any() and y[:, :5].isnan().all() and y[:, 38:].isnan().all()
    assert torch.equal(y[:, 5:38], native.ops().block_linear(x, blocks, int(kind), None))


@pytest.mark.skipif(len(native.cpu_isas()) < 2, reason="this CPU runs one ISA")
@pytest.mark.parametrize("kind", BLOCK_FORMATS)
@pytest.mark.parametrize("rows", [1, 38, 40])  # (decode's many weight rows at once; AVX-512's tiles, full and half,
# against AVX2's rows)
def test_both_isas_give_the_same_bits(kind, rows):
    blocks = random_blocks(kind, 50, 512, seed=9)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(9))
    results = [native.ops(isa).block_linear(x, blocks, int(kind), None) for isa in native.cpu_isas()]
    assert all(torch.equal(r, results[0]) for r in results)


def read_between_guards() -> None:
    """Every kernel on weights that end where a readable page ends and begin where one begins (a GGUF's tensors are
    held in place in the mapped file, gpu/loading/gguf_file.py: the last one ends near the mapping's end): a read
    past either end faults (this runs in a child: the test sees its exit)."""
    ops, page = native.ops(), mmap.PAGESIZE
    for kind in BLOCK_FORMATS:
        blocks = random_blocks(kind, 40, 768, seed=2)
        pages = -(-blocks.numel() // page)
        m = mmap.mmap(-1, (pages + 2) * page)
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        libc = ctypes.CDLL(None, use_errno=True)
        for guard in (base, base + (pages + 1) * page):  # (PROT_NONE before and after)
            assert libc.mprotect(ctypes.c_void_p(guard), page, 0) == 0, ctypes.get_errno()
        for start in (page, (pages + 1) * page - blocks.numel()):
            held = torch.frombuffer(m, dtype=torch.uint8, count=blocks.numel(), offset=start).view(blocks.shape)
            held.copy_(blocks)
            for rows in (1, 3, 8, 17, 24, 64):
                x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
                assert torch.equal(
                    ops.block_linear(x, held, int(kind), None), ops.block_linear(x, blocks, int(kind), None)
                )
            assert torch.equal(
                ops.block_rows(held, torch.tensor([0, 39]), int(kind), 768),
                ops.block_rows(blocks, torch.tensor([0, 39]), int(kind), 768),
            )
            del held


def test_no_kernel_reads_outside_the_weights_bytes():
    child = "from tests.test_block_kernels import read_between_guards; read_between_guards()"
    run = subprocess.run([sys.executable, "-c", child], cwd=Path(__file__).parents[1], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]


def test_widths_off_the_blocks_and_unknown_formats_are_refused():
    ops = native.ops()
    with pytest.raises(RuntimeError, match="a multiple of 32"):
        ops.block_linear(torch.randn(1, 48), torch.zeros(4, 34, dtype=torch.uint8), 8, None)
    with pytest.raises(RuntimeError, match="has no kernel"):
        ops.block_linear(torch.randn(1, 256), torch.zeros(4, 84, dtype=torch.uint8), 10, None)  # (Q2_K)

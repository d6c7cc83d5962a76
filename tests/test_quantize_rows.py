"""Float32 rows into GGUF blocks (gpu/kernels/native/csrc/quantize.cpp: an HF checkpoint's `--quantization q8_0 |
q4_0 | q4_k`): Q8_0, Q4_0 and Q5_0 (q4_k's format for widths off 256) are gguf-py's `quantize` bit for bit; Q4_K, which
gguf-py cannot quantize, has each value the nearest of its sub-block's 16 levels (d sc q - dmin m) and a smaller error
than Q4_0 at the same 4.5 bits a weight (its fitted scales and mins pay). All four are llama.cpp's own
quantize_row_*_ref byte for byte on the rows saved in tests/golden (scripts/make_golden_blocks.py wrote them through
ctypes from llama.cpp's libggml-base: llama.cpp is not built where this suite runs; measured once more widely, 2,048
blocks each of normal and heavy-tailed rows: every byte equal). A block with a NaN or an infinity dequantizes to NaN."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from gpu.kernels import native

pytestmark = pytest.mark.skipif(native.ops() is None, reason="no native CPU kernels built (make setup builds them)")
T = gguf.GGMLQuantizationType


def rows(n: int, width: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, width, generator=torch.Generator().manual_seed(seed)) * 3
    x[3, 5], x[4, :32] = 0.0, 0.0  # (a zero, and an all-zero block)
    x[5, 40], x[5, 41] = 50.0, -50.0  # (the largest |x| twice, of both signs: Q4_0 takes the first)
    return x


@pytest.mark.parametrize("kind", [T.Q8_0, T.Q4_0, T.Q5_0])
def test_q8_0_q4_0_and_q5_0_are_gguf_pys(kind):
    x = rows(37, 256, int(kind))
    assert np.array_equal(native.ops().quantize_rows(x, int(kind)).numpy(), gguf.quants.quantize(x.numpy(), kind))


def test_q4_k_values_are_their_sub_blocks_nearest_levels_and_closer_than_q4_0s():
    x = rows(64, 1024, 1)
    blocks = native.ops().quantize_rows(x, int(T.Q4_K)).numpy()
    values = gguf.quants.dequantize(blocks, T.Q4_K).reshape(-1, 32)
    b = blocks.reshape(-1, 144)
    d, dmin = (b[:, s : s + 2].copy().view(np.float16).astype(np.float32) for s in (0, 2))
    sc, m = gguf.quants.Q4_K.get_scale_min(b[:, 4:16])
    ds, dm = (d * sc.astype(np.float32)).reshape(-1, 1), (dmin * m.astype(np.float32)).reshape(-1, 1)
    levels = ds[:, :, None] * np.arange(16, dtype=np.float32) - dm[:, :, None]  # [sub-blocks, 1, 16]
    nearest = np.abs(x.numpy().reshape(-1, 32, 1) - levels).min(-1)
    assert np.allclose(np.abs(x.numpy().reshape(-1, 32) - values), nearest, rtol=0, atol=1e-6)
    error = np.sqrt(((values.reshape(x.shape) - x.numpy()) ** 2).mean())
    q4_0 = gguf.quants.dequantize(gguf.quants.quantize(x.numpy(), T.Q4_0), T.Q4_0)
    assert error < 0.9 * np.sqrt(((q4_0 - x.numpy()) ** 2).mean())  # (0.83x measured)


@pytest.mark.parametrize("kind", [T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_K])
def test_a_block_with_nan_or_inf_is_nan(kind):
    x = rows(8, 512, 2)
    x[1, 300], x[2, 3] = float("nan"), float("inf")
    values = torch.from_numpy(gguf.quants.dequantize(native.ops().quantize_rows(x, int(kind)).numpy(), kind))
    elems = gguf.GGML_QUANT_SIZES[kind][0]
    bad = torch.zeros(8, 512 // elems, dtype=torch.bool)
    bad[1, 300 // elems], bad[2, 3 // elems] = True, True
    per_block = values.view(8, -1, elems).isnan()
    assert per_block.all(-1)[bad].all() and not per_block.any(-1)[~bad].any()


def test_formats_without_a_quantizer_and_widths_off_the_blocks_are_refused():
    with pytest.raises(RuntimeError, match="no quantizer"):
        native.ops().quantize_rows(torch.randn(2, 256), int(T.Q6_K))
    with pytest.raises(RuntimeError, match="a multiple of 256"):
        native.ops().quantize_rows(torch.randn(2, 288), int(T.Q4_K))


@pytest.mark.parametrize("name, kind", [("q8_0", T.Q8_0), ("q4_0", T.Q4_0), ("q5_0", T.Q5_0), ("q4_K", T.Q4_K)])
def test_the_blocks_are_llama_cpps_bytes(name, kind):
    """Against llama.cpp's own quantize_row_*_ref output, saved once (scripts/make_golden_blocks.py): every byte."""
    golden = np.load(Path(__file__).parent / "golden" / "llama_cpp_blocks.npz", allow_pickle=False)
    ours = native.ops().quantize_rows(torch.from_numpy(golden["x"]), int(kind)).numpy()
    assert np.array_equal(ours, golden[name]), f"llama.cpp {golden['version']}"

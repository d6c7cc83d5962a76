"""Weight-only quantization of the linear layers on CPU (`--quantization int8|int4`): less memory to stream per
decoded token, which is what a step of few rows waits on. (16-bit weights are `--dtype bfloat16` / `float16`: the
native kernels' 16-bit panels, gpu/layers/linear.py; `--quantization q8_0` is GGUF's Q8_0 blocks there, quantized at
load, BLOCK_QUANTIZATIONS.)

- int8: symmetric, one scale per output channel.
- int4: asymmetric, a scale and a zero point per group of GROUP input channels.
Few-row calls run the native kernels where built and the input width is a multiple of GROUP
(gpu/kernels/native/csrc/quant.cpp: activations quantized to int8 per row and group, llama.cpp's Q8 / Q4 x Q8 schemes,
integer dot products; int4 1.2-1.6x torch's at 1-8 rows), else torch's `_weight_int8pack_mm` and
`_weight_int4pack_mm_for_cpu` (bfloat16 activations).

How many rows a call has picks the path (state x event, per call):

| rows of the call      | path                                                                             |
|-----------------------|----------------------------------------------------------------------------------|
| <= kernel_rows        | the quantized kernel on the quantized weight                                     |
| more                  | the float32 GEMM (oneDNN's, else x @ W^T) on the weight dequantized once, at load |

(kernel_rows: NATIVE_KERNEL_ROWS[mode] on the native kernels, KERNEL_ROWS[mode] on torch's; -1, no call, not even
of zero rows, for int8 widths off a multiple of 8, where torch's int8 kernel computes wrong sums or crashes; every row
count in batch-invariant mode on the native kernels, whose rows are computed alone (`make_invariant`); the float32
GEMM is the native one where the native kernels are, as a float32 model's.)

Decision (`scripts/bench_quant.py`; figures in docs/performance-history.md, "Engine speed against vLLM's CPU build
(issue 13, first pass)"): quantized serving must never be slower than float32, and above a few rows nothing that keeps
only the quantized weight keeps that promise with torch's CPU ops.
- The kernels re-read and re-convert the weight for every block of 4 rows: they grow linearly with rows and lose to
  float32's pre-packed GEMM past kernel_rows.
- Dequantizing per call costs a pass over the weight plus the GEMM's own packing of the result. Whole (the former
  path): the 49152 x 576 LM head took 142 ms (int8) and 318 ms (int4) at 16 rows against float32's 18.6. Tiled
  (4 MiB dequantized at a time into a kept scratch tile, tried for this decision): still 1.3-2x float32 from 16
  to 256 rows, so prefill and concurrency 16 lost.
So each layer also keeps its weight dequantized in one float32 layout (float32 serving keeps two): 4 bytes per
weight on top of the quantized 1 (int8) or 0.5 (int4; its native kernel's scales 0.25 more), ~0.6x float32's memory
in all (SmolLM2's weights: int8 750 MiB, int4 701 MiB, float32 1134 MiB, before the native int4 scales' 16 MiB
more; the former quantized-only layers: 237 and 252). Dequantized rather than
the original weight, so the model is the same at every batch size. Steps of few rows (decode at low
concurrency) still stream only the quantized weight.
"""

from __future__ import annotations

import sys
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from gpu.layers.linear import Linear

Quantization = Literal["int8", "int4", "q8_0"]
# formats the linear layers hold as blocks (gpu/layers/linear.py), each weight quantized at load as gguf-py does:
# no float32 copy (this module's QuantLinear is int8's and int4's)
BLOCK_QUANTIZATIONS = {"q8_0": 8}
GROUP = 32  # input channels per scale / zero point (int4), per activation scale (the native kernels)
# calls of up to this many rows use the quantized kernel: where it beat float32 (`bench_quant.py --part layers`);
# torch's int4 kernel for AVX-512 did up to 16 rows, its AVX2 one (ATEN_CPU_CAPABILITY=avx2) up to 8
KERNEL_ROWS: dict[str, int] = {"int8": 8, "int4": 16 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 8}
# the native kernels' (measured against float32's native kernel on SmolLM2's layers, AVX2 EPYC: int4 1.17x at 8 rows,
# ~1.0x at 12; int8 1.26x at 16, ~1.07x at 24: docs/performance-history.md, issue 36's fourth part)
NATIVE_KERNEL_ROWS: dict[str, int] = {"int8": 16, "int4": 8}

_MKLDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's layout of a float32 [out, in] weight for `onednn_linear` (None where oneDNN is missing)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None) if _MKLDNN else None


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def transposed_linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + bias from the [in, out] contiguous copy."""
    return x @ weight_t if bias is None else torch.addmm(bias, x, weight_t)


class QuantLinear(nn.Module):
    """A linear layer holding its quantized weight, and that weight dequantized once in one float32 layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mode: Quantization, native_ops=None):
        super().__init__()
        self.mode, self.out_features, self.in_features = mode, *weight.shape
        grouped = self.in_features % GROUP == 0  # (the native quantized kernels' groups)
        self.native_ops = native_ops if grouped else None
        self.kernel_rows = (KERNEL_ROWS if self.native_ops is None else NATIVE_KERNEL_ROWS)[mode]
        if self.native_ops is None and mode == "int8" and self.in_features % 8:
            self.kernel_rows = -1  # (torch's int8 kernel reads past widths off a multiple of 8: wrong sums, or a crash)
        self.bias = bias
        w = weight.detach().float()
        if mode == "int8":
            scale = w.abs().amax(1).clamp(min=1e-12) / 127
            self.qweight = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
            self.scales = scale.to(torch.bfloat16)
            dense = self.qweight.float() * self.scales.float()[:, None]
        else:
            if self.in_features % GROUP:
                raise ValueError(f"int4 needs input features in multiples of {GROUP}, got {self.in_features}")
            g = w.view(self.out_features, -1, GROUP)
            lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
            scale = ((hi - lo) / 15).clamp(min=1e-12)
            q = ((g - lo) / scale).round().clamp(0, 15).to(torch.int32)
            zero = lo + 8 * scale  # the kernel computes (q - 8) * scale + zero
            scale, zero = scale.to(torch.bfloat16), zero.to(torch.bfloat16)
            if self.native_ops is not None:  # byte j of group pair p: q[2p][j] | q[2p + 1][j] << 4; [s; z - 8 s]
                pairs = F.pad(q, (0, 0, 0, q.shape[1] % 2)).view(self.out_features, -1, 2, GROUP)
                self.qweight = (pairs[:, :, 0] | pairs[:, :, 1] << 4).to(torch.uint8).view(self.out_features, -1)
                s = scale.float().squeeze(-1)
                self.scales = torch.stack([s, zero.float().squeeze(-1) - 8 * s], 1)  # [out, 2, groups] float32
            else:
                self.qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(self.out_features, -1), 1)
                self.scales = torch.cat([scale, zero], -1).permute(1, 0, 2).contiguous()  # [groups, out, 2]
            dense = ((q - 8) * scale.float() + zero.float()).view(self.out_features, self.in_features)
        if self.native_ops is not None:  # (in the memory the native kernels stream weights from)
            self.qweight, self.scales = native_ops.huge_copy(self.qweight), native_ops.huge_copy(self.scales)
        # for calls of more than kernel_rows rows: the native float32 kernel's panels, else oneDNN's or [in, out]
        self.native = native_ops.pack(dense) if self.native_ops is not None else None
        self.native_rows = sys.maxsize
        self.packed = onednn_pack(dense.float()) if self.native is None else None
        self.weight_t = dense.float().t().contiguous() if self.native is None and self.packed is None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] <= self.kernel_rows:
            y = self.kernel(flat)
            y = y if self.bias is None else y.add_(self.bias)
        elif self.native is not None:
            y = self.native_ops.linear(flat.contiguous(), self.native, self.out_features, self.bias)
        elif self.packed is not None:
            y = onednn_linear(flat, self.packed, self.bias)
        else:
            y = transposed_linear(flat, self.weight_t, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def make_invariant(self) -> None:
        """Every row count on the native quantized kernels, each row computed alone (the dequantized panels, never
        read again, freed)."""
        self.kernel_rows, self.native = sys.maxsize, None

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T by the quantized kernel ([rows, in] float32 in, float32 out): the native ones (int8 activations)
        where given, else torch's (bfloat16 activations)."""
        if self.native_ops is not None:
            kernel = self.native_ops.int4_linear if self.mode == "int4" else self.native_ops.int8_linear
            return kernel(x.contiguous(), self.qweight, self.scales, None)
        xb = x.to(torch.bfloat16)
        if self.mode == "int8":
            return torch.ops.aten._weight_int8pack_mm(xb, self.qweight, self.scales).float()
        return torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.qweight, GROUP, self.scales).float()


def quantize_model(model: nn.Module, mode: Quantization, native_ops=None) -> None:
    """Replace every Linear of `model` (the LM head too; a tied embedding keeps its float32 table) in place; their
    few-row calls run the native kernels where `native_ops` are given (gpu/kernels/native)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, QuantLinear(child.weight, child.bias, mode, native_ops))


def make_invariant(model: nn.Module) -> None:
    """Batch-invariant mode: every linear layer takes the native kernels at any number of rows (a quantized layer its
    quantized kernel, whose rows are computed alone too), so a row's result is the same bits in any step; before the
    native layer loop is built (gpu/runner/model_runner.py), which copies the row counts (gpu/runner/native_loop.py).
    ValueError where a layer cannot (not float32 on a CPU, not built, a quantized width off the kernels' groups)."""
    layers = [m for m in model.modules() if isinstance(m, Linear | QuantLinear)]
    if not layers or any(m.native is None and getattr(m, "blocks", None) is None for m in layers):
        raise ValueError(
            "batch-invariant mode needs every linear layer on the native CPU kernels: float32 activations on a CPU, "
            "the kernels built (make setup), quantized input widths in multiples of 32"
        )
    for m in layers:
        if isinstance(m, QuantLinear):  # (a layer's panels or blocks serve every row count already)
            m.make_invariant()

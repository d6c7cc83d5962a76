"""Weight-only quantization of the linear layers on CPU (`--quantization int8|int4`): less memory to stream per
decoded token, which is what a batch-1 step waits on.

- int8: symmetric, one scale per output channel; torch's `_weight_int8pack_mm` (bfloat16 activations).
- int4: asymmetric, a scale and a zero point per group of GROUP input channels; torch's
  `_weight_int4pack_mm_for_cpu` (bfloat16 activations).
Both kernels are fast for a few rows only (measured on AVX2: int8 with float32 activations is ~8x slower than the
float32 matmul, so activations go through bfloat16); a step of more than QUANT_ROWS rows (prefill) multiplies by the
dequantized weight instead, rebuilt per call and dropped after it, so no float32 copy stays resident.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

Quantization = Literal["int8", "int4"]
GROUP = 32  # int4: input channels per scale / zero point
QUANT_ROWS = 8  # steps of up to this many rows use the quantized kernel


class QuantLinear(nn.Module):
    """A bias-free-or-not linear layer holding only its quantized weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mode: Quantization):
        super().__init__()
        self.mode, self.out_features, self.in_features = mode, *weight.shape
        self.bias = bias
        w = weight.detach().float()
        if mode == "int8":
            scale = w.abs().amax(1).clamp(min=1e-12) / 127
            self.qweight = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
            self.scales = scale.to(torch.bfloat16)
        else:
            if self.in_features % GROUP:
                raise ValueError(f"int4 needs input features in multiples of {GROUP}, got {self.in_features}")
            g = w.view(self.out_features, -1, GROUP)
            lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
            scale = ((hi - lo) / 15).clamp(min=1e-12)
            q = ((g - lo) / scale).round().clamp(0, 15).to(torch.int32).view(self.out_features, -1)
            zero = lo + 8 * scale  # the kernel computes (q - 8) * scale + zero
            self.qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            sz = torch.stack([scale.flatten(1), zero.flatten(1)], -1).transpose(0, 1)  # [groups, out, 2]
            self.scales = sz.contiguous().to(torch.bfloat16)
            q = q.to(torch.uint8)  # for dequantize(), two per byte (the kernel's packed layout is its own)
            self.nibbles = q[:, 0::2] | (q[:, 1::2] << 4)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the quantized one stands for, [out, in]."""
        if self.mode == "int8":
            return self.qweight.float() * self.scales.float()[:, None]
        sz = self.scales.float().transpose(0, 1)  # [out, groups, 2]
        q = torch.stack([self.nibbles & 15, self.nibbles >> 4], -1).float().view(self.out_features, -1, GROUP)
        return ((q - 8) * sz[..., :1] + sz[..., 1:]).view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] > QUANT_ROWS:
            return F.linear(x, self.dequantize(), self.bias)
        xb = x.to(torch.bfloat16)
        if self.mode == "int8":
            y = torch.ops.aten._weight_int8pack_mm(xb, self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.qweight, GROUP, self.scales)
        y = y.float()
        return y if self.bias is None else y + self.bias


def quantize_model(model: nn.Module, mode: Quantization) -> None:
    """Replace every Linear of `model` (the LM head too; a tied embedding keeps its float32 table) in place."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, QuantLinear(child.weight, child.bias, mode))

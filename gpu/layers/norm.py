"""RMSNorm, optionally added to the residual stream first (vLLM's fused_add_rms_norm): `norm(x)` returns the normed
x; `norm.add(x, residual)` returns (normed sum, sum), the sum being the new residual (residual None: (norm(x), x)). Computed by the layer's kernel set
(gpu/kernels/reference.py, where the families' two rounding orders are written out); `offset` 1 scales by (1 + w)
(Gemma), 0 by w (Llama)."""

from __future__ import annotations

import torch
from torch import nn

from gpu.kernels.reference import TORCH_KERNELS


class RMSNorm(nn.Module):
    kernels = TORCH_KERNELS

    def __init__(self, size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, None, self.weight, self.eps, self.offset)[0]

    def add(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.rms_norm(x, residual, self.weight, self.eps, self.offset)

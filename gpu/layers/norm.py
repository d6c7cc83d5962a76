"""RMSNorm, as HF transformers computes it for each family.

- Llama style (`offset=0`): normalised in float32, cast back, then scaled by the weight in the model's dtype.
- Gemma style (`offset=1`): the weight is stored as w and scales by (1 + w), in float32, before the cast.
Float32 input is one fused op either way (the two orders round alike there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = self.weight.shape
        if x.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight + self.offset if self.offset else self.weight, self.eps)
        if self.offset:
            return (F.rms_norm(x.float(), shape, eps=self.eps) * (self.weight.float() + self.offset)).to(x.dtype)
        return self.weight * F.rms_norm(x.float(), shape, eps=self.eps).to(x.dtype)

"""The native kernel set (gpu/kernels/reference.py): the decoder's small steps as one native op each
(gpu/kernels/native/csrc/fused.cpp), chosen with the native attention backend (CPU, float32). Each equals its torch step
up to float32 rounding (the same formulas; torch's vectorised sums and exponentials round differently), and a row's
result never depends on the other rows of the step.
"""

from __future__ import annotations

import torch

ACT_IDS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1}


class NativeKernels:
    def __init__(self, ops) -> None:
        self.ops = ops

    def rms_norm(self, x, residual, weight, eps: float, offset: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The sum is written into `residual` (as the Triton set's)."""
        return self.ops.add_rms_norm(x, residual, weight, eps, offset), x if residual is None else residual

    def rope_and_write_kv(self, q, k, v, cos, sin, kv: tuple[torch.Tensor, torch.Tensor], slots) -> torch.Tensor:
        """q is rotated in place (a projection's fresh output, read by nothing else)."""
        self.ops.rope_and_write_kv(q, k, v, cos, sin, *kv, slots)
        return q

    def act_and_mul(self, x: torch.Tensor, act: str) -> torch.Tensor:
        return self.ops.act_and_mul(x, ACT_IDS[act])

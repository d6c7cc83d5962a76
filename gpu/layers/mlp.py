"""The gated MLP, down(act(gate(x)) * up(x)): SwiGLU (silu) or GeGLU (tanh GELU), as the config's hidden_act says.

gate and up are two weights in most checkpoints, one [2 * intermediate, hidden] `gate_up_proj` in Phi-3's; the MLP
holds one gate_up_proj either way (the loader writes the two into its rows, gpu/loading/weights.py), so the model runs
one GEMM and one act-and-mul step of its kernel set.
Under tensor parallelism a rank holds a slice of the intermediate dim (gpu/layers/parallel.py) and all-reduces down's
output."""

from __future__ import annotations

import torch
from torch import nn

from gpu.distributed.group import current
from gpu.kernels.reference import TORCH_KERNELS
from gpu.layers.linear import Linear
from gpu.layers.parallel import column, row, split, stacked


class GatedMLP(nn.Module):
    kernels = TORCH_KERNELS

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False, fused: bool = False) -> None:
        super().__init__()
        self.tp = current()
        start, n = split(intermediate, "intermediate size", self.tp)
        if fused:  # [gate; up] rows
            ranges = [(start, n), (intermediate + start, n)]
            self.gate_up_proj = column(Linear(hidden, 2 * n, bias=bias), ranges, 2 * intermediate)
        else:
            self.gate_up_proj = stacked(Linear(hidden, 2 * n, bias=bias), [([(start, n)], intermediate)] * 2)
        self.down_proj = row(Linear(n, hidden, bias=bias), [(start, n)], intermediate, self.tp)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.kernels.act_and_mul(self.gate_up_proj(x), self.act)))

"""Linear layers with weight layouts chosen per batch size on CPU.

Measured on this class of machine (AMD EPYC AVX2, fp32, 1 thread, SmolLM2's shapes):
- One row (batch-1 decode) reads the whole weight once: `x @ W^T` from a [in, out] contiguous copy streams it
  at ~14 GB/s where torch's `F.linear` on the [out, in] weight gets ~12 (30 layers: 29.6 vs 35 ms; the 576 x 49152
  LM head: 5.5 vs 10.2 ms).
- 2-32 rows: MKL re-packs the whole weight on every call; a weight packed once by oneDNN wins (LM head, 5 rows:
  14.8 vs 25.5 ms).
- More rows (prefill): `x @ W^T` from the [in, out] copy matches or beats `F.linear` (1536 x 576, 512 rows: 13.7
  vs 22 ms).
So `pack()` keeps the [in, out] copy and the oneDNN one, and the parameter becomes a view of the former (no third
copy; a weight shared with the embedding keeps its own storage, see `keep_weight`). Elsewhere (CUDA, other dtypes)
nothing changes.
With the native kernels (gpu/kernels/native: the default where built; `--cpu-kernels torch` turns them off) the
layer holds its weight once, in their panels, at every row count: every row's result is the same bits whatever the
batch around it (batch invariance by construction), at 1.07-1.3x torch's best speed for up to 64 rows (AMD EPYC, AVX2:
docs/performance-history.md, "Native paged attention, and the native kernels by default (issue 36, third part)") and
0.85-0.95x MKL's at 128-512 rows (Intel Xeon, AVX-512, 2 threads, SmolLM2's shapes, torch 2.13). The [out, in]
parameter is then a meta tensor (its shape alone); a tied embedding reads its rows from the panels (`rows`).
gpu/layers/quant.py keeps its dequantized weights in one of these layouts through the same functions (`onednn_pack`,
`onednn_linear`, `transposed_linear`).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

PACKED_ROWS = range(2, 33)  # batch sizes that use the oneDNN-packed weight

_MKLDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's layout of a float32 [out, in] weight for `onednn_linear` (None where oneDNN is missing)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None) if _MKLDNN else None


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def transposed_linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + bias from the [in, out] contiguous copy."""
    return x @ weight_t if bias is None else torch.addmm(bias, x, weight_t)


class Linear(nn.Linear):
    packed: torch.Tensor | None = None  # oneDNN's layout, for PACKED_ROWS
    weight_t: torch.Tensor | None = None  # [in, out] contiguous, for the other batch sizes
    native_ops = None  # the native kernels (gpu/kernels/native) ...
    native: torch.Tensor | None = None  # ... and the weight in their layout (its only copy), for every row count
    native_rows = sys.maxsize  # (the native loop reads it: gpu/runner/native_loop.py)

    def pack(self, keep_weight: bool = False, native_ops=None) -> None:
        """Lay the (loaded) weight out for CPU float32 matmuls: in the native kernels' panels alone, given their ops;
        otherwise the two torch layouts, and keep_weight: the [out, in] storage is shared (a tied embedding reads it
        row by row) and must stay, else the parameter becomes a view of the [in, out] copy."""
        if not (self.weight.device.type == "cpu" and self.weight.dtype == torch.float32):
            return
        if native_ops is not None:
            self.native_ops, self.native = native_ops, native_ops.pack(self.weight.detach())
            self.weight = nn.Parameter(torch.empty(self.weight.shape, device="meta"), requires_grad=False)
            return
        self.weight_t = self.weight.detach().t().contiguous()
        self.packed = onednn_pack(self.weight)
        if not keep_weight:
            self.weight.data = self.weight_t.t()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight, float32 (ids.shape + (in,)): a tied embedding's lookup."""
        if self.native is not None:
            return self.native_ops.panel_rows(self.native, ids, self.out_features)
        return F.embedding(ids, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            y = self.native_ops.linear(x.reshape(-1, self.in_features).contiguous(), self.native, self.out_features,
                                       self.bias)  # fmt: skip
            return y.view(*x.shape[:-1], self.out_features)
        if self.weight_t is None or x.dim() != 2:
            return F.linear(x, self.weight, self.bias)
        if self.packed is not None and x.shape[0] in PACKED_ROWS:
            return onednn_linear(x, self.packed, self.bias)
        return transposed_linear(x, self.weight_t, self.bias)

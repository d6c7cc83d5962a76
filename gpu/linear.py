"""Linear layers with a oneDNN-packed copy of the weight for small batches on CPU.

torch's CPU linear (MKL sgemm) re-packs the whole weight matrix on every call once a batch has more than
one row: measured on SmolLM2's LM head (576 -> 49152, fp32, 1 thread), 9.6 ms for 1 row but 25.5 ms for
5 and 27.0 ms for 8, where a weight packed once by oneDNN takes 14.8 and 16.0 ms. Small batches are the
decode steps of a few requests and speculative verification (K + 1 rows). One row keeps torch's gemv
(fastest there) and large batches (prefill, where packing is amortised) torch's sgemm. The packed copy
doubles the weights' memory on CPU; elsewhere (CUDA, other dtypes) nothing is packed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACKED_ROWS = range(2, 33)  # batch sizes that use the packed weight

_MKLDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear(nn.Linear):
    packed: torch.Tensor | None = None

    def pack(self) -> None:
        """Pack the (loaded) weight for small batches, where that pays (CPU, float32, oneDNN present)."""
        if _MKLDNN and self.weight.device.type == "cpu" and self.weight.dtype == torch.float32:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dim() == 2 and x.shape[0] in PACKED_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

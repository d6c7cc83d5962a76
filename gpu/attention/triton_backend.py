"""The triton attention backend: paged attention reading K/V through the block table (gpu/kernels/triton/attention.py)
and the Triton kernel set (gpu/kernels/triton/fused.py); it needs nothing beyond the common metadata (query_start_loc,
seq_lens, block_tables, max_query_len, max_seq_len).

On CPU its kernels run in the Triton interpreter (slow: for tests and debugging). `@triton.jit` reads TRITON_INTERPRET
when it decorates, triton.language's own helpers included, so the backend sets it before its first import of triton,
and it holds for the process; where triton was imported already (torch._dynamo imports it), it must come from the
environment (tests/conftest.py sets it), and the backend says so rather than fail inside a kernel. Triton is imported
only when this backend is made: the other backends' startup does not pay for it.
"""

from __future__ import annotations

import os
import sys

import torch

from gpu.attention.metadata import AttentionMetadata


class TritonAttention:
    def __init__(self, device: torch.device) -> None:
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            if "triton.language" in sys.modules:  # decorated compiled already (torch._dynamo imports it, for one)
                raise RuntimeError(
                    "the triton attention backend on CPU runs in the Triton interpreter, but triton was imported in"
                    " this process before the backend was chosen: set TRITON_INTERPRET=1 in the environment"
                )
            os.environ["TRITON_INTERPRET"] = "1"
        from gpu.kernels.triton import attention, fused

        self.kernel = attention.paged_attention
        self.kernels = fused.TritonKernels()

    def plan(self, query_lens, seq_lens, query_start_loc, block_tables) -> list:
        return []

    def finish(self, meta: AttentionMetadata, plans: list, uploaded: list[dict[str, torch.Tensor]]) -> None:
        pass

    def __call__(self, q, kv, meta: AttentionMetadata, scale: float, window: int | None, softcap: float | None):
        args = (meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.max_query_len, meta.max_seq_len)
        return self.kernel(q, *kv, *args, scale, window, softcap)

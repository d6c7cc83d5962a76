"""The attention backend: chosen once, at load, from the device and `--attention-backend`; never re-decided in the
forward.

A backend is what the layers call, `backend(q, kv, meta, scale, window, softcap)` -> [T, Hq, D] (gpu/weights.py
hands it to every attention layer at load), its `kernels`, the set of small fused steps the layers call around it
(gpu/layers/kernels.py: the torch steps, one Triton kernel each, or one native op each),
and what the runner asks for the step's metadata: `plan(query_lens,
seq_lens, query_start_loc, block_tables)` returns host-side plans, each with an `arrays` dict uploaded with the step's
own arrays, and `finish(meta, plans, uploaded)` attaches the uploaded tensors to the AttentionMetadata.

- torch (gpu/attention.py: TorchAttention): the reference, always there; segment plans (or flash-attn's metadata).
- triton (gpu/kernels/triton_attention.py): paged attention reading K/V through the block table; it needs nothing
  beyond the common metadata (query_start_loc, seq_lens, block_tables, max_query_len, max_seq_len).
- native (gpu/attention_native.py): CPU, float32: gpu/native's batch-invariant kernel for short rows (every row in
  batch-invariant mode), the torch path for prefills; the native kernel set (gpu/native/kernels.py).

Default: triton on CUDA; native on a CPU for float32 where the native kernels are built; torch elsewhere. On CPU the
triton backend runs its kernels in the Triton interpreter (slow: for tests and debugging). `@triton.jit` reads
TRITON_INTERPRET when it decorates, triton.language's own helpers included, so the backend sets it before its first
import of triton, and it holds for the process; where triton was imported already (torch._dynamo imports it), it must
come from the environment (tests/conftest.py sets it), and the backend says so rather than fail inside a kernel.
Triton is imported only when the backend is triton: the torch path's startup does not pay for it.
"""

from __future__ import annotations

import os
import sys
from typing import Literal, Protocol

import numpy as np
import torch

from gpu import native
from gpu.attention import AttentionMetadata, TorchAttention
from gpu.attention_native import MAX_GROUP, MAX_HEAD_DIM, NativeAttention

BackendName = Literal["torch", "triton", "native"]


class AttentionBackend(Protocol):
    kernels: object  # gpu/layers/kernels.py: TorchKernels, TritonKernels or NativeKernels

    def plan(self, query_lens: np.ndarray, seq_lens: np.ndarray, query_start_loc: np.ndarray, block_tables) -> list:
        """The step's host-side plans: objects with an `arrays` dict of numpy arrays to upload."""

    def finish(self, meta: AttentionMetadata, plans: list, uploaded: list[dict[str, torch.Tensor]]) -> None:
        """Attach the plans' uploaded tensors (in plan order) to `meta`."""

    def __call__(self, q, kv, meta: AttentionMetadata, scale: float, window: int | None, softcap: float | None):
        """q [T, Hq, D] over the paged cache kv = (K, V), this step's keys and values already written."""


class TritonAttention:
    def __init__(self, device: torch.device) -> None:
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            if "triton.language" in sys.modules:  # decorated compiled already (torch._dynamo imports it, for one)
                raise RuntimeError(
                    "the triton attention backend on CPU runs in the Triton interpreter, but triton was imported in"
                    " this process before the backend was chosen: set TRITON_INTERPRET=1 in the environment"
                )
            os.environ["TRITON_INTERPRET"] = "1"
        from gpu.kernels import triton_attention, triton_fused

        self.kernel = triton_attention.paged_attention
        self.kernels = triton_fused.TritonKernels()

    def plan(self, query_lens, seq_lens, query_start_loc, block_tables) -> list:
        return []

    def finish(self, meta: AttentionMetadata, plans: list, uploaded: list[dict[str, torch.Tensor]]) -> None:
        pass

    def __call__(self, q, kv, meta: AttentionMetadata, scale: float, window: int | None, softcap: float | None):
        args = (meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.max_query_len, meta.max_seq_len)
        return self.kernel(q, *kv, *args, scale, window, softcap)


def choose_attention_backend(
    name: BackendName | None,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    invariant: bool = False,
    heads: tuple[int, int, int] = (1, 1, 64),
) -> AttentionBackend:
    """The backend `name`, or the device's default (None): triton on CUDA; on a CPU, native for float32 where its
    kernels are built and hold the model's `heads` (query heads, KV heads, head dim), torch otherwise (a warning says
    why the kernels are absent). invariant: batch-invariant attention (the native backend on every row)."""
    cpu_float32 = device.type == "cpu" and dtype == torch.float32 and NativeAttention.holds(*heads)
    if name is None:
        ops = native.ops() if cpu_float32 else None
        name = "triton" if device.type == "cuda" else "native" if ops is not None or invariant else "torch"
    if name not in ("torch", "triton", "native"):
        raise ValueError(f"unknown attention backend {name!r} (torch, triton or native)")
    if invariant and name != "native":
        raise ValueError("batch-invariant mode runs on a CPU with the native attention backend")
    if name == "native":
        if not cpu_float32 or native.ops() is None:
            raise ValueError(
                "the native attention backend runs float32 on a CPU with the native kernels built, for up to "
                f"{MAX_GROUP} query heads a KV head and head dims up to {MAX_HEAD_DIM}"
            )
        return NativeAttention(native.ops(), block_size, invariant)
    return TorchAttention(device, dtype, block_size) if name == "torch" else TritonAttention(device)

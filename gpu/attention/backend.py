"""The attention backend: chosen once, at load, from the device and `--attention-backend`; never re-decided in the
forward.

A backend is what the layers call, `backend(q, kv, meta, scale, window, softcap)` -> [T, Hq, D] (gpu/loading/weights.py
hands it to every attention layer at load), its `kernels`, the set of small fused steps the layers call around it
(gpu/kernels/reference.py: the torch steps, one Triton kernel each, or one native op each), and what the runner asks
for the step's metadata: `plan(query_lens, seq_lens, query_start_loc, block_tables)` returns host-side plans, each
with an `arrays` dict uploaded with the step's own arrays, and `finish(meta, plans, uploaded)` attaches the uploaded
tensors to the AttentionMetadata.

- torch (torch_backend.py): the reference, always there; segment plans (or flash-attn's metadata).
- triton (triton_backend.py): the Triton paged-attention kernel; on CPU in the Triton interpreter.
- native (native_backend.py): CPU, float32: the native batch-invariant kernel for short rows (every row in
  batch-invariant mode), the torch path for prefills; the native kernel set (gpu/kernels/native/kernels.py).

Default: triton on CUDA; native on a CPU for float32 where the native kernels are built; torch elsewhere.
"""

from __future__ import annotations

from typing import Literal, Protocol

import numpy as np
import torch

from gpu.attention.metadata import AttentionMetadata
from gpu.attention.native_backend import MAX_GROUP, MAX_HEAD_DIM, NativeAttention
from gpu.attention.torch_backend import TorchAttention
from gpu.attention.triton_backend import TritonAttention
from gpu.kernels import native

BackendName = Literal["torch", "triton", "native"]


class AttentionBackend(Protocol):
    kernels: object  # gpu/kernels/reference.py: TorchKernels, TritonKernels or NativeKernels

    def plan(self, query_lens: np.ndarray, seq_lens: np.ndarray, query_start_loc: np.ndarray, block_tables) -> list:
        """The step's host-side plans: objects with an `arrays` dict of numpy arrays to upload."""

    def finish(self, meta: AttentionMetadata, plans: list, uploaded: list[dict[str, torch.Tensor]]) -> None:
        """Attach the plans' uploaded tensors (in plan order) to `meta`."""

    def __call__(self, q, kv, meta: AttentionMetadata, scale: float, window: int | None, softcap: float | None):
        """q [T, Hq, D] over the paged cache kv = (K, V), this step's keys and values already written."""


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

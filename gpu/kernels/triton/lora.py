"""LoRA deltas in Triton (the GPU path's pair; gpu/layers/lora.py's contract, the native CPU kernel's signature):

    lora_add(x, y, slots, a, b, parts): y[t, :] += Bᵀ[s] · (A[s] · x[t]) for every token t whose slot s = slots[t]
    is >= 0

x [T, in], y [T, out] (rows contiguous, any float dtype: the sums in float32, y written in its own), slots int64 [T],
A [S, P r, in], Bᵀ [S, r, out], `parts` the P stacked parts' first columns and out (P <= 3: q, k, v). Two kernels, a
program per (token, tile): the shrink's (token, BLOCK_J rows of A) dot products into a float32 scratch [T, P r], then
the expand's (token, BLOCK_O columns): each column's part picks its r ranks. Every program reads its slot from the
device (no host-side grouping), so a decode step's launches are the same whatever the adapters: CUDA-graph safe.
A token's delta does not depend on the tokens beside it (each program reads its own token only). Tested under
TRITON_INTERPRET=1 against the torch path (tests/test_lora_kernels.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_J, BLOCK_K, BLOCK_O = 16, 128, 64


@triton.jit
def _shrink(x, a, slots, xa, IN, PR, stride_x, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr):
    t, jb = tl.program_id(0), tl.program_id(1)
    s = tl.load(slots + t)
    width = tl.where(s >= 0, IN, 0)  # (the base model's token: nothing read)
    s = tl.maximum(s, 0)
    j = jb * BLOCK_J + tl.arange(0, BLOCK_J)
    acc = tl.zeros([BLOCK_J], dtype=tl.float32)
    for k0 in range(0, IN, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x + t.to(tl.int64) * stride_x + k, mask=k < width, other=0.0).to(tl.float32)
        rows = (s * PR + j[:, None]).to(tl.int64) * IN + k[None, :]
        av = tl.load(a + rows, mask=(j[:, None] < PR) & (k[None, :] < width), other=0.0).to(tl.float32)
        acc += tl.sum(av * xv[None, :], axis=1)
    tl.store(xa + t.to(tl.int64) * PR + j, acc, mask=j < PR)


@triton.jit
def _expand(xa, b, slots, y, OUT, PR, R, stride_y, P1, P2, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr):
    t, ob = tl.program_id(0), tl.program_id(1)
    s = tl.load(slots + t)
    columns = tl.where(s >= 0, OUT, 0)  # (the base model's token: nothing added)
    s = tl.maximum(s, 0)
    o = ob * BLOCK_O + tl.arange(0, BLOCK_O)
    part = (o >= P1).to(tl.int32) + (o >= P2).to(tl.int32)
    r = tl.arange(0, BLOCK_R)
    both = (o[:, None] < columns) & (r[None, :] < R)
    ranks = tl.load(xa + t.to(tl.int64) * PR + part[:, None] * R + r[None, :], mask=both, other=0.0)
    bt = tl.load(b + (s * R + r[None, :]).to(tl.int64) * OUT + o[:, None], mask=both, other=0.0).to(tl.float32)
    d = tl.sum(ranks * bt, axis=1)
    keep = o < columns
    here = y + t.to(tl.int64) * stride_y + o
    yv = tl.load(here, mask=keep, other=0.0)
    tl.store(here, (yv.to(tl.float32) + d).to(yv.dtype), mask=keep)


def lora_add(x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor, parts) -> None:
    """The module docstring's contract."""
    x = x.contiguous()
    num_tokens, width = x.shape
    stacked, rank, out = a.shape[1], b.shape[1], y.shape[1]
    if len(parts) > 4 or parts[0] != 0 or parts[-1] != out or y.stride(1) != 1:
        raise ValueError("lora_add: at most three stacked parts, from column 0 to out, and y's rows contiguous")
    firsts = [*parts[1:-1], out, out][:2]
    xa = torch.empty(num_tokens, stacked, device=x.device, dtype=torch.float32)
    _shrink[(num_tokens, triton.cdiv(stacked, BLOCK_J))](
        x, a, slots, xa, width, stacked, x.stride(0), BLOCK_J=BLOCK_J, BLOCK_K=BLOCK_K
    )
    _expand[(num_tokens, triton.cdiv(out, BLOCK_O))](
        xa, b, slots, y, out, stacked, rank, y.stride(0), firsts[0], firsts[1],
        BLOCK_O=BLOCK_O, BLOCK_R=triton.next_power_of_2(rank),
    )  # fmt: skip

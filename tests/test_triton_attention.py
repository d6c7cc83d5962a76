"""gpu/kernels/triton/attention.py against the torch path (gpu/attention/torch_backend.py) and a float64 reference, on
random
caches behind shuffled block tables: GQA 1/3/8, head_dim 24 and 64, contexts of 1 to 40 blocks with partial last
blocks, decode steps (split-K past 256 keys), mixed steps (prefill, chunked prefill on cached blocks, decode), windows
and soft-caps, fp32/fp16/bf16, block sizes 8 to 64. Outputs and the split-K scratch are poisoned with NaN first, so an
unwritten element fails. Offsets past 2^31 elements: q and out far apart in a lazily allocated buffer, and the
split-K scratch's index at a shape too large to run. In the Triton interpreter on CPU (small shapes); compiled, on
CUDA, when there is one (their sm_90 compile: tests/test_triton_compile.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from gpu.attention.metadata import AttentionMetadata
from gpu.attention.torch_backend import TorchAttention
from gpu.kernels.triton.attention import (
    INTERPRETED,
    MAX_SPLITS,
    PARTITION,
    _partial_offset,
    paged_attention,
    split_plan,
)

DEVICE = torch.device("cpu" if INTERPRETED else "cuda")  # (tests/conftest.py sets TRITON_INTERPRET without CUDA)
# ‖out − ref64‖/‖ref64‖ allowed: fp16/bf16 round p (the softmax weights) and the output once each
TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}
DECODE = dict(query_lens=[1, 1, 1, 1], seq_lens=[1, 16, 250, 637])  # 637 keys: 40 blocks of 16, 3 partitions
# a prompt, a chunk on cached blocks, decodes (one on a 1-token row), a 50-token chunk on 593 cached keys (41 blocks)
MIXED = dict(query_lens=[37, 20, 1, 1, 50], seq_lens=[37, 120, 300, 1, 643])
CASES = {
    "decode-gqa1-fp32-d64": dict(DECODE, heads=(2, 2), head_dim=64, dtype=torch.float32),
    "decode-gqa3-bf16-d24-window": dict(DECODE, heads=(6, 2), head_dim=24, dtype=torch.bfloat16, window=40),
    "decode-gqa8-fp16-d64-softcap": dict(DECODE, heads=(8, 1), head_dim=64, dtype=torch.float16, softcap=5.0),
    "decode-gqa8-fp32-d24-window-softcap-bs32": dict(
        DECODE, heads=(8, 1), head_dim=24, dtype=torch.float32, window=300, softcap=3.0, block_size=32
    ),
    "mixed-gqa1-fp32-d24": dict(MIXED, heads=(2, 2), head_dim=24, dtype=torch.float32),
    "mixed-gqa3-bf16-d64-window-softcap": dict(
        MIXED, heads=(6, 2), head_dim=64, dtype=torch.bfloat16, window=24, softcap=4.0
    ),
    "mixed-gqa8-fp16-d24-window-bs8": dict(
        MIXED, heads=(8, 1), head_dim=24, dtype=torch.float16, window=9, block_size=8
    ),
    "mixed-gqa3-fp32-d64-bs64": dict(MIXED, heads=(3, 1), head_dim=64, dtype=torch.float32, block_size=64),
}


class Step:
    """A step's queries, a random cache (blocks in shuffled order, every slot filled) and its metadata."""

    def __init__(self, query_lens, seq_lens, heads, head_dim, dtype, block_size=16, window=None, softcap=None, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.query_lens, self.seq_lens = np.array(query_lens), np.array(seq_lens)
        num_heads, num_kv_heads = heads
        self.window, self.softcap, self.scale, self.block_size = window, softcap, head_dim**-0.5, block_size
        blocks = -(-self.seq_lens // block_size)
        num_blocks = int(blocks.sum()) + 3
        order = torch.randperm(num_blocks, generator=g).numpy()
        self.block_tables = np.zeros((len(seq_lens), int(blocks.max()) + 1), np.int64)
        for row, start in enumerate(np.cumsum(blocks) - blocks):
            self.block_tables[row, : blocks[row]] = order[start : start + blocks[row]]
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k, self.v = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
        self.q = torch.randn(int(self.query_lens.sum()), num_heads, head_dim, generator=g).to(dtype)
        self.query_start_loc = np.concatenate([[0], np.cumsum(self.query_lens)])

    def triton(self, **poisoned) -> torch.Tensor:
        t = lambda a: torch.from_numpy(a).to(DEVICE)  # noqa: E731
        meta = (t(self.query_start_loc), t(self.seq_lens), t(self.block_tables))
        lens = (int(self.query_lens.max()), int(self.seq_lens.max()))
        q, k, v = (x.to(DEVICE) for x in (self.q, self.k, self.v))
        return paged_attention(q, k, v, *meta, *lens, self.scale, self.window, self.softcap, **poisoned).cpu()

    def torch_path(self) -> torch.Tensor:
        backend = TorchAttention(torch.device("cpu"), self.q.dtype, self.block_size)
        plans = backend.plan(self.query_lens, self.seq_lens, self.query_start_loc, self.block_tables)
        meta = AttentionMetadata(
            *map(torch.from_numpy, (np.zeros(0), self.query_start_loc, self.seq_lens, self.block_tables)),
            max_query_len=int(self.query_lens.max()),
            max_seq_len=int(self.seq_lens.max()),
        )
        backend.finish(meta, plans, [{n: torch.from_numpy(a) for n, a in p.arrays.items()} for p in plans])
        return backend(self.q, (self.k, self.v), meta, self.scale, self.window, self.softcap)

    def reference(self) -> torch.Tensor:
        """float64, row by row: every key gathered, scores soft-capped, then the causal and window mask."""
        out = torch.empty(self.q.shape, dtype=torch.float64)
        group = self.q.shape[1] // self.k.shape[2]
        keys, values = (c.flatten(0, 1).double().repeat_interleave(group, 1) for c in (self.k, self.v))
        for row, (start, n, seq_len) in enumerate(
            zip(self.query_start_loc[:-1], self.query_lens, self.seq_lens, strict=True)
        ):
            j = torch.arange(seq_len)
            slots = (
                torch.from_numpy(self.block_tables[row])[j // self.block_size] * self.block_size + j % self.block_size
            )
            s = torch.einsum("qhd,khd->hqk", self.q[start : start + n].double(), keys[slots]) * self.scale
            if self.softcap:
                s = self.softcap * torch.tanh(s / self.softcap)
            pos = (seq_len - n + torch.arange(n))[:, None]
            seen = (j <= pos) & (j > pos - (self.window or seq_len + 1))
            out[start : start + n] = torch.einsum(
                "hqk,khd->qhd", s.masked_fill(~seen, -torch.inf).softmax(-1), values[slots]
            )
        return out

    def poison(self) -> dict[str, torch.Tensor]:
        """NaN `out` and, for a split step, NaN scratch of exactly the size the kernels read."""
        splits, _ = split_plan(int(self.query_lens.max()), int(self.seq_lens.max()))
        numel = self.q.shape[0] * self.q.shape[1] * splits * (self.q.shape[2] + 2)
        poisoned = dict(out=torch.full_like(self.q, torch.nan, device=DEVICE))
        if splits > 1:
            poisoned["scratch"] = torch.full((numel,), torch.nan, device=DEVICE)
        return poisoned


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_torch_path_and_float64(case):
    step = Step(**CASES[case])
    out = step.triton(**step.poison())
    assert out.dtype == step.q.dtype and out.isfinite().all()
    tol = TOL[step.q.dtype]
    assert rel_err(out, step.reference()) < tol
    assert rel_err(out, step.torch_path()) < 2 * tol


def test_split_plan():
    assert split_plan(2, 10_000) == (1, 0)  # a step with a longer row: one pass
    assert split_plan(1, PARTITION) == (1, 0)
    assert split_plan(1, PARTITION + 1) == (2, PARTITION)
    assert split_plan(1, PARTITION * MAX_SPLITS) == (MAX_SPLITS, PARTITION)
    assert split_plan(1, PARTITION * MAX_SPLITS + 1) == (MAX_SPLITS // 2 + 1, 2 * PARTITION)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_row_gives_the_same_bits_alone_or_batched(dtype):
    """Split-K partitions follow the row's own length: a decode row's output is the same, bit for bit, alone (one
    pass when it is short) and beside rows of other lengths in a decode-only step."""
    batched = Step([1, 1, 1], [100, 637, 300], (6, 2), 24, dtype, window=None)
    together = batched.triton()
    for row, seq_len in enumerate(batched.seq_lens):
        alone = Step([1], [seq_len], (6, 2), 24, dtype)
        alone.k, alone.v, alone.q = batched.k, batched.v, batched.q[row : row + 1]
        alone.block_tables = batched.block_tables[row : row + 1]
        assert torch.equal(alone.triton(), together[row : row + 1])


@pytest.mark.parametrize("lens", [([5, 1, 3], [5, 40, 20]), ([1, 1], [10, 40])], ids=["mixed", "decode"])
def test_padding_rows_change_nothing(lens):
    """A row with no queries and no keys (a padded batch) is skipped, by the kernels and the torch path alike (which
    planned it: a segment of such rows alone, beside decodes, raised IndexError); the others' outputs keep their
    bits."""
    step = Step(*lens, (3, 1), 24, torch.float32, window=8)
    expected = step.triton(), step.torch_path()
    where = [1, len(step.seq_lens)]  # (after the first row and at the end)
    step.query_lens, step.seq_lens = (np.insert(a, where, 0) for a in (step.query_lens, step.seq_lens))
    step.block_tables = np.insert(step.block_tables, where, 0, axis=0)
    step.query_start_loc = np.concatenate([[0], np.cumsum(step.query_lens)])
    assert torch.equal(step.triton(**step.poison()), expected[0])
    assert torch.equal(step.torch_path(), expected[1])


FAR = 1 << 30  # elements between two tokens' rows of q and out below: token 2's start 2^31 elements in


@pytest.mark.parametrize("lens", [([3], [40]), ([1, 1, 1], [300, 17, 600])], ids=["one-pass", "split-k"])
def test_offsets_past_2_31_elements(lens):
    """q and out as views of one 8 GiB buffer (on a CPU lazily allocated: untouched pages cost no memory) with FAR
    elements between tokens, starting 2^31 elements in: token 2's offsets pass 2^31, where int32 offsets would wrap
    to the buffer's start. The outputs are the bits of contiguous q and out, in one pass and through the reduce."""
    step = Step(*lens, heads=(4, 2), head_dim=24, dtype=torch.float16)
    want = step.triton()
    n = step.q[0].numel()
    try:
        buf = torch.empty(2 * (1 << 31) + 2 * n, dtype=step.q.dtype, device=DEVICE)
    except RuntimeError as e:  # (a host that cannot even reserve 8 GiB of address space and swap, or a small GPU)
        pytest.skip(f"no 8 GiB buffer here: {e}")
    q, out = (buf.as_strided(step.q.shape, (FAR, *step.q.stride()[1:]), (1 << 31) + i * n) for i in (0, 1))
    step.q = q.copy_(step.q)
    assert torch.equal(step.triton(out=out.fill_(torch.nan)), want)


@triton.jit
def _partial_offsets(out, tokens, num_splits, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """out[i]: the scratch offset _partial_offset gives tokens[i]'s head i at split num_splits - 1 - i."""
    i = tl.arange(0, 4)
    token = tl.load(tokens + i)  # int32, as the kernels' token indices
    tl.store(out + i, _partial_offset(token, i, num_splits - 1 - i, num_splits, NUM_HEADS, HEAD_DIM))


def test_split_k_scratch_offsets_are_int64():
    """A decode step of 4,096 rows of 128 heads of 128 at 64 splits has a 4.4e9-element scratch (too large to run
    here): the offsets both kernels index it by (_partial_offset) are exact past 2^31."""
    heads, head_dim, splits = 128, 128, MAX_SPLITS
    tokens = [0, 1000, 2016, 4095]
    out = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    _partial_offsets[(1,)](out, torch.tensor(tokens, dtype=torch.int32, device=DEVICE), splits, heads, head_dim)
    want = [((t * heads + i) * splits + splits - 1 - i) * (head_dim + 2) for i, t in enumerate(tokens)]
    assert want[-1] > 1 << 32 and out.tolist() == want

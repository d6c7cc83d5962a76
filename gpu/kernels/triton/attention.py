"""Paged attention in Triton: queries of a flat token batch (prefill, chunked prefill, decode rows mixed) attend to
their row's keys and values read in place through the block table; no gather into a padded copy.

Contract (`paged_attention`): q [T, Hq, D] (last dim contiguous), this step's K/V already in the cache;
k_cache, v_cache [num_blocks, block_size, Hkv, D] contiguous, block_size a power of two; query_start_loc [rows + 1],
seq_lens [rows], block_tables [rows, max_blocks] (int32 or int64). Row r's queries are tokens query_start_loc[r]..
query_start_loc[r + 1] - 1, the last of its seq_lens[r] positions (bottom-right causal: query i of a row with
c = seq_len - query_len cached keys sees keys 0..c + i), and of those only the last `window` (key j visible to the
query at position p iff p - window < j <= p); scores = softmax_scale * q.k, then cap * tanh(scores / cap) with a
soft-cap; softmax in float32. Any D (masked up to a power of two), Hq a multiple of Hkv, fp16/bf16/fp32. Writes every
element of `out` [T, Hq, D] (q's dtype) and returns it. Equals the torch path (gpu/attention/torch_backend.py) within
rounding. Offsets scaled by a token (into q, out and the split-K scratch) are int64: no shape bound past 2^31 elements.

Grid: (query tiles, Hkv, splits). A program takes BLOCK_Q consecutive queries of one row times the GROUP = Hq / Hkv
query heads that share one KV head (BLOCK_M = BLOCK_Q * GROUP rows, at least 16 for tl.dot), so each key tile is
loaded once for the whole group; it walks the keys any of its queries sees in tiles of TILE_N (online softmax in
float32, exp2). Row r's tiles start at query_start_loc[r] // BLOCK_Q + r, so the grid's first axis,
T // BLOCK_Q + rows, needs no host-side lengths; a program finds its row by binary search and surplus ones return.

Split-K (`split_plan`): in a step of decode rows only (one query each, too few programs to fill a GPU otherwise)
whose longest row has more than PARTITION keys, each row's keys are cut into partitions of PARTITION keys aligned at
key 0, one program per partition writes its unnormalised sum, max and exp-sum to a float32 scratch
[T, Hq, splits, D + 2], and `_reduce_kernel` combines them. Partition bounds depend on the row's own length, not the
batch's, so a decode row's output does not depend on the rows beside it in a decode-only step, up to
PARTITION * MAX_SPLITS keys (past that the partition doubles); a row of at most PARTITION keys gets the bits of the
one-pass kernel. A decode row in a mixed step takes the one-pass kernel (its rounding differs in the last bits).

`@triton.jit` reads TRITON_INTERPRET when it decorates: a CPU run sets TRITON_INTERPRET=1 before triton is first
imported (triton.language's own helpers are decorated then): gpu/attention/backend.py, tests/conftest.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PARTITION = 256  # keys per split-K partition (16 blocks of 16)
MAX_SPLITS = 64
TILE_N = 64  # keys per inner step: a multiple of 16 (tl.dot), dividing PARTITION
NO_WINDOW = 1 << 30
_LOG2E = tl.constexpr(1.4426950408889634)
# tl.dot's operand type: the cache's; float32 in the interpreter, whose tl.dot (triton 3.9, create_dot) multiplies
# bf16 tiles as their raw uint16 bits. Exact: fp16/bf16 products are exact in float32, as in an MMA accumulating in it
INTERPRETED = triton.knobs.runtime.interpret
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _row_of_tile(query_start, tile, num_rows, BLOCK_Q: tl.constexpr):
    """The last row whose first tile (query_start[r] // BLOCK_Q + r) is at or before `tile`."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_rows
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _partial_offset(token, head, split, num_splits, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Where partials[token, head, split] starts in the scratch [T, Hq, splits, D + 2]: in int64, as every offset
    scaled by a token (T * Hq * splits * (D + 2), or T * stride_qt, passes 2^31 at long contexts and many rows)."""
    return ((token.to(tl.int64) * NUM_HEADS + head) * num_splits + split) * (HEAD_DIM + 2)


@triton.jit
def _attention_kernel(
    out, q, k_cache, v_cache, block_tables, seq_lens, query_start, partials,
    scale, softcap, window, partition, num_rows, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    SPLIT: tl.constexpr, SOFTCAP: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    tile, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = _row_of_tile(query_start, tile, num_rows, BLOCK_Q)
    q_start = tl.load(query_start + row).to(tl.int32)
    q_len = tl.load(query_start + row + 1).to(tl.int32) - q_start
    first = (tile - q_start // BLOCK_Q - row) * BLOCK_Q  # this tile's first query, counted in its row
    if first >= q_len:
        return
    seq_len = tl.load(seq_lens + row).to(tl.int32)
    ctx = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = first + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    m_ok = (q_idx < q_len) & (offs_m < BLOCK_Q * GROUP)
    pos = ctx + q_idx
    token = (q_start + q_idx).to(tl.int64)  # (int64 offsets: see _partial_offset)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    md_ok = m_ok[:, None] & d_ok[None, :]
    q_off = token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    qt = tl.load(q + q_off, mask=md_ok, other=0.0).to(DOT)

    # keys [lo, hi) seen by some query of the tile; a split-K program takes its partition of them
    hi = tl.minimum(ctx + first + BLOCK_Q, seq_len)
    lo = tl.maximum(ctx + first - window + 1, 0)
    if SPLIT:
        lo = tl.maximum(lo, split * partition)
        hi = tl.minimum(hi, (split + 1) * partition)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = block_tables + row * stride_bt
    for start in range(lo // TILE_N * TILE_N, hi, TILE_N):
        keys = start + tl.arange(0, TILE_N)
        k_ok = keys < hi
        block = tl.load(table + keys // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        k_off = block * stride_kb + (keys % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        kt = tl.load(k_cache + k_off[None, :] + offs_d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0.0)
        s = tl.dot(qt, kt.to(DOT), input_precision=PRECISION) * scale
        if SOFTCAP:  # cap * tanh(s / cap), tanh(x) = 1 - 2 / (e^2x + 1) with x clamped to +-15 (no overflow)
            x = tl.minimum(tl.maximum(s / softcap, -15.0), 15.0)
            s = softcap - 2.0 * softcap / (tl.exp2(x * (2.0 * _LOG2E)) + 1.0)
        seen = (keys[None, :] <= pos[:, None]) & (keys[None, :] > pos[:, None] - window)
        s = tl.where(seen & k_ok[None, :] & m_ok[:, None], s * _LOG2E, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a query that has seen no key yet
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        v_off = block * stride_vb + (keys % BLOCK_SIZE) * stride_vs + kv_head * stride_vh
        vt = tl.load(v_cache + v_off[:, None] + offs_d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype).to(DOT), vt.to(DOT), input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    if SPLIT:  # partials[token, head, split] = [acc (D), max (log2 units), exp-sum]; an empty split: 0, -inf, 0
        base = partials + _partial_offset(token, head, split, num_splits, NUM_HEADS, HEAD_DIM)
        tl.store(base[:, None] + offs_d[None, :], acc, mask=md_ok)
        tl.store(base + HEAD_DIM, m_i, mask=m_ok)
        tl.store(base + HEAD_DIM + 1, l_i, mask=m_ok)
    else:
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        dst = out + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(dst, o.to(out.dtype.element_ty), mask=md_ok)


@triton.jit
def _reduce_kernel(
    out, partials, stride_ot, stride_oh, num_splits,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):  # fmt: skip
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    base = partials + _partial_offset(token, head, offs_s, num_splits, NUM_HEADS, HEAD_DIM)
    m = tl.load(base + HEAD_DIM, mask=s_ok, other=float("-inf"))
    w = tl.exp2(m - tl.max(m, 0))  # an empty split weighs 0
    l_sum = tl.sum(tl.load(base + HEAD_DIM + 1, mask=s_ok, other=0.0) * w, 0)
    acc = tl.load(base[:, None] + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / l_sum
    tl.store(out + token * stride_ot + head * stride_oh + offs_d, o.to(out.dtype.element_ty), mask=d_ok)


def split_plan(max_query_len: int, max_seq_len: int) -> tuple[int, int]:
    """(splits, keys per partition) for a step: (1, 0), one pass, unless every row decodes and the longest row has
    more than PARTITION keys."""
    if max_query_len > 1 or max_seq_len <= PARTITION:
        return 1, 0
    partition = PARTITION * triton.next_power_of_2(triton.cdiv(max_seq_len, PARTITION * MAX_SPLITS))
    return triton.cdiv(max_seq_len, partition), partition


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    softmax_scale: float,
    window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """See the module's contract. `out` [T, Hq, D] and, for a split step, `scratch` (float32, at least
    T * Hq * splits * (D + 2) elements) are allocated when not given (static buffers for a captured graph)."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    assert num_heads % num_kv_heads == 0 and q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_size & (block_size - 1) == 0 and k_cache.shape == v_cache.shape == (*k_cache.shape[:3], head_dim)
    out = torch.empty_like(q) if out is None else out
    rows = seq_lens.shape[0]
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(group))
    splits, partition = split_plan(max_query_len, max_seq_len)
    if splits > 1 and scratch is None:
        scratch = torch.empty(num_tokens * num_heads * splits * (head_dim + 2), dtype=torch.float32, device=q.device)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    grid = (num_tokens // (block_m // group) + rows, num_kv_heads, splits)
    _attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scratch if splits > 1 else out,
        softmax_scale, softcap or 1.0, window or NO_WINDOW, partition, rows, splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        BLOCK_Q=block_m // group, BLOCK_M=block_m, TILE_N=TILE_N, SPLIT=splits > 1, SOFTCAP=bool(softcap),
        DOT=tl.float32 if q.dtype == torch.float32 or INTERPRETED else _TL_DTYPES[q.dtype],
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    if splits > 1:
        _reduce_kernel[(num_tokens, num_heads)](
            out, scratch, out.stride(0), out.stride(1), splits,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=triton.next_power_of_2(splits),
        )  # fmt: skip
    return out

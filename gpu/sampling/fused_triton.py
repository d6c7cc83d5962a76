"""The sampler in a few Triton launches: every processor, the greedy argmax, temperature, min-p, top-k, top-p, the
draw, and the drawn token's raw logprob and rank, for any mix of row kinds.

fused_sample(logits, meta, buffer) -> (sampled [B], LogprobsTensors | None), launching in order:
1. `_prepare_kernel` (unless the logits are float32 and no row edits them): each row cast to float32 into a work
   buffer, then its edits (`meta.edits`, gpu/sampling/edits.py) in the sampler's order: allowed ids, bans, logit
   bias, penalties (repetition, then frequency and presence subtracted, as penalties.apply_penalties), with torch's
   float32 rounding (no fused multiply-add, IEEE division): the torch processors' bits;
2. torch.rand: the unseeded random rows' uniforms (unless every row is greedy);
3. `_sample_kernel`, one program per row: the argmax over the processed row (torch.argmax's semantics: the first
   NaN, else the first maximum), which a greedy row and a row whose maximum is not finite take; else the row's
   uniform (a seeded row's from its seed and output position: `topk_topp.counter_uniforms`' splitmix64) and the
   sort-free draw (`threshold_triton.threshold_token`); with logprobs, over the raw row: its maximum, its sum of
   exp(x - max), the drawn token's logprob and rank;
4-6. with logprobs: the top-N by torch.topk over the raw rows, shifted by the kernel's maxima and log-sums.
Every launch covers the B rows (no index sets, no host sync): a step's launches follow from B, whether a row edits
its logits, whether a row asks for logprobs and whether every row is greedy. The logits are not modified.
Against the torch path (sort_free="torch", the reference): the same tokens except where a threshold decision or a
uniform lands within rounding of a boundary (threshold.py), and the same logprobs up to the order of summation.
As threshold_triton: the module reads TRITON_INTERPRET when imported (CPU runs set it first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .edits import ALLOWED, BAN, BIAS, PENALTY, Edits
from .logprobs import LogprobsTensors
from .metadata import SamplingMetadata
from .threshold_triton import threshold_token
from .topk_topp import MIN_P, TOP_K, TOP_P, T

_ALLOWED, _BAN, _BIAS, _PENALTY = (tl.constexpr(k) for k in (ALLOWED, BAN, BIAS, PENALTY))
_T, _TOP_K, _TOP_P, _MIN_P = (tl.constexpr(c) for c in (T, TOP_K, TOP_P, MIN_P))
# splitmix64's constants (topk_topp's, unsigned here: uint64 arithmetic wraps as the int64 reference's does)
_GOLDEN, _M1, _M2 = (tl.constexpr(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


@triton.jit
def _mix(z):
    z = (z ^ (z >> 30)) * _M1
    z = (z ^ (z >> 27)) * _M2
    return z ^ (z >> 31)


@triton.jit
def _counter_uniform(seed, position):
    """topk_topp.counter_uniforms(seed, position) of stream 0: the same float64 bits."""
    z = _mix(_mix(seed.to(tl.uint64, bitcast=True) + _GOLDEN) + position.to(tl.uint64, bitcast=True) * _GOLDEN)
    return (z >> 11).to(tl.float64) * 1.1102230246251565e-16  # 2 ** -53


@triton.jit
def _segment(starts, kind):
    return tl.load(starts + kind), tl.load(starts + kind + 1)


@triton.jit
def _prepare_kernel(
    raw, raw_stride, x, x_stride, n_cols, starts, tokens, values, penalties, EDITS: tl.constexpr, BLOCK: tl.constexpr
):
    r = tl.program_id(0).to(tl.int64)
    src, dst = raw + r * raw_stride, x + r * x_stride
    copied = n_cols  # the columns copied: all, or none in an allowed-ids row (-inf; its ids are written below)
    if EDITS:
        lo, hi = _segment(starts + r * 5, _ALLOWED)
        copied = tl.where(hi > lo, 0, n_cols)
    for start in range(0, n_cols, BLOCK):  # the row in float32
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(src + offs, mask=offs < copied, other=float("-inf")).to(tl.float32)
        tl.store(dst + offs, v, mask=offs < n_cols)
    if EDITS:
        s = starts + r * 5
        tl.debug_barrier()  # (each segment reads what the one before wrote, in other threads)
        lo, hi = _segment(s, _ALLOWED)
        for e in range(lo, hi, BLOCK):
            i = e + tl.arange(0, BLOCK)
            tok = tl.load(tokens + i, mask=i < hi, other=0)
            tl.store(dst + tok, tl.load(src + tok, mask=i < hi).to(tl.float32), mask=i < hi)
        tl.debug_barrier()
        lo, hi = _segment(s, _BAN)
        for e in range(lo, hi, BLOCK):
            i = e + tl.arange(0, BLOCK)
            tok = tl.load(tokens + i, mask=i < hi, other=0)
            tl.store(dst + tok, tl.full((BLOCK,), float("-inf"), tl.float32), mask=i < hi)
        tl.debug_barrier()
        lo, hi = _segment(s, _BIAS)
        for e in range(lo, hi, BLOCK):
            i = e + tl.arange(0, BLOCK)
            tok = tl.load(tokens + i, mask=i < hi, other=0)
            tl.store(dst + tok, tl.load(dst + tok, mask=i < hi) + tl.load(values + i, mask=i < hi), mask=i < hi)
        tl.debug_barrier()
        lo, hi = _segment(s, _PENALTY)
        if hi > lo:
            p = penalties + r * 3
            rep, presence, frequency = tl.load(p), tl.load(p + 1), tl.load(p + 2)
            for e in range(lo, hi, BLOCK):
                i = e + tl.arange(0, BLOCK)
                tok = tl.load(tokens + i, mask=i < hi, other=0)
                count = tl.load(values + i, mask=i < hi, other=0.0)
                v = tl.load(dst + tok, mask=i < hi)
                v = (
                    tl.where(v > 0, tl.div_rn(v, rep), v * rep)
                    - frequency * count
                    - presence * (count > 0).to(tl.float32)
                )
                tl.store(dst + tok, v, mask=i < hi)


@triton.jit
def _argmax(row, n_cols, BLOCK: tl.constexpr):
    """(the row's maximum, its index) as torch.argmax has them: the first NaN if any (maximum NaN), else the first
    maximum (an all -inf row: token 0). Each lane keeps its first NaN, its maximum and that maximum's first column;
    the lanes are reduced once, at the end."""
    lane = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    index = lane.to(tl.int64)  # (a lane that never rises above -inf: its first column, so an all -inf row gives 0)
    nan = tl.full((BLOCK,), n_cols, tl.int64)
    for start in range(0, n_cols, BLOCK):
        offs = start + lane
        inside = offs < n_cols
        v = tl.load(row + offs, mask=inside, other=float("-inf"))
        is_nan = v != v
        nan = tl.minimum(nan, tl.where(is_nan & inside, offs, n_cols).to(tl.int64))
        rises = v > best  # (False for NaN: the lane's maximum is over its other values)
        index = tl.where(rises, offs.to(tl.int64), index)
        best = tl.where(rises, v, best)
    first_nan = tl.min(nan, 0)
    m = tl.max(best, 0)
    first = tl.min(tl.where(best == m, index, n_cols), 0)
    return tl.where(first_nan < n_cols, float("nan"), m), tl.where(first_nan < n_cols, first_nan, first)


@triton.jit
def _raw_logprob(row, n_cols, token, BLOCK: tl.constexpr):
    """(maximum, log of the sum of exp(x - maximum), the token's logprob, its rank) of a raw row (any float
    format; as logprobs.log_softmax_into and gather_logprobs compute them, summed in another order). Each of the
    three passes accumulates per lane and reduces once."""
    lane = tl.arange(0, BLOCK)
    top = tl.full((BLOCK,), float("-inf"), tl.float32)
    for start in range(0, n_cols, BLOCK):
        offs = start + lane
        top = tl.maximum(top, tl.load(row + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32))
    top_all = tl.max(top, 0)
    total = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n_cols, BLOCK):
        offs = start + lane
        v = tl.load(row + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
        total += tl.exp(v - top_all)
    log_total = tl.log(tl.sum(total, 0))
    lp = (tl.load(row + token).to(tl.float32) - top_all) - log_total
    rank = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, n_cols, BLOCK):
        offs = start + lane
        v = tl.load(row + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
        rank += ((offs < n_cols) & ((v - top_all) - log_total >= lp)).to(tl.int32)
    return top_all, log_total, lp, tl.sum(rank.to(tl.int64), 0)


@triton.jit
def _sample_kernel(
    x, x_stride, n_cols, params, greedy, u, seed_index, seeds, positions, out,
    raw, raw_stride, tops, log_totals, lps, ranks, LOGPROBS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    row = x + r * x_stride
    m, token = _argmax(row, n_cols, BLOCK)
    finite = (m == m) & (m < float("inf")) & (m > float("-inf"))
    if (tl.load(greedy + r) == 0) & finite:
        par = params + r * 4
        uniform = tl.load(u + r)
        k = tl.load(seed_index + r)
        if k >= 0:
            uniform = _counter_uniform(tl.load(seeds + k), tl.load(positions + k))
        t, top_k = tl.load(par + _T).to(tl.float32), tl.load(par + _TOP_K).to(tl.int64)
        token = threshold_token(row, n_cols, m, t, top_k, tl.load(par + _TOP_P), tl.load(par + _MIN_P), uniform, BLOCK)
    tl.store(out + r, token)
    if LOGPROBS:
        top, log_total, lp, rank = _raw_logprob(raw + r * raw_stride, n_cols, token, BLOCK)
        tl.store(tops + r, top)
        tl.store(log_totals + r, log_total)
        tl.store(lps + r, lp)
        tl.store(ranks + r, rank)


def prepare(raw: torch.Tensor, edits: Edits | None, work: torch.Tensor, block: int) -> torch.Tensor:
    """The processed float32 logits of raw [B, V]: raw itself where it is float32 and nothing edits it, else the
    prepare kernel's copy in work (launch 1 of the module docstring)."""
    if edits is None and raw.dtype == torch.float32:
        return raw
    b, v = raw.shape
    x = work[:b, :v]
    e = (edits.starts, edits.tokens, edits.values, edits.penalties) if edits is not None else (raw,) * 4
    launch = dict(num_warps=8, enable_fp_fusion=False)  # (no FMA, IEEE division: torch's processors' bits)
    _prepare_kernel[(b,)](raw, raw.stride(0), x, x.stride(0), v, *e, edits is not None, block, **launch)
    return x


def fused_sample(logits: torch.Tensor, meta: SamplingMetadata, work: torch.Tensor, block: int = 2048):
    """The sampled ids [B] of logits [B, V] (any float format) and, where a row asks for logprobs, every row's raw
    logprobs (module docstring). work: a float32 [B, >= V] buffer for the processed logits; `block`: the chunk a
    program reads at a time."""
    b, v = logits.shape
    raw = logits if logits.stride(1) == 1 else logits.contiguous()
    x = prepare(raw, meta.edits, work, block)
    u = meta.params if meta.all_greedy else torch.rand(b, dtype=torch.float64, device=raw.device)  # (unread if greedy)
    sampled = torch.empty(b, dtype=torch.int64, device=raw.device)
    n = meta.max_num_logprobs
    tops, log_totals, lps = (torch.empty(b, dtype=torch.float32, device=raw.device) for _ in range(3))
    ranks = torch.empty(b, dtype=torch.int64, device=raw.device)
    seeds, positions = (meta.seeds, meta.positions) if meta.seeds.numel() else (meta.seed_index,) * 2  # (never read)
    args = (x, x.stride(0), v, meta.params, meta.greedy, u, meta.seed_index, seeds, positions, sampled)
    _sample_kernel[(b,)](*args, raw, raw.stride(0), tops, log_totals, lps, ranks, n is not None, block, num_warps=8)
    if n is None:
        return sampled, None
    values, ids = raw.topk(n, -1)
    return sampled, LogprobsTensors(lps, ranks, ids, (values - tops[:, None]) - log_totals[:, None])

"""The sort-free draw fused into one Triton kernel: `threshold.threshold_draw`'s algorithm, one program per row.

threshold_draw_triton(x, row_max, cols, meta, block) has threshold_draw's contract and returns its tokens, except
where a boundary decision or the uniform lands within float rounding of a boundary (sums in another order; on a
GPU, Triton's exp and division round differently from torch's). One launch for the batch, no host sync.

A program reads its row in `block`-wide chunks, once per pass (from L2 after the first), each lane accumulating its
columns' counts, extremes and masses, reduced across the lanes once a pass:
1. over the finite logits: their count, and the mass Z and count n of the min-p survivors (e = exp((x - max) / T)
   >= min_p);
2. top-k (k < the finite count): the largest logit v with #{x >= v} >= k;
3. Z and n again over the survivors of min-p and top-k;
4. top-p (p < 1): the largest logit v with mass(x >= v) >= p * Z, searched from the top-k threshold or from where
   e = (1 - p) Z / n / 2, whichever is higher (the survivors below that hold less than (1 - p) Z / 2);
5. the kept mass (x >= the threshold, min-p survivors), then a scan in token-id order to the uniform's share of it.
A search bisects the order keys with each bound moved onto the nearest logit (min{x >= pivot}, max{x < pivot}): it
ends once no logit lies strictly between them, after about log2 of the logits in the first bracket, not 32 passes.
On language-model-like rows (scripts/bench_sampler.py's, V = 49152) the searches take ~3 passes for top-p 0.9
alone, ~17 for top-k 50 with top-p 0.95 (emulated on CPU: pass counts, not times).

Interpreter rule (as gpu/kernels): `@triton.jit` reads TRITON_INTERPRET when this module is imported, so a CPU run
sets TRITON_INTERPRET=1 first; the sampler imports this module only when the Triton draw is chosen.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .metadata import SamplingMetadata
from .threshold import NEG_INF_KEY
from .topk_topp import MIN_P, TOP_K, TOP_P, T, U

# @triton.jit reads module globals only as constexprs: the columns of `cols` (topk_topp), and the 1 - top_p below
# which the top-p search starts from the top-k threshold instead of the mass bound (whose slack shrinks with it)
_T, _TOP_K, _TOP_P, _MIN_P, _U = (tl.constexpr(c) for c in (T, TOP_K, TOP_P, MIN_P, U))
_NEG_INF_KEY = tl.constexpr(NEG_INF_KEY)
_TOP_P_SLACK = tl.constexpr(1e-6)
_LOWEST = tl.constexpr(-3.4028234663852886e38)  # the lowest finite float32: x >= it is x > -inf


@triton.jit
def _key_value(key):
    """The float32 value of an int64 order key (`threshold.key_values`)."""
    b = key.to(tl.int32)
    return (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _order_key(v):
    """The int64 order key of a float32 value (`threshold.order_keys`)."""
    b = v.to(tl.int32, bitcast=True)
    return (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _pass(row, n_cols, m, t, min_p, v, BLOCK: tl.constexpr, MASS: tl.constexpr):
    """One pass over a row at the threshold v: #{x >= v}, min{x >= v}, max{x < v}, and with MASS the mass of
    x >= v and the min-p survivors' (e >= min_p) mass and count at x >= v (float64). Each lane accumulates its own
    columns and the lanes are reduced once, at the end: no reduction (a barrier) per chunk."""
    ge = tl.zeros((BLOCK,), tl.int32)
    lowest = tl.full((BLOCK,), float("inf"), tl.float32)
    below = tl.full((BLOCK,), float("-inf"), tl.float32)
    mass = tl.zeros((BLOCK,), tl.float64)
    kept_mass = tl.zeros((BLOCK,), tl.float64)
    kept = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < n_cols
        x = tl.load(row + offs, mask=inside, other=float("-inf"))
        at = inside & (x >= v)
        ge += at.to(tl.int32)
        lowest = tl.minimum(lowest, tl.where(at, x, float("inf")))
        below = tl.maximum(below, tl.where(at, float("-inf"), x))
        if MASS:
            e = tl.exp((x - m) / t).to(tl.float64)
            mass += tl.where(at, e, 0.0)
            survives = at & (e >= min_p)
            kept_mass += tl.where(survives, e, 0.0)
            kept += survives.to(tl.int32)
    ge_all, kept_all = tl.sum(ge.to(tl.int64), 0), tl.sum(kept.to(tl.int64), 0)
    return ge_all, tl.min(lowest, 0), tl.max(below, 0), tl.sum(mass, 0), tl.sum(kept_mass, 0), kept_all


@triton.jit
def _largest(row, n_cols, m, t, min_p, lo, target, BLOCK: tl.constexpr, MASS: tl.constexpr):
    """The largest logit v with #{x >= v} (MASS: the mass of x >= v) >= target, given that it holds at the key lo:
    bisection over the order keys, each bound moved onto the nearest logit, so that it ends when no logit is left
    strictly between them."""
    hi = _order_key(m) + 1  # just above the maximum: nothing reaches it
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        ge, lowest, below, mass, _kept_mass, _kept = _pass(row, n_cols, m, t, min_p, _key_value(mid), BLOCK, MASS)
        reached = mass >= target if MASS else ge >= target
        if reached:
            lo = tl.maximum(_order_key(lowest), mid)
        else:
            hi = tl.minimum(_order_key(below) + 1, mid)
    return _key_value(lo)


@triton.jit
def _draw_kernel(x, stride, n_cols, row_max, cols, cols_stride, rows, out, BLOCK: tl.constexpr):
    r = tl.load(rows + tl.program_id(0))
    par = cols + r * cols_stride
    t, top_k = tl.load(par + _T).to(tl.float32), tl.load(par + _TOP_K).to(tl.int64)
    top_p, min_p, u = tl.load(par + _TOP_P), tl.load(par + _MIN_P), tl.load(par + _U)
    token = threshold_token(x + r * stride, n_cols, tl.load(row_max + r), t, top_k, top_p, min_p, u, BLOCK)
    tl.store(out + tl.program_id(0), token)


@triton.jit
def threshold_token(row, n_cols, m, t, top_k, top_p, min_p, u, BLOCK: tl.constexpr):
    """The token one row draws (steps 1-5 of the module docstring): its float32 logits at `row` (n_cols of them,
    their maximum m), its temperature, top-k, top-p and min-p, and its uniform u (float64)."""
    neg_inf = float("-inf")
    # 1. the finite count, the min-p survivors' mass z and count n; 2. top-k, where it cuts
    first = _pass(row, n_cols, m, t, min_p, _LOWEST, BLOCK, True)
    finite, z, n = first[0], first[4], first[5]
    tau = tl.full((), neg_inf, tl.float32)
    if top_k < finite:
        tau = _largest(row, n_cols, m, t, min_p, tl.full((), _NEG_INF_KEY, tl.int64), top_k, BLOCK, False)
        survivors = _pass(row, n_cols, m, t, min_p, tau, BLOCK, True)  # 3. the survivors of both
        z, n = survivors[4], survivors[5]
    if top_p < 1.0:  # 4. top-p over the survivors, from the top-k threshold or the mass bound, whichever is higher
        lo = _order_key(tau)
        if 1.0 - top_p >= _TOP_P_SLACK:
            bound = m + t * (tl.log(((1.0 - top_p) * z / n).to(tl.float32)) - 0.7)
            lo = tl.maximum(lo, _order_key(bound))
        tau = tl.maximum(tau, _largest(row, n_cols, m, t, min_p, lo, top_p * z, BLOCK, True))
        z = _pass(row, n_cols, m, t, min_p, tau, BLOCK, True)[4]
    # 5. the first token whose cumulative kept mass (token-id order) passes u * z
    target = u * z
    prefix = tl.zeros((), tl.float64)
    token = tl.full((), -1, tl.int64)
    last = tl.zeros((), tl.int64)  # the last kept token with weight: where rounding leaves the target past the end
    start = tl.zeros((), tl.int32)
    while (start < n_cols) & (token < 0):
        offs = start + tl.arange(0, BLOCK)
        x_c = tl.load(row + offs, mask=offs < n_cols, other=neg_inf)
        e = tl.exp((x_c - m) / t).to(tl.float64)
        w = tl.where((x_c >= tau) & (e >= min_p), e, 0.0)
        hit = tl.min(tl.where(prefix + tl.cumsum(w, 0) > target, offs, n_cols), 0).to(tl.int64)
        token = tl.where(hit < n_cols, hit, -1)
        last = tl.maximum(last, tl.max(tl.where(w > 0.0, offs, 0), 0).to(tl.int64))
        prefix += tl.sum(w, 0)
        start += BLOCK
    return tl.where(token < 0, last, token)


def threshold_draw_triton(
    x: torch.Tensor, row_max: torch.Tensor, cols: torch.Tensor, meta: SamplingMetadata, block: int = 2048
) -> torch.Tensor:
    """`threshold.threshold_draw` as one launch (module docstring); `block`: the chunk a pass reads at a time."""
    rows = meta.random_rows
    out = torch.empty(len(rows), dtype=torch.int64, device=x.device)
    if len(rows):
        grid = (len(rows),)
        args = (x, x.stride(0), x.shape[1], row_max, cols, cols.stride(0), rows, out)
        _draw_kernel[grid](*args, block, num_warps=8)
    return out

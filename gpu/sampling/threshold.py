"""The sort-free draw: min-p, top-k and top-p as one logit threshold per row, found by bisection; then the draw.

threshold_draw(x, row_max, cols, meta) -> token ids [n] of the random rows (meta.random_rows, [n]), for processed
float32 logits x [B, V] (any width; -inf padding is never drawn), their row maxima [B] and the rows' `topk_topp`
columns [B, 6] (T, TOP_K, TOP_P, MIN_P, U; MASS unused). No sort, no host sync, static shapes: it runs as is on
any device, in a fixed number of full-row passes (KEY_BITS halvings per search; a search only over the rows
that truncate so: meta.top_k_rows, meta.top_p_rows). It is the reference of the fused kernel
(`threshold_triton`), and what the chi-square suite runs on CPU.

Each truncation keeps the tokens at or above a value, so the kept set is {x >= tau} with e = exp((x - max) / T)
(float32) >= min_p on top, in the sampler's order (DESIGN 5):
- min-p: e >= min_p, token by token;
- top-k: tau_k = the k-th largest logit (every token tied with it kept, as `kept_weights`): the largest v with
  #{x >= v} >= k, by bisection over the float32 order (`order_keys`: 32-bit keys, KEY_BITS halvings);
- top-p, over the min-p and top-k survivors (mass Z, float64): a token is kept while the survivors' mass strictly
  above its logit is < top_p * Z, i.e. down to the largest logit v with mass(x >= v) >= top_p * Z (the token that
  crosses p). The same bisection finds it from tau_k up; above the survivors' smallest logit every token is a
  survivor, so the mass is summed over the whole row without a mask.
The draw inverts the kept weights' CDF in token-id order with the row's uniform (`invert_cdf`), as the sorted and
window paths do: for the same uniform it picks their token. It differs from them in two measure-zero ways:
- a tie group at the top-p boundary (the token that crosses p and others with its logit) is kept whole, as
  top-k's; the sorted path keeps those of the group that its sort order puts first (with bf16 logits, ties are
  common there);
- masses are summed in another order (and e is float32 here, float64 there): a boundary decision or a draw whose
  uniform lands within rounding (~1e-7 relative) of a boundary may differ.
So a seeded row's token is a function of (logits, seed, position) on this path, and equals the other paths' token
except in those cases.
"""

from __future__ import annotations

import torch

from .metadata import SamplingMetadata
from .topk_topp import MIN_P, TOP_K, TOP_P, T, U, invert_cdf

KEY_BITS = 32  # every key range here is narrower than 2**32: the bisection is exact after 32 halvings
NEG_INF_KEY = -(1 << 31) + 0x7FFFFF  # order_keys(-inf): every logit is >= it


def order_keys(v: torch.Tensor) -> torch.Tensor:
    """int64 keys in the order of float32 v (-0.0 one below +0.0): flip the magnitude bits of negative values."""
    b = v.view(torch.int32)
    return (b ^ ((b >> 31) & 0x7FFFFFFF)).long()


def key_values(keys: torch.Tensor) -> torch.Tensor:
    """The float32 values of int64 keys (the inverse of order_keys: the bit flip is its own inverse)."""
    b = keys.int()
    return (b ^ ((b >> 31) & 0x7FFFFFFF)).view(torch.float32)


def largest(x: torch.Tensor, w: torch.Tensor | None, target: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor):
    """Per row, the largest logit v with sum(w[x >= v]) >= target (w None: the count of x >= v), given that it
    holds at the key lo and not at hi: KEY_BITS halvings of [lo, hi) over the order keys."""
    for _ in range(KEY_BITS):
        mid = (lo + hi) >> 1
        at = x >= key_values(mid)[:, None]
        reached = (
            at.sum(-1, dtype=torch.int32) if w is None else torch.where(at, w, 0.0).sum(-1, dtype=torch.float64)
        ) >= target
        lo, hi = torch.where(reached, mid, lo), torch.where(reached, hi, mid)
    return key_values(lo)


def weights(x: torch.Tensor, row_max: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """e = exp((x - max) / T) in float32, the rows' weights before truncation."""
    return ((x - row_max[:, None]) / cols[:, T, None].float()).exp_()


def thresholds(x: torch.Tensor, row_max: torch.Tensor, cols: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Per row, the logit the row keeps tokens from (-inf: no top-k, no top-p): the top-k threshold of the top-k
    rows, then, for the top-p rows, the nucleus over the min-p and top-k survivors (module docstring)."""
    tau = torch.full_like(row_max, float("-inf"))
    rows = meta.top_k_rows
    if rows.numel():
        m = row_max.index_select(0, rows)
        k = cols.index_select(0, rows)[:, TOP_K].long()
        lo = torch.full_like(k, NEG_INF_KEY)  # every sum is reached at -inf ...
        tau.index_copy_(0, rows, largest(x.index_select(0, rows), None, k, lo, order_keys(m) + 1))  # ... none above max
    rows = meta.top_p_rows
    if rows.numel():
        sub, m, c, tau_k = x.index_select(0, rows), row_max.index_select(0, rows), cols.index_select(0, rows), tau[rows]
        e = weights(sub, m, c)
        z = torch.where((sub >= tau_k[:, None]) & (e >= c[:, MIN_P, None]), e, 0.0).sum(-1, dtype=torch.float64)
        tau.index_copy_(0, rows, largest(sub, e, c[:, TOP_P] * z, order_keys(tau_k), order_keys(m) + 1))
    return tau


def threshold_draw(x: torch.Tensor, row_max: torch.Tensor, cols: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Draw each random row of `meta` from its kept set with its uniform (module docstring). A row whose maximum
    is not finite gets a meaningless token (the sampler gives it its argmax)."""
    rows = meta.random_rows
    tau = thresholds(x, row_max, cols, meta).index_select(0, rows)
    sub, m, c = x.index_select(0, rows), row_max.index_select(0, rows), cols.index_select(0, rows)
    e = weights(sub, m, c)
    return invert_cdf(torch.where((sub >= tau[:, None]) & (e >= c[:, MIN_P, None]), e, 0.0).double(), c[:, U])

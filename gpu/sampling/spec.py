"""Verification of point-mass drafts (speculative decoding with an n-gram proposer), vectorised, no host sync.

Each speculating request's K+1 verified positions are ordinary sampling rows: position j is sampled from
the request's fully processed target distribution p_j (the section 5 pipeline with the drafts before j in
its output history), one uniform each from the request's own generator, greedy rows by argmax. Then:

  emitted = sampled[0 .. a], where a = the first position whose sample differs from its draft
            (the bonus position K has no draft, so a <= K).

This is exactly the rejection sampler for a point-mass draft q = delta_x. That sampler accepts x with
probability min(1, p(x) / q(x)) = p(x) and, on rejection, draws from normalize(max(0, p - q)), which is p
restricted to y != x. Sampling y ~ p and emitting y (accepted iff y = x) has the same law:
P(x) = p(x), and P(y) = p(y) = (1 - p(x)) * p(y) / (1 - p(x)) for y != x. Every later position is
conditioned on the accepted prefix, as sampling token by token would be; greedy rows accept exactly while
the draft equals the target's argmax. When all K drafts are accepted, position K is the bonus token, drawn
from p_K.
"""

from __future__ import annotations

import torch

NO_DRAFT = -1  # the draft "token" at a bonus position: no sample equals it


def num_emitted(sampled: torch.Tensor, drafts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """sampled, drafts [P]: the flat positions of all rows, row after row (`counts` [R] positions each, each
    row's last position a bonus one holding NO_DRAFT). Returns [R]: how many leading positions each row emits
    (its accepted drafts, plus the sample at the first rejection or the bonus)."""
    rows = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
    local = torch.arange(len(sampled), device=sampled.device) - (counts.cumsum(0) - counts)[rows]
    first_miss = torch.where(sampled != drafts, local, len(sampled))
    first = torch.full_like(counts, len(sampled)).scatter_reduce_(0, rows, first_miss, "amin")
    return first + 1

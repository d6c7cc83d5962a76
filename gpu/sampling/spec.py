"""Verification of speculative drafts, vectorised, no host sync: point-mass drafts (the n-gram proposer) and drafts
with a distribution q (a draft model).

Each speculating request's K+1 verified positions are ordinary sampling rows: position j is sampled from
the request's fully processed target distribution p_j (the section 5 pipeline with the drafts before j in
its output history), one uniform each (a seeded row's keyed by seed and output position), greedy rows by
argmax. Then:

  emitted = sampled[0 .. a], where a = the first position whose sample differs from its draft
            (the bonus position K has no draft, so a <= K): `num_emitted(sampled == drafts, counts)`.

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

from .metadata import SamplingRow, to_device
from .topk_topp import invert_cdf, uniforms

NO_DRAFT = -1  # the draft "token" at a bonus position: no sample equals it


def num_emitted(accepted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """accepted [P]: whether each flat position's draft was accepted (row after row, `counts` [R] positions each, a
    row's last position a bonus one, never accepted). Returns [R]: how many leading positions each row emits (its
    accepted drafts, plus the token at the first rejection or the bonus)."""
    rows = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts, output_size=len(accepted))
    local = torch.arange(len(accepted), device=accepted.device) - (counts.cumsum(0) - counts)[rows]
    first_miss = torch.where(accepted, len(accepted), local)
    first = torch.full_like(counts, len(accepted)).scatter_reduce_(0, rows, first_miss, "amin")
    return first + 1


def verify_draft_probs(
    p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, sampled: torch.Tensor, u_accept, u_residual
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection sampler for drafts drawn from q (Leviathan et al.; vLLM's): per flat position [P], the token it
    emits if reached. At a draft position (draft d, target p, draft distribution q, [P, V] float64 rows) d is
    accepted with probability min(1, p(d) / q(d)) (u_accept * q(d) < p(d)); on rejection the token is drawn from
    normalize(max(0, p - q)) with u_residual. Then P(emit y) = min(p(y), q(y)) + (1 - sum min(p, q)) *
    max(0, p(y) - q(y)) / sum max(0, p - q) = p(y). A bonus position (NO_DRAFT) emits `sampled`, a draw from p.
    A greedy target row (p a point mass) accepts exactly when d is its argmax and otherwise emits the argmax.
    Returns (tokens, accepted), both [P]."""
    is_draft = drafts != NO_DRAFT
    d = drafts.clamp(min=0)[:, None]
    accepted = is_draft & (u_accept * q.gather(1, d).squeeze(1) < p.gather(1, d).squeeze(1))
    residual = (p - q).clamp_(min=0.0)
    drawn = invert_cdf(residual, u_residual)
    drawn = torch.where(residual.sum(-1) > 0, drawn, sampled)  # p == q up to rounding: no residual, draw from p
    return torch.where(accepted, drafts, torch.where(is_draft, drawn, sampled)), accepted


def row_uniforms(rows: list[SamplingRow], stream: int, device) -> torch.Tensor:
    """One float64 uniform per row for speculation's extra draws: a seeded row's keyed by (seed, the output position
    it samples, stream), the others fresh."""
    seeded = [i for i, r in enumerate(rows) if r.params.seed is not None]
    seeds = to_device([rows[i].params.seed for i in seeded], torch.int64, device)
    positions = to_device([rows[i].sample_position for i in seeded], torch.int64, device)
    return uniforms(len(rows), to_device(seeded, torch.int64, device), seeds, positions, stream)

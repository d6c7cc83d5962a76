"""Exactness of speculative verification. With a point-mass (n-gram) draft: for fixed logits at two positions,
the first emitted token follows the target p0 and the second, given the first draft was accepted, follows p1
computed with that draft in the output history (penalties see it), each over >= 100k draws, by chi-square at
ALPHA = 0.001, with temperature, top-k, top-p and presence / frequency penalties on. The same test rejects a
subtly wrong sampler (on rejection, resampling from p instead of from max(0, p - q)) and a wrong history (the
draft left out of position 1's penalties), so it has the power to catch them. Fixed seeds: deterministic.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from gpu.sampling import Sampler, SamplingMetadata, SamplingRow
from gpu.sampling.spec import NO_DRAFT, num_emitted, verify_draft_probs
from gpu.sampling.topk_topp import invert_cdf
from messages.sampling_params import SamplingParams
from tests.test_sampler_distribution import ALPHA, logits_of, p_value, target

V = 40
ROWS, CALLS = 25_000, 8  # 200k draws of the first token; ~100k+ of the second (the draft is likely)
PARAMS = SamplingParams(temperature=0.8, top_k=12, top_p=0.9, frequency_penalty=0.7, presence_penalty=0.3)
HISTORY = [5, 7, 5]


def penalized(logits: torch.Tensor, output: list[int]) -> torch.Tensor:
    x = logits.double().clone()
    for token, count in Counter(output).items():
        x[token] -= PARAMS.frequency_penalty * count + PARAMS.presence_penalty
    return x


def processed(logits: torch.Tensor, output: list[int]) -> np.ndarray:
    return target(penalized(logits, output), PARAMS.temperature, PARAMS.top_k, PARAMS.top_p)


def test_point_mass_verification_is_exact_and_the_test_rejects_wrong_samplers():
    l0, l1 = logits_of(V, seed=11), logits_of(V, seed=12)  # p0: 8 tokens kept, the draft holds 0.5
    p0 = processed(l0, HISTORY)
    draft = int(np.argmax(p0))  # a likely draft: many draws reach the second position
    p1 = processed(l1, [*HISTORY, draft])
    rows = [SamplingRow(PARAMS, [1, 2, 3], HISTORY), SamplingRow(PARAMS, [1, 2, 3], [*HISTORY, draft])] * ROWS
    meta = SamplingMetadata.build(rows, V, "cpu")
    first_only = SamplingMetadata.build(rows[:1] * ROWS, V, "cpu")
    logits = torch.stack([l0, l1]).repeat(ROWS, 1)
    drafts = torch.tensor([draft, NO_DRAFT]).repeat(ROWS)
    counts = torch.full((ROWS,), 2)
    sampler = Sampler()
    torch.manual_seed(0)
    first, wrong_first, second = (np.zeros(V, np.int64) for _ in range(3))
    for _ in range(CALLS):
        sampled = sampler(logits.clone(), meta).sampled
        emitted = num_emitted(sampled == drafts, counts)
        pairs = sampled.view(ROWS, 2)
        first += np.bincount(pairs[:, 0].numpy(), minlength=V)
        second += np.bincount(pairs[emitted == 2, 1].numpy(), minlength=V)
        # the wrong sampler: on a rejection, a fresh draw from p0 (which may be the draft again)
        fresh = sampler(l0.expand(ROWS, -1).clone(), first_only).sampled
        wrong = torch.where(pairs[:, 0] == draft, draft, fresh)
        wrong_first += np.bincount(wrong.numpy(), minlength=V)
    assert second.sum() >= 100_000
    assert p_value(first, p0) > ALPHA
    assert p_value(second, p1) > ALPHA
    assert p_value(wrong_first, p0) < ALPHA  # resampling from p instead of max(0, p - q)
    assert p_value(second, processed(l1, HISTORY)) < ALPHA  # the draft left out of position 1's history


def _draws(q: torch.Tensor, n: int) -> torch.Tensor:
    return invert_cdf(q.expand(n, -1).double(), torch.rand(n, dtype=torch.float64))


@pytest.mark.parametrize("closeness", ["close", "far"])
def test_rejection_sampling_with_a_draft_distribution_is_exact(closeness):
    """Drafts drawn from q (a draft model): the first emitted token follows p0 and the second, given the first draft
    was accepted, p1 (K = 2, temperature / top-k / top-p on), over >= 100k draws each, chi-square at ALPHA; the same
    counts reject a sampler that resamples from p instead of max(0, p - q) after a rejection."""
    params = SamplingParams(temperature=0.9, top_k=15, top_p=0.95)
    l0, l1, l2 = (logits_of(V, seed=s) for s in (21, 22, 23))
    rows = [SamplingRow(params, [1, 2, 3], [])] * (3 * ROWS)
    meta = SamplingMetadata.build(rows, V, "cpu")
    logits = torch.stack([l0, l1, l2]).repeat(ROWS, 1)
    sampler = Sampler()
    p = sampler.probs(logits, meta)
    p0, p1 = p[0].numpy(), p[1].numpy()
    if closeness == "close":
        q0, q1 = (0.8 * p[i] + 0.2 * (p[i] > 0) / (p[i] > 0).sum() for i in (0, 1))
    else:
        q0 = q1 = torch.full((V,), 1.0 / V, dtype=torch.float64)  # uniform: most of its mass where p has none
    counts = torch.full((ROWS,), 3)
    torch.manual_seed(1)
    first, second, wrong = (np.zeros(V, np.int64) for _ in range(3))
    for _ in range(CALLS * 2):
        drafts = torch.stack([_draws(q0, ROWS), _draws(q1, ROWS), torch.full((ROWS,), NO_DRAFT)], 1).flatten()
        q = torch.stack([q0, q1, torch.zeros(V, dtype=torch.float64)]).repeat(ROWS, 1)
        sampled = sampler(logits.clone(), meta).sampled
        u_accept, u_residual = torch.rand(3 * ROWS, dtype=torch.float64), torch.rand(3 * ROWS, dtype=torch.float64)
        tokens, accepted = verify_draft_probs(p, q, drafts, sampled, u_accept, u_residual)
        emitted = num_emitted(accepted, counts)
        pairs = tokens.view(ROWS, 3)
        first += np.bincount(pairs[:, 0].numpy(), minlength=V)
        second += np.bincount(pairs[emitted >= 2, 1].numpy(), minlength=V)
        bad, _ = verify_draft_probs(p, torch.zeros_like(q), drafts, sampled, u_accept, u_residual)  # residual = p
        wrong += np.bincount(
            torch.where(accepted.view(ROWS, 3)[:, 0], pairs[:, 0], bad.view(ROWS, 3)[:, 0]).numpy(), minlength=V
        )
    assert second.sum() >= 100_000
    assert p_value(first, p0) > ALPHA and p_value(second, p1) > ALPHA
    assert p_value(wrong, p0) < ALPHA

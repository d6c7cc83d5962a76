"""Draft-model speculation is exact when sampling, served end to end through the real DraftProposer.

Greedy output cannot show it (acceptance then does not depend on q: tests/test_speculative_e2e.py). Here the target
is a tiny random Llama with a 512-token vocabulary (the full-vocabulary float64 work of verification stays small)
and the draft is the same model with its final norm's weight scaled by 2 * (1 + 0.3 noise) per channel: q is a
sharper, partly reordered p (its top-8 shares 3 to 6 tokens with p's), so about two drafts in three are accepted and
both the acceptance and the residual path run. N requests of one prompt at temperature 0.3, top_k 8, seeds 0..N-1,
through AsyncLLM (engine and detokenizer processes, K = 2). Output position 0 is the target's own sample; position 1
is the first speculated one: max_tokens 3 lets the step after the prefill verify exactly one draft there (then at
most a plain step).

Reference, independent of the engine: HF transformers' forwards of both models over prompt + [t0], processed by the
test suite's sort-based `target` (temperature, top-k). Checked at ALPHA = 0.001 (fixed seeds: deterministic):
- t1 given t0 follows p(. | t0): one chi-square over the (t0, t1) cells, expected n(t0) * p(t1 | t0), with one
  degree of freedom fewer per observed first token (the conditioning); p-value 0.79 when written;
- the accepted drafts (engine counters) match sum over t0 of n(t0) * sum_y min(p, q) (normal approximation of the
  Poisson-binomial): the draft's q is the draft model's, not p (a proposer using p would accept every draft).
Power: the same chi-square, on N draws with the same first tokens from a wrong sampler's law, rejects "accept every
draft" (t1 ~ q; p-value < 1e-300) and "on rejection, resample from p instead of max(0, p - q)" (t1 ~ min(p, q) +
(1 - sum min) p; p-values 1e-31 to 4e-20 over five simulation seeds).
"""

from __future__ import annotations

import asyncio
import shutil
from collections import Counter
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from scipy.stats import chi2, norm
from transformers import LlamaForCausalLM

from actors.engine.config import SpeculativeConfig
from frontend.offline import AsyncLLM
from messages.sampling_params import SamplingParams
from tests.cancel_harness import engine_config
from tests.test_sampler_distribution import ALPHA, target
from tests.tiny_model import make_tiny_model_dir

N, VOCAB = 1000, 512  # (a vocabulary of 512: the full-vocabulary float64 work of verification stays small)
PROMPT = [1, 100, 200, 300, 400]
PARAMS = SamplingParams(temperature=0.3, top_k=8, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """(target, draft) model directories."""
    target_dir = make_tiny_model_dir(tmp_path_factory.mktemp("small-vocab") / "model", seed=0, vocab_size=VOCAB)
    draft_dir = tmp_path_factory.mktemp("sharp-draft") / "model"
    shutil.copytree(target_dir, draft_dir)
    draft = LlamaForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32)
    noise = torch.randn(draft.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        draft.model.norm.weight.mul_(2 * (1 + 0.3 * noise))
    draft.save_pretrained(draft_dir)
    return target_dir, draft_dir


def conditionals(path, first_tokens) -> dict[int, np.ndarray]:
    """t0 -> the model's processed distribution at output position 1 after PROMPT + [t0] (HF's forward)."""
    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([[*PROMPT, t0] for t0 in first_tokens])).logits[:, -1]
    return {t0: target(row, PARAMS.temperature, PARAMS.top_k) for t0, row in zip(first_tokens, logits, strict=True)}


def conditional_p_value(pairs: Counter, law: dict[int, np.ndarray]) -> float:
    """Chi-square of the (t0, t1) counts against n(t0) * law[t0](t1): cells expecting < 5 merged per t0, a t1 the
    law gives no mass rejects outright, one degree of freedom fewer per t0 group beyond the first."""
    stat, cells, groups = 0.0, 0, 0
    for t0, probs in law.items():
        counts = np.zeros(len(probs))
        for (first, t1), n in pairs.items():
            counts[t1] += n if first == t0 else 0
        if counts[probs == 0].any():
            return 0.0
        expected = probs * counts.sum()
        big = expected >= 5
        obs, exp = counts[big], expected[big]
        if expected[~big].sum() > 0:
            obs, exp = np.append(obs, counts[~big].sum()), np.append(exp, expected[~big].sum())
        stat += ((obs - exp) ** 2 / exp).sum()
        cells, groups = cells + len(obs), groups + 1
    return chi2.sf(stat, cells - groups)


def sampled_pairs(first: Counter, law: dict[int, np.ndarray], seed: int) -> Counter:
    """n(t0) draws of t1 from law[t0] for each first token: a sampler with that law, on the served run's t0s."""
    rng, pairs = np.random.default_rng(seed), Counter()
    for t0, n in first.items():
        pairs.update((t0, int(t1)) for t1 in rng.choice(len(law[t0]), size=n, p=law[t0]))
    return pairs


async def test_the_first_speculated_token_follows_the_target_distribution(models):
    model_dir, draft_dir = models
    spec = SpeculativeConfig(method="draft_model", model=str(draft_dir), num_speculative_tokens=2)
    config = engine_config(
        model_dir, speculative=spec, step_gate=False, num_kv_blocks=512, max_num_seqs=256, max_num_batched_tokens=2048
    )
    async with AsyncLLM(config) as llm:
        runs = (llm.generate_one(PROMPT, msgspec.structs.replace(PARAMS, seed=seed)) for seed in range(N))
        outs = await asyncio.gather(*runs)
        engine, _ = await llm.fresh_stats()
    pairs = Counter((o.token_ids[0], o.token_ids[1]) for o in outs)
    first = Counter(o.token_ids[0] for o in outs)
    p, q = conditionals(model_dir, list(first)), conditionals(draft_dir, list(first))
    assert engine.spec_num_drafts == engine.spec_num_draft_tokens == N, engine  # one draft each, at position 1
    assert conditional_p_value(pairs, p) > ALPHA, pairs

    overlap = {t0: np.minimum(p[t0], q[t0]) for t0 in first}  # acceptance probability of a draft after t0
    expected = sum(n * overlap[t0].sum() for t0, n in first.items())
    sd = sum(n * overlap[t0].sum() * (1 - overlap[t0].sum()) for t0, n in first.items()) ** 0.5
    accepted = engine.spec_accepted_per_pos[0]
    assert abs(accepted - expected) < norm.isf(ALPHA / 2) * sd, (accepted, expected, sd)
    assert 0.2 * N < accepted < 0.9 * N  # both paths ran

    resample_p = {t0: overlap[t0] + (1 - overlap[t0].sum()) * p[t0] for t0 in first}
    for wrong in (q, resample_p):
        assert conditional_p_value(sampled_pairs(first, wrong, seed=0), p) < ALPHA
    assert conditional_p_value(sampled_pairs(first, p, seed=0), p) > ALPHA  # (the simulation itself is fair)

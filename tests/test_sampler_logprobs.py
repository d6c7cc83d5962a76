"""Logprobs are raw (log_softmax of the unprocessed logits, whatever the penalties), with the sampled token's
rank and the top-N of each row; or, with logprobs_mode "processed_logprobs", those of the distribution sampled
from (checked against a plain reference of the pipeline)."""

import pytest
import torch

from gpu.sampling import Sampler, SamplingMetadata, SamplingRow
from messages.sampling_params import SamplingParams as SP

PARAMS = [
    SP(temperature=0.0, logprobs=3),
    SP(temperature=0.9, top_p=0.9, logprobs=5, repetition_penalty=1.5, logit_bias={1: 50.0}),
    SP(temperature=1.0),  # asks for none
    SP(top_k=4, logprobs=0, allowed_token_ids=[2, 3, 4, 40]),
    SP(temperature=0.0, logprobs=1, bad_words_token_ids=[[9]]),
]


@pytest.mark.parametrize("vocab", [100, 128])
@pytest.mark.parametrize("params", [PARAMS, [p for p in PARAMS if p.logprobs is not None]], ids=["some", "all"])
def test_raw_logprobs_rank_and_top_n(vocab, params):
    logits = 3.0 * torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(vocab))
    rows = [SamplingRow(p, [1, 2], [9, 1]) for p in params]
    out = Sampler()(logits.clone(), SamplingMetadata.build(rows, vocab, "cpu"))
    lp = torch.log_softmax(logits, -1)
    n = max(p.logprobs for p in params if p.logprobs is not None)
    assert out.logprobs.top_ids.shape == (len(params), n)
    for i, p in enumerate(params):
        if p.logprobs is None:
            continue
        token = out.sampled[i]
        assert out.logprobs.sampled[i] == pytest.approx(lp[i, token].item(), abs=1e-5)
        assert out.logprobs.ranks[i] == (lp[i] >= lp[i, token]).sum()
        top = lp[i].topk(n)
        assert out.logprobs.top_ids[i].tolist() == top.indices.tolist()
        assert torch.allclose(out.logprobs.top_logprobs[i], top.values, atol=1e-5)


def test_greedy_token_has_rank_one_and_only_logprobs_zero_gives_no_top_n():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3))
    rows = [SamplingRow(SP(temperature=0.0, logprobs=0), [], []) for _ in range(4)]
    out = Sampler()(logits.clone(), SamplingMetadata.build(rows, 300, "cpu"))
    assert out.logprobs.ranks.tolist() == [1, 1, 1, 1]
    assert out.logprobs.top_ids.shape == (4, 0)
    assert torch.allclose(out.logprobs.sampled, torch.log_softmax(logits, -1).amax(-1), atol=1e-5)


def test_no_logprobs_requested_returns_none():
    rows = [SamplingRow(SP(), [], [])]
    assert Sampler()(torch.randn(1, 64), SamplingMetadata.build(rows, 64, "cpu")).logprobs is None


PROCESSED = [
    SP(temperature=0.0, logprobs=4, logit_bias={7: 3.0}),  # greedy: log_softmax after the processors
    SP(temperature=0.7, top_k=5, logprobs=6, seed=1),
    SP(temperature=1.3, top_p=0.6, logprobs=3, seed=2, logit_bias={3: 2.0}),
    SP(temperature=1.0, min_p=0.2, top_k=10, top_p=0.9, logprobs=8, seed=3),
    SP(temperature=0.9, allowed_token_ids=[1, 5, 9, 50], logprobs=2, seed=4),
    SP(temperature=1.0, seed=5),  # asks for none
]


def _processed_reference(x: torch.Tensor, p: SP) -> torch.Tensor:
    """The pipeline written plainly in float64: processors (bias, allowed ids), then for a random row temperature,
    min-p, top-k (ties with the k-th kept), top-p over what is left (the token crossing p kept), renormalised."""
    x = x.double().clone()
    for token, bias in (p.logit_bias or {}).items():
        x[token] += bias
    if p.allowed_token_ids:
        keep = torch.zeros_like(x, dtype=torch.bool)
        keep[p.allowed_token_ids] = True
        x[~keep] = float("-inf")
    if p.temperature == 0:
        return x.log_softmax(-1)
    probs = (x / p.temperature).softmax(-1)
    probs[probs < p.min_p * probs.max()] = 0
    if p.top_k > 0:
        probs[x < x.topk(p.top_k).values[-1]] = 0
    values, ids = (probs / probs.sum()).sort(descending=True)
    values[values.cumsum(-1) - values >= p.top_p] = 0
    return torch.zeros_like(probs).scatter_(0, ids, values / values.sum()).log()


@pytest.mark.parametrize("vocab", [100, 128])
def test_processed_logprobs_are_those_of_the_distribution_sampled_from(vocab):
    logits = 2.0 * torch.randn(len(PROCESSED), vocab, generator=torch.Generator().manual_seed(vocab))
    rows = [SamplingRow(p, [], []) for p in PROCESSED]
    meta = SamplingMetadata.build(rows, vocab, "cpu")
    sampler = Sampler(logprobs_mode="processed_logprobs")
    out = sampler(logits.clone(), meta)
    n = max(p.logprobs for p in PROCESSED if p.logprobs is not None)
    for i, p in enumerate(PROCESSED):
        if p.logprobs is None:
            continue
        ref, token = _processed_reference(logits[i], p), out.sampled[i]
        assert out.logprobs.sampled[i] == pytest.approx(ref[token].item(), abs=1e-5)
        assert ref[token].isfinite() and out.logprobs.ranks[i] == (ref >= ref[token]).sum()
        top = torch.tensor(out.logprobs.top_logprobs[i].tolist(), dtype=torch.float64)
        expected = ref.topk(n).values
        finite = expected.isfinite()
        assert torch.equal(top.isfinite(), finite), (i, top, expected)
        assert torch.allclose(top[finite], expected[finite], atol=1e-5)
    # tokens chosen outside the draw (draft verification) get the same logprobs, given the rows' metadata
    again = sampler.logprobs_of(logits.clone(), out.sampled, n, meta)
    asked = [i for i, p in enumerate(PROCESSED) if p.logprobs is not None]
    assert torch.allclose(again.sampled[asked], out.logprobs.sampled[asked], atol=1e-6)
    # and the raw mode differs on the truncated rows (the reference is not trivially the raw one)
    raw = Sampler()(logits.clone(), meta).logprobs
    assert not torch.allclose(raw.top_logprobs[1], out.logprobs.top_logprobs[1], atol=1e-3)

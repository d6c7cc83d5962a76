"""Logprobs are raw (log_softmax of the unprocessed logits, whatever the penalties), with the sampled token's
rank and the top-N of each row."""

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

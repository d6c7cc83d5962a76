"""Greedy decoding through the sampler: disabled sentinels leave plain argmax bit-identical, the block argmax is
torch.argmax, and degenerate logits (NaN, inf, everything masked) have a defined result, whichever draw the random
rows take (the window path, the sort-free search)."""

import pytest
import torch
from msgspec.structs import replace

from gpu.sampling import Sampler, SamplingMetadata, SamplingRow
from gpu.sampling.topk_topp import SMALL, Blocks
from messages.sampling_params import SamplingParams as SP

SENTINELS = [
    {"top_p": 1.0},
    {"top_k": 0},
    {"top_k": -1},
    {"min_p": 0.0},
    {"repetition_penalty": 1.0},
    {"presence_penalty": 0.0},
    {"frequency_penalty": 0.0},
    {"logit_bias": {}},
    {"min_tokens": 0},
    {"bad_words_token_ids": []},
    {"allowed_token_ids": None},
]
ALL_OFF = {k: v for s in SENTINELS for k, v in s.items()}


def sample(logits: torch.Tensor, params: list[SP], output: list[int] | None = None, sort_free="off") -> torch.Tensor:
    rows = [SamplingRow(p, [1, 2, 3], list(output or []), eos_token_ids=[0]) for p in params]
    meta = SamplingMetadata.build(rows, logits.shape[1], "cpu")
    return Sampler(sort_free=sort_free)(logits.clone(), meta).sampled


@pytest.fixture(params=["off", "torch"], ids=["window", "sort_free"])
def sort_free(request) -> str:
    """How random rows are drawn: the window path, or the sort-free search."""
    return request.param


@pytest.mark.parametrize("vocab", [100, 128, 70_000])
@pytest.mark.parametrize("sentinel", [*SENTINELS, ALL_OFF], ids=[*map(str, SENTINELS), "all"])
def test_disabled_sentinels_are_bit_identical_to_argmax(vocab, sentinel):
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab))
    params = [SP(temperature=0.0, **sentinel)] * 6
    assert torch.equal(sample(logits, params, output=[5, 6, 5]), logits.argmax(-1))


def test_block_argmax_is_torch_argmax_with_ties_nan_and_inf():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (12, 64 * 300), generator=g).float()  # many ties at the maximum
    x[1, 5000] = x[1, 17] = float("nan")
    x[2, 9000] = x[2, 100] = float("inf")
    x[3] = float("-inf")
    x[4, :] = 7.0
    x[5, 64 * 299 + 3] = 50.0  # in the last block
    assert x.numel() >= SMALL
    assert torch.equal(Blocks(x).argmax(), x.argmax(-1))
    assert Blocks(x).argmax()[1] == 17 and Blocks(x).argmax()[2] == 100 and Blocks(x).argmax()[3] == 0


RANDOM = SP(temperature=1.0, top_p=0.9)


@pytest.mark.parametrize("params", [SP(temperature=0.0), RANDOM, SP(temperature=0.8), SP(min_p=0.1, top_k=3)])
def test_non_finite_rows_take_their_argmax(params, sort_free):
    """A row whose maximum is NaN or +inf yields its first NaN / +inf, whatever its parameters."""
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(1))
    x[0, [40, 7]] = float("nan")
    x[1, [250, 9]] = float("inf")
    x[2, 3] = float("nan")
    x[2, 2] = float("inf")
    assert sample(x, [params] * 3, sort_free=sort_free).tolist() == [7, 9, 3]


@pytest.mark.parametrize("params", [SP(temperature=0.0), RANDOM, SP(temperature=1.3), SP(top_k=5)])
def test_every_token_masked_yields_token_zero(params, sort_free):
    """allowed_token_ids all banned by bad words: no valid token is left; the row yields token 0, no crash."""
    p = replace(params, allowed_token_ids=[5, 9], bad_words_token_ids=[[5], [9]])
    assert sample(torch.randn(4, 200), [p] * 4, sort_free=sort_free).tolist() == [0] * 4


def test_model_logits_all_minus_inf_yield_token_zero(sort_free):
    x = torch.full((2, 130), float("-inf"))
    assert sample(x, [SP(temperature=0.0), RANDOM], sort_free=sort_free).tolist() == [0, 0]


@pytest.mark.parametrize("params", [SP(temperature=0.0), RANDOM, SP(temperature=2.0), SP(min_p=0.5, top_k=2)])
def test_one_allowed_token_is_always_sampled(params, sort_free):
    p = replace(params, allowed_token_ids=[77])
    assert sample(torch.randn(50, 1000), [p] * 50, sort_free=sort_free).tolist() == [77] * 50


def test_top_k_larger_than_vocab_is_top_k_off(sort_free):
    x = torch.randn(64, 100, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    big = sample(x, [SP(temperature=0.9, top_k=1000)] * 64, sort_free=sort_free)
    torch.manual_seed(0)
    off = sample(x, [SP(temperature=0.9)] * 64, sort_free=sort_free)
    assert torch.equal(big, off)
    assert sample(x, [SP(temperature=0.0, top_k=1000)] * 64).equal(x.argmax(-1))


def test_empty_batch():
    assert sample(torch.empty(0, 100), []).shape == (0,)


@pytest.mark.parametrize("sentinel", [*SENTINELS, ALL_OFF], ids=[*map(str, SENTINELS), "all"])
def test_disabled_sentinels_leave_a_seeded_draw_unchanged(sentinel, sort_free):
    """At temperature > 0 too: a sentinel read as a live value (top_p 1.0 cutting the tail, top_k 0 keeping
    nothing, min_p 0 masking) would move some of 64 seeded draws."""
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(1))
    plain = [SP(temperature=0.9, seed=s) for s in range(64)]
    with_sentinel = [SP(temperature=0.9, seed=s, **sentinel) for s in range(64)]
    reference = sample(logits, plain, output=[5, 6, 5], sort_free=sort_free)
    assert len(set(reference.tolist())) > 10
    assert torch.equal(sample(logits, with_sentinel, output=[5, 6, 5], sort_free=sort_free), reference)

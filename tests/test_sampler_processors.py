"""The logit processors before the argmax, against dense per-row references: penalties (padding never counted),
multi-token bad words, min_tokens, logit bias, allowed ids."""

import torch

from gpu.sampling import SamplingMetadata, SamplingRow
from gpu.sampling.penalties import apply_allowed, apply_ban, apply_logit_bias, apply_penalties
from messages.sampling_params import SamplingParams as SP

V = 50


def processed(rows: list[SamplingRow], logits: torch.Tensor) -> torch.Tensor:
    meta = SamplingMetadata.build(rows, V, "cpu")
    x = logits.clone()
    apply_allowed(x, meta.allowed)
    apply_ban(x, meta.bad_words)
    apply_ban(x, meta.min_tokens)
    apply_logit_bias(x, meta.logit_bias)
    apply_penalties(x, meta.penalties)
    return x


def penalised(x: torch.Tensor, p: SP, prompt: list[int], output: list[int]) -> torch.Tensor:
    """vLLM's dense formula for one row."""
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=V).float()
    seen = counts > 0
    seen[torch.tensor(prompt, dtype=torch.long)] = True
    rep = torch.where(seen, p.repetition_penalty, 1.0)
    x = torch.where(x > 0, x / rep, x * rep)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def test_penalties_match_the_dense_formula_and_never_count_padding():
    cases = [
        (SP(repetition_penalty=1.4), [3, 4, 4], [5, 5, 5, 6]),
        (SP(presence_penalty=0.7, frequency_penalty=0.2), [3, 4], [5, 5, 9]),  # prompt not counted
        (SP(frequency_penalty=-0.5, repetition_penalty=0.8), list(range(20)), []),  # empty output, long prompt
        (SP(presence_penalty=1.0), [], []),  # nothing at all: all padding
        (SP(temperature=0.0), [1], [1, 1]),  # no penalties
        (SP(repetition_penalty=2.0, presence_penalty=-1.0, frequency_penalty=1.5), [7], [7, 8, 7, 7]),
    ]
    logits = torch.randn(len(cases), V, generator=torch.Generator().manual_seed(0)) * 3
    got = processed([SamplingRow(p, prompt, out) for p, prompt, out in cases], logits)
    for i, (p, prompt, out) in enumerate(cases):
        expected = penalised(logits[i], p, prompt if p.repetition_penalty != 1.0 else [], out)
        assert torch.allclose(got[i], expected, atol=1e-6), i


def test_bad_words_ban_the_last_token_after_their_prefix():
    bad = [[5], [10, 11], [20, 21, 22], [30, 31]]
    outputs = {(): {5}, (10,): {5, 11}, (1, 20, 21): {5, 22}, (20,): {5}, (30, 1): {5}, (1, 30): {5, 31}}
    rows = [SamplingRow(SP(bad_words_token_ids=bad), [30], list(o)) for o in outputs]
    x = processed(rows, torch.zeros(len(rows), V))
    for i, banned in enumerate(outputs.values()):
        assert set(torch.nonzero(x[i].isinf()).flatten().tolist()) == banned


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    p = SP(min_tokens=3, stop_token_ids=[7, 8])
    rows = [
        SamplingRow(p, [], [1, 2], eos_token_ids=[0, 49]),  # 2 < 3: masked
        SamplingRow(p, [], [1, 2, 3], eos_token_ids=[0]),  # reached
        SamplingRow(SP(min_tokens=3, ignore_eos=True), [], [], eos_token_ids=[0]),  # EOS is not a stop token
    ]
    x = processed(rows, torch.zeros(3, V))
    assert [set(torch.nonzero(r.isinf()).flatten().tolist()) for r in x] == [{0, 7, 8, 49}, set(), set()]


def test_logit_bias_is_added_and_clamped():
    rows = [SamplingRow(SP(logit_bias={3: 5.0, 4: -250.0, 5: 1e6}), [], []), SamplingRow(SP(), [], [])]
    x = processed(rows, torch.zeros(2, V))
    assert x[0, [3, 4, 5]].tolist() == [5.0, -100.0, 100.0]
    assert x[0].abs().sum() == 205.0 and x[1].abs().sum() == 0


def test_allowed_token_ids_keep_only_those():
    logits = torch.randn(2, V)
    rows = [SamplingRow(SP(allowed_token_ids=[4, 9, 4]), [], []), SamplingRow(SP(), [], [])]
    x = processed(rows, logits)
    assert torch.nonzero(x[0].isfinite()).flatten().tolist() == [4, 9]
    assert x[0, [4, 9]].equal(logits[0, [4, 9]]) and x[1].equal(logits[1])

"""The sort-free draw (gpu/sampling/threshold.py, and its Triton kernel threshold_triton.py) is exact.

- Chi-square (ALPHA = 0.001, 32k draws, fixed seeds) of the torch search against each transform's analytic target,
  and the same test rejecting the search with one deliberate mistake: the top-p boundary token dropped, top-k off by
  one, min-p applied after top-p, top-p before top-k, the nucleus of the untempered distribution, no temperature.
- A tie group at the top-p boundary is kept whole (as top-k's), chi-square again.
- For the same uniforms (seeded rows) it draws the window path's tokens: the distribution suite's parameter sets and
  a batch of language-model-like rows with mixed parameters.
- The Triton kernel (in the interpreter on CPU; compiled on a GPU, where two rows may differ near a boundary) returns
  the torch search's tokens, on rows with mixed parameters and edge cases, through several chunks (its sm_90 compile: tests/test_triton_compile.py).
On a GPU the distribution suite also draws through the kernel (tests/test_sampler_distribution.py, cuda-threshold).
"""

import msgspec
import numpy as np
import pytest
import torch

from gpu.sampling import Sampler, SamplingMetadata, SamplingRow, threshold
from gpu.sampling.threshold import threshold_draw, thresholds
from gpu.sampling.topk_topp import MIN_P, TOP_K, TOP_P, T, uniforms
from messages.sampling_params import SamplingParams as SP
from scripts.bench_sampler import make_logits
from tests import test_sampler_distribution as suite
from tests.test_sampler_distribution import (
    ALPHA,
    CASES,
    WIDE,
    check,
    draw,
    logits_of,
    one_thread,  # noqa: F401 (an autouse fixture: one torch thread here too)
    p_value,
    target,
)

N = 8_000  # rows per call: 4 calls, 32k draws
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (the kernel tests: compiled on a GPU, interpreted here)


def changed(column: int, value=None, add=0):
    """`thresholds` searched with one parameter wrong (the draw still applies min-p and T as given)."""

    def wrong(x, row_max, cols, meta):
        cols = cols.clone()
        cols[:, column] = cols[:, column] + add if value is None else value
        return thresholds(x, row_max, cols, meta)

    return wrong


def boundary_dropped(x, row_max, cols, meta):
    """The nucleus without the token that crosses p: the threshold moved up to the next logit."""
    tau = thresholds(x, row_max, cols, meta)
    return torch.where(x > tau[:, None], x, float("inf")).amin(-1)


def top_p_before_top_k(x, row_max, cols, meta):
    """The nucleus measured over the whole vocabulary instead of the top-k survivors."""
    whole, top_k_only = cols.clone(), cols.clone()
    whole[:, TOP_K], top_k_only[:, TOP_P] = x.shape[1], 1.0
    return torch.maximum(thresholds(x, row_max, whole, meta), thresholds(x, row_max, top_k_only, meta))


def temperature_ignored(x, row_max, cols):
    """The weights at T = 1 (for min-p and the draw alike)."""
    return (x - row_max[:, None]).exp()


MISTAKES = {
    # name: (vocab, logits seed, params, target kwargs, (the function of `threshold` replaced, by a wrong one))
    "top_p": (40, 0, SP(top_p=0.8), {"top_p": 0.8}, ("thresholds", boundary_dropped)),
    "top_k": (
        40,
        0,
        SP(temperature=0.9, top_k=5),
        {"temperature": 0.9, "top_k": 5},
        ("thresholds", changed(TOP_K, add=1)),
    ),
    "min_p_top_p": (40, 0, SP(top_p=0.9, min_p=0.1), {"top_p": 0.9, "min_p": 0.1}, ("thresholds", changed(MIN_P, 0.0))),
    "top_k_top_p": (40, 0, SP(top_k=8, top_p=0.7), {"top_k": 8, "top_p": 0.7}, ("thresholds", top_p_before_top_k)),
    "temperature_top_p": (
        40,
        0,
        SP(temperature=0.6, top_p=0.85),
        {"temperature": 0.6, "top_p": 0.85},
        ("thresholds", changed(T, 1.0)),  # the nucleus of the untempered distribution
    ),
    "min_p": (
        40,
        0,
        SP(temperature=1.5, min_p=0.1),
        {"temperature": 1.5, "min_p": 0.1},
        ("weights", temperature_ignored),
    ),
    "all_wide": (
        80,
        1,
        SP(temperature=0.8, top_k=60, top_p=0.97, min_p=0.005),
        {"temperature": 0.8, "top_k": 60, "top_p": 0.97, "min_p": 0.005},
        ("thresholds", boundary_dropped),
    ),
}


@pytest.mark.parametrize("name", MISTAKES)
def test_search_matches_its_target_and_the_test_rejects_a_wrong_search(name, monkeypatch):
    vocab, seed, params, kwargs, (function, mistake) = MISTAKES[name]
    x = logits_of(vocab, seed=seed)
    exact = target(x, **kwargs)
    assert p_value(draw(x, params, n=N, sort_free="torch"), exact) > ALPHA
    monkeypatch.setattr(threshold, function, mistake)
    assert p_value(draw(x, params, n=N, sort_free="torch"), exact) < ALPHA


def test_a_tie_at_the_top_p_boundary_is_kept_whole():
    """Tokens 1 and 2 tie; p is crossed inside the tie: both are kept (the sorted path keeps the one it sorts first)."""
    x = torch.tensor([3.0, 2.0, 2.0, 1.0] + [0.0] * 36)
    p = np.exp(x.double().numpy()) / np.exp(x.double().numpy()).sum()
    counts = draw(x, SP(top_p=float(p[0] + 0.5 * p[1])), n=N, sort_free="torch")
    kept = np.where(np.arange(40) < 3, p, 0.0)
    first = np.where(np.arange(40) < 2, p, 0.0)
    check(counts, kept / kept.sum(), first / first.sum())


def test_top_k_keeps_every_token_tied_with_the_kth():
    suite.test_top_k_keeps_every_token_tied_with_the_kth({"sort_free": "torch"})


def seeded_tokens(logits: torch.Tensor, params: list[SP], **sampler) -> torch.Tensor:
    """One seeded row per params (seed = its row): the same uniforms whichever path draws."""
    rows = [SamplingRow(msgspec.structs.replace(p, seed=i), [], []) for i, p in enumerate(params)]
    meta = SamplingMetadata.build(rows, logits.shape[1], "cpu", window=sampler.pop("window", 64))
    return Sampler(**sampler)(logits.clone(), meta).sampled


@pytest.mark.parametrize("name", [*CASES, *(f"wide_{k}" for k in WIDE)])
def test_same_tokens_as_the_window_path_for_the_same_uniforms(name):
    vocab, params, seed, window = (
        (80, WIDE[name[5:]][0], 1, 4) if name.startswith("wide_") else (*CASES[name][:2], 0, 64)
    )
    x = logits_of(vocab, seed=seed).expand(2000, -1)
    reference = seeded_tokens(x, [params] * 2000, window=window)
    assert len(set(reference.tolist())) > 1 and torch.equal(
        seeded_tokens(x, [params] * 2000, sort_free="torch"), reference
    )


def lm_batch(b: int, vocab: int) -> tuple[torch.Tensor, list[SP]]:
    """Language-model-like logits (the sampler benchmark's) and a mix of truncations, one row each."""
    mix = [
        SP(temperature=0.7, top_p=0.9),
        SP(temperature=0.8, top_k=50, top_p=0.95),
        SP(temperature=1.0),
        SP(temperature=0.7, min_p=0.05),
        SP(temperature=1.2, top_k=200, top_p=0.99, min_p=0.001),
        SP(temperature=0.5, top_k=3),
    ]
    return make_logits(b, vocab, "peaked", "cpu"), [mix[i % len(mix)] for i in range(b)]


def test_language_model_rows_draw_the_window_paths_tokens():
    x, params = lm_batch(120, 8192)
    assert torch.equal(seeded_tokens(x, params, sort_free="torch"), seeded_tokens(x, params))


def kernel_rows() -> tuple[torch.Tensor, list[SP]]:
    """Rows for the kernel: a mix on random logits, then edge cases (masked tokens, ties at each boundary, bf16
    logits full of ties, extreme temperatures, top-k beyond the finite tokens, min-p = 1, a tiny top-p)."""
    g = torch.Generator().manual_seed(3)
    x = 2.0 * torch.randn(16, 300, generator=g)
    x[8, 10:] = float("-inf")  # 10 finite tokens
    x[9, :6] = torch.tensor([4.0, 3.0, 3.0, 3.0, 2.5, 2.5])
    x[10] = x[10].bfloat16().float()
    params = [
        SP(temperature=0.7, top_p=0.9),
        SP(temperature=0.8, top_k=50, top_p=0.95),
        SP(temperature=1.0),
        SP(temperature=0.7, min_p=0.05),
        SP(top_k=40, top_p=0.97, min_p=0.01),
        SP(temperature=1e-3, top_p=0.9),
        SP(temperature=50.0, top_k=250, top_p=0.5),
        SP(top_k=1),
        SP(top_k=20, top_p=0.99),  # top-k beyond the 10 finite tokens
        SP(top_k=2, top_p=0.6),  # top-k ends inside the tie at 3.0
        SP(temperature=0.3, top_k=30, top_p=0.9),  # bf16
        SP(min_p=1.0),
        SP(top_p=1e-9),
        SP(temperature=2.0, top_k=299, min_p=0.2),
        SP(temperature=0.9, top_p=0.999_999_9),  # 1 - p below the kernel's slack for the mass bound
        SP(temperature=0.6, top_k=7),
    ]
    return x, params


def test_kernel_returns_the_torch_searchs_tokens():
    from gpu.sampling.threshold_triton import threshold_draw_triton

    x, params = kernel_rows()
    x = x.to(DEVICE)
    rows = [SamplingRow(msgspec.structs.replace(p, seed=i), [], []) for i, p in enumerate(params)]
    meta = SamplingMetadata.build(rows, x.shape[1], DEVICE)
    u = uniforms(len(rows), meta.seeded_rows, meta.seeds, meta.positions)
    cols = torch.cat([meta.params, u[:, None], torch.zeros_like(u)[:, None]], 1)
    row_max = x.amax(-1)
    expected = threshold_draw(x, row_max, cols, meta)
    assert len(set(expected.tolist())) > 8
    differ = (threshold_draw_triton(x, row_max, cols, meta, block=128) != expected).sum()
    assert differ <= (2 if x.is_cuda else 0)  # (compiled: Triton's exp rounds unlike torch's, near a boundary)


def test_kernel_rows_without_a_finite_maximum_take_their_argmax():
    x = torch.randn(3, 100, device=DEVICE)
    x[0, 5], x[1, 7], x[2] = float("nan"), float("inf"), float("-inf")
    meta = SamplingMetadata.build([SamplingRow(SP(top_p=0.9, top_k=5), [], [])] * 3, 100, DEVICE)
    assert Sampler(sort_free="triton", fused=False)(x, meta).sampled.tolist() == [5, 7, 0]

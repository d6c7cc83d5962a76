"""Exactness: the empirical distribution of 100k draws from fixed logits matches the analytic target of each
transform and combination (chi-square, significance level ALPHA = 0.001), and the same test rejects a subtly
wrong target (the classic ordering / boundary mistakes), so it has the power to catch them.

The draws are batched as many identical rows; seeds are fixed, so the outcome is deterministic. The transforms are
drawn by the sort-free search too (gpu/sampling/threshold.py; more in tests/test_sampler_threshold.py), and on CUDA
when a GPU is present: the torch window path, FlashInfer's sampler when it is installed, the sort-free Triton kernel.
Torch runs one thread here: on a shared 2-core machine its two OpenMP threads spin against the load (20-40x slower
for these many-row, short-row ops, measured).
"""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from gpu.sampling import Sampler, SamplingMetadata, SamplingRow
from gpu.sampling.topk_topp import flashinfer_available
from messages.sampling_params import SamplingParams as SP

ALPHA = 1e-3
ROWS, CALLS = 25_000, 4  # 100k draws
PATHS = {  # the `device` fixture's values: (device, Sampler arguments)
    "cpu": ("cpu", {}),
    "cpu-threshold": ("cpu", {"sort_free": "torch"}),
    "cuda": ("cuda", {"flashinfer": False, "sort_free": "off", "fused": False}),
    "cuda-flashinfer": ("cuda", {"flashinfer": True, "sort_free": "off", "fused": False}),
    "cuda-threshold": ("cuda", {"flashinfer": False, "sort_free": "triton", "fused": False}),
    "cuda-fused": ("cuda", {"fused": True}),
}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def logits_of(vocab: int, seed: int = 0, scale: float = 1.5) -> torch.Tensor:
    return scale * torch.randn(vocab, generator=torch.Generator().manual_seed(seed))


def target(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, wrong=None) -> np.ndarray:
    """The analytic distribution (float64, sort-based); `wrong` names a deliberate mistake."""
    x = logits.double().numpy()
    t = 1.0 if wrong in ("temperature_after_truncation", "temperature_ignored") else temperature
    p = np.exp((x - x.max()) / t)
    p /= p.sum()
    order = np.argsort(-x, kind="stable")
    keep = np.zeros(len(x), bool)
    keep[order[: (top_k if top_k > 0 else len(x)) + (wrong == "top_k_off_by_one")]] = True
    keep &= p >= min_p * p.max()
    q = p * keep if wrong != "top_p_before_top_k" else p
    q = q / q.sum()
    cum = np.cumsum(q[order])
    before = cum - q[order]
    nucleus = cum <= top_p if wrong == "top_p_without_boundary_token" else before < top_p
    final = np.zeros(len(x))
    final[order[nucleus]] = p[order[nucleus]]
    final *= keep
    if wrong == "temperature_after_truncation":
        final = np.where(final > 0, np.exp((x - x.max()) / temperature), 0.0)
    return final / final.sum()


def draw(
    logits: torch.Tensor,
    params: SP,
    window: int = 64,
    dynamic=None,
    output=(),
    seed=0,
    device="cpu",
    n: int = ROWS,
    **sampler,
) -> np.ndarray:
    """CALLS x n draws. device: a PATHS key; `sampler`: more Sampler arguments (sort_free=...)."""
    device, kwargs = PATHS[device]
    rows = [SamplingRow(params, [1, 2, 3], list(output), eos_token_ids=[0])] * n
    draws = Sampler(dynamic_fallback=dynamic, **kwargs, **sampler)
    meta = SamplingMetadata.build(rows, len(logits), device, window=window, edits=draws.fuses(torch.device(device)))
    torch.manual_seed(seed)
    counts = np.zeros(len(logits), np.int64)
    logits = logits.to(device)
    for _ in range(CALLS):
        tokens = draws(logits.expand(n, -1).clone(), meta).sampled
        counts += np.bincount(tokens.cpu().numpy(), minlength=len(logits))
    return counts


@pytest.fixture(
    params=[
        "cpu",
        "cpu-threshold",
        pytest.param("cuda", marks=pytest.mark.cuda),
        pytest.param("cuda-flashinfer", marks=pytest.mark.cuda),
        pytest.param("cuda-threshold", marks=pytest.mark.cuda),
        pytest.param("cuda-fused", marks=pytest.mark.cuda),
    ]
)
def device(request):
    """Where the draws run: CPU (the window path, the sort-free search in torch), CUDA's torch window path,
    FlashInfer's kernel (when installed), the sort-free search's Triton kernel, the fused sampler's kernels."""
    if request.param == "cuda-flashinfer" and not flashinfer_available(torch.empty(0, device="cuda")):
        pytest.skip("flashinfer is not installed")
    return request.param


def p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value; a draw of a zero-probability token rejects outright. Bins expecting < 5 are merged."""
    if counts[probs == 0].any():
        return 0.0
    expected = probs * counts.sum()
    small = (expected < 5) & (probs > 0)
    obs = np.append(counts[expected >= 5], counts[small].sum())
    exp = np.append(expected[expected >= 5], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp).pvalue


def check(counts, good: np.ndarray, bad: np.ndarray) -> None:
    assert p_value(counts, good) > ALPHA
    assert not np.allclose(good, bad), "the wrong target must differ"
    assert p_value(counts, bad) < ALPHA


CASES = {
    # name: (vocab, params, target kwargs, wrong variant)
    "temperature": (40, SP(temperature=0.7), {"temperature": 0.7}, "temperature_ignored"),
    "top_k": (40, SP(temperature=0.9, top_k=5), {"temperature": 0.9, "top_k": 5}, "top_k_off_by_one"),
    "top_p": (40, SP(top_p=0.8), {"top_p": 0.8}, "top_p_without_boundary_token"),
    "min_p": (40, SP(temperature=1.5, min_p=0.1), {"temperature": 1.5, "min_p": 0.1}, "temperature_after_truncation"),
    "top_k_top_p": (40, SP(top_k=8, top_p=0.7), {"top_k": 8, "top_p": 0.7}, "top_p_before_top_k"),
    "temperature_top_p": (
        40,
        SP(temperature=0.6, top_p=0.85),
        {"temperature": 0.6, "top_p": 0.85},
        "temperature_after_truncation",
    ),
    "all": (
        50,
        SP(temperature=0.8, top_k=12, top_p=0.9, min_p=0.02),
        {"temperature": 0.8, "top_k": 12, "top_p": 0.9, "min_p": 0.02},
        "top_p_before_top_k",
    ),
    "vocab_blocks": (200, SP(temperature=1.2), {"temperature": 1.2}, "temperature_ignored"),
    "whole_blocks": (
        128,
        SP(temperature=0.9, top_p=0.95),
        {"temperature": 0.9, "top_p": 0.95},
        "top_p_without_boundary_token",
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_transform_matches_its_target(name, device):
    vocab, params, kwargs, wrong = CASES[name]
    x = logits_of(vocab)
    check(draw(x, params, device=device), target(x, **kwargs), target(x, **kwargs, wrong=wrong))


# Kept sets wider than both CPU window levels (4 and 8 x 4 tokens here): exact through the CPU threshold window
# (dynamic) and through the sorted rows (the static path).
WIDE = {
    "top_p": (SP(temperature=1.0, top_p=0.95), {"top_p": 0.95}),
    "top_k": (SP(temperature=0.8, top_k=40), {"temperature": 0.8, "top_k": 40}),
    "min_p": (SP(temperature=1.0, min_p=0.01), {"min_p": 0.01}),
    "top_k_top_p": (SP(top_k=60, top_p=0.97), {"top_k": 60, "top_p": 0.97}),
}


@pytest.mark.parametrize("dynamic", [True, False], ids=["threshold_window", "sorted_rows"])
@pytest.mark.parametrize("name", WIDE)
def test_kept_set_wider_than_the_window_is_exact(name, dynamic):
    params, kwargs = WIDE[name]
    x = logits_of(80, seed=1)
    window_only = target(x, **{**kwargs, "top_k": min(kwargs.get("top_k", 4), 4)})  # what a window of 4 would give
    assert (target(x, **kwargs) > 0).sum() > 8 * 4
    check(draw(x, params, window=4, dynamic=dynamic), target(x, **kwargs), window_only)


def test_penalties_bias_and_masks_match_their_target():
    vocab, output = 40, [3, 3, 7, 12, 3]
    x = logits_of(vocab, seed=2)
    params = SP(
        temperature=0.9,
        top_p=0.95,
        repetition_penalty=1.5,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logit_bias={4: 2.0, 6: -1.5},
        allowed_token_ids=list(range(30)),
        bad_words_token_ids=[[5], [12, 9], [3, 8]],  # [3, 8]: the output ends with 3, so 8 is banned
    )

    def processed(rep_counts_prompt: bool) -> torch.Tensor:
        y = x.clone().double()
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[output] = True
        if rep_counts_prompt:
            seen[[1, 2, 3]] = True  # the prompt
        y = torch.where(seen, torch.where(y > 0, y / 1.5, y * 1.5), y)
        counts = torch.bincount(torch.tensor(output), minlength=vocab).double()
        y = y - 0.3 * counts - 0.5 * (counts > 0)
        y[4] += 2.0
        y[6] -= 1.5
        y[30:] = y[[5, 8]] = float("-inf")
        return y

    kwargs = {"temperature": 0.9, "top_p": 0.95}
    check(draw(x, params, output=output), target(processed(True), **kwargs), target(processed(False), **kwargs))


def test_penalties_apply_before_temperature():
    """(x - penalty) / T, not x / T - penalty: at T = 0.5 the two differ by a factor of two in the penalty."""
    vocab = 40
    x = logits_of(vocab, seed=4)
    top = x.argsort(descending=True).tolist()
    output = [top[0], top[0], top[1]]  # penalise the likeliest tokens: the orders differ most there
    counts = torch.bincount(torch.tensor(output), minlength=vocab).double()
    penalty = 0.8 * counts + 0.6 * (counts > 0)
    params = SP(temperature=0.5, frequency_penalty=0.8, presence_penalty=0.6)
    good = target(x.double() - penalty, temperature=0.5)
    bad = target(x.double() - 0.5 * penalty, temperature=0.5)  # what penalising after temperature amounts to
    check(draw(x, params, output=output), good, bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_sample_their_float32_values(dtype):
    x = logits_of(40, seed=5).to(dtype)
    params = SP(temperature=0.9, top_p=0.9)
    exact = target(x.float(), temperature=0.9, top_p=0.9)
    check(draw(x, params), exact, target(x.float(), temperature=0.9, top_p=0.9, wrong="top_p_without_boundary_token"))


def test_tiny_temperature_is_sampled_not_greedy():
    """T = 1e-3 is above the greedy threshold (1e-5): a draw from a very peaked distribution, no overflow."""
    x = torch.tensor([2.0, 2.0005, 1.0, 2.0015, -1.0] + [0.0] * 35)
    counts = draw(x, SP(temperature=1e-3))
    exact = target(x, temperature=1e-3)
    assert 0.5 < exact[3] < 0.9 and counts[[0, 1, 3]].sum() == counts.sum()
    check(counts, exact, target(x, temperature=1e-2))


@pytest.mark.parametrize("kw", [{}, {"window": 4}, {"dynamic": False}], ids=["window", "tie_past_window", "static"])
def test_top_k_keeps_every_token_tied_with_the_kth(kw):
    """As vLLM: top-k keeps the tokens whose logit is at least the k-th largest, so ties at the boundary never
    depend on the order a kernel returns them in (also when the tie runs past the window)."""
    x = torch.tensor([3.0, 2.0, 1.0, 1.0, 1.0, 0.5] + [0.0] * 34)
    counts = draw(x, SP(temperature=1.0, top_k=3), **kw)
    p = np.exp(x.double().numpy())
    p[5:] = 0.0
    check(counts, p / p.sum(), target(x, top_k=3))  # the wrong one keeps exactly 3 tokens

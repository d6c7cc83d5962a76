"""Mixed batches: greedy and seeded rows give the same tokens whatever else is in the batch and whatever their
position; seeds are honoured and distinct; the exact wide-window paths agree token for token."""

import msgspec
import numpy as np
import pytest
import torch
from scipy.stats import kstest

from gpu.sampling import MetadataCache, Sampler, SamplingMetadata, SamplingRow
from gpu.sampling.topk_topp import counter_uniforms
from messages.sampling_params import SamplingParams as SP
from messages.sampling_params import child_seed

V = 500
REQUESTS = {
    "greedy": SP(temperature=0.0),
    "greedy_penalised": SP(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, logit_bias={3: 5.0}),
    "seeded_top_p": SP(temperature=0.8, top_p=0.9, seed=11),
    "seeded_temperature": SP(temperature=1.0, seed=12),
    "seeded_top_k_min_p": SP(top_k=20, min_p=0.05, seed=13, presence_penalty=0.5),
    "seeded_wide_nucleus": SP(temperature=1.1, top_p=0.99, seed=14, bad_words_token_ids=[[7, 8]]),
    "seeded_all": SP(temperature=0.7, top_k=200, top_p=0.95, min_p=0.01, seed=-5, min_tokens=3),
    "unseeded": SP(temperature=0.9),
    "unseeded_top_k": SP(top_k=5, logprobs=2),
}
DETERMINISTIC = [k for k, p in REQUESTS.items() if p.greedy or p.seed is not None]


def logits_for(key: str, step: int) -> torch.Tensor:
    """The logits a request sees at a step: a function of the request, never of the batch."""
    seed = sum(map(ord, key)) * 100 + step
    return 2.0 * torch.randn(V, generator=torch.Generator().manual_seed(seed))


def run(keys: list[str], steps: int = 6, **sampler_kw) -> dict[str, list[int]]:
    window = sampler_kw.pop("window", 64)
    sampler = Sampler(**sampler_kw)
    out = {k: [] for k in keys}
    for step in range(steps):
        rows = [SamplingRow(REQUESTS[k], [1, 2, 3], out[k], eos_token_ids=[0]) for k in keys]
        meta = SamplingMetadata.build(rows, V, "cpu", window=window)
        logits = torch.stack([logits_for(k, step) for k in keys])
        for k, token in zip(keys, sampler(logits, meta).sampled.tolist(), strict=True):
            out[k].append(token)
    return out


def test_rows_in_a_mixed_batch_equal_the_rows_alone():
    batch = run(list(REQUESTS))
    for key in DETERMINISTIC:
        assert batch[key] == run([key])[key], key


def test_seeded_rows_do_not_depend_on_position_or_company():
    keys = list(REQUESTS)
    reference = run(keys)
    shuffled = run(keys[::-1])
    fewer = run([k for k in keys if k != "seeded_temperature"])
    for key in DETERMINISTIC:
        assert shuffled[key] == reference[key], key
        if key in fewer:
            assert fewer[key] == reference[key], key


@pytest.mark.parametrize(
    "kw", [{"window": 4}, {"dynamic_fallback": False}, {"window": 4, "dynamic_fallback": False}, {"sort_free": "torch"}]
)
def test_wide_paths_draw_the_same_tokens_as_the_window(kw):
    """One uniform per row, inverted over the same kept set in token-id order: the window, the CPU threshold window,
    the sorted row and the sort-free search are exact alike, so a seeded row yields identical tokens through any."""
    reference = run(DETERMINISTIC)
    assert run(DETERMINISTIC, **kw) == reference


@pytest.mark.parametrize("params", [SP(temperature=0.8, top_k=8), SP(top_p=0.9), SP(min_p=0.02)])
def test_seeded_draw_survives_last_bit_swaps_of_near_tied_logits(params):
    """The model's logits move in the last bits with the batch composition (CPU matmuls are not batch-invariant).
    Near-tied kept tokens swapping value order must not move a seeded token: 2000 seeds, same tokens. (A draw
    inverting the CDF in value order moves every seed whose uniform falls in a swapped pair: 35-100% of them here.)"""
    x = logits_for("ties", 0)
    top = x.topk(8).indices.sort().values.tolist()
    swapped = x.clone()
    for a, b in zip(top[0::2], top[1::2], strict=True):  # pairs (a < b): a just above b, then b just above a
        x[a] = torch.nextafter(x[b], torch.tensor(float("inf")))
        swapped[a], swapped[b] = x[b], x[a]
    assert x.argsort(descending=True)[:8].tolist() != swapped.argsort(descending=True)[:8].tolist()

    def tokens(logits: torch.Tensor) -> list[int]:
        rows = [SamplingRow(msgspec.structs.replace(params, seed=seed), [], []) for seed in range(2000)]
        return Sampler()(logits.expand(2000, V).clone(), SamplingMetadata.build(rows, V, "cpu")).sampled.tolist()

    reference = tokens(x)
    assert len(set(reference)) > 2 and tokens(swapped) == reference


def test_different_seeds_give_different_tokens_and_a_position_its_own():
    def tokens(seed: int) -> list[int]:
        params = SP(temperature=1.0, top_p=0.95, seed=seed)
        metas = [SamplingMetadata.build([SamplingRow(params, [], [], position)], V, "cpu") for position in range(20)]
        return [Sampler()(logits_for("x", 0)[None], meta).sampled.item() for meta in metas]

    assert tokens(1) == tokens(1)
    assert tokens(1) != tokens(2)
    assert len(set(tokens(1))) > 3  # each output position draws its own uniform


def test_counter_uniforms_are_uniform_and_keyed_by_seed_and_position():
    """Kolmogorov-Smirnov at ALPHA = 0.001 over 100k (seed, position) pairs; it rejects a skewed variant."""
    seeds = torch.arange(-50, 50).repeat_interleave(1000)
    positions = torch.arange(1000).repeat(100)
    u = counter_uniforms(seeds, positions).numpy()
    assert kstest(u, "uniform").pvalue > 1e-3 and u.min() >= 0.0 and u.max() < 1.0
    assert kstest(np.sqrt(u), "uniform").pvalue < 1e-3  # the test has the power to reject a wrong law
    assert len(np.unique(u)) == len(u)
    one = counter_uniforms(torch.tensor([7]), torch.tensor([3]))
    assert one.item() == counter_uniforms(torch.tensor([7, 7]), torch.tensor([2, 3]))[1].item()


def test_child_seeds_are_distinct_and_in_range():
    seeds = [child_seed(42, i) for i in range(128)]
    assert seeds[0] == 42 and len(set(seeds)) == 128
    for seed in (2**63 - 1, -(2**63)):
        assert all(-(2**63) <= child_seed(seed, i) < 2**63 for i in range(4))
        assert 0.0 <= counter_uniforms(torch.tensor([child_seed(seed, 3)]), torch.tensor([5])).item() < 1.0


def test_metadata_is_reused_only_while_nothing_in_it_can_change():
    """Rows are the same requests when they hold the same output lists (one per request) and params; a seeded
    row's position is set afresh."""
    cache = MetadataCache(V, "cpu")
    shared = SP(temperature=0.7, top_p=0.9)  # two requests may share one params object
    params = [shared, shared, SP(top_k=5, seed=3)]
    outputs = [[], [], []]

    def rows(extra: SP | None = None, extra_output: list[int] | None = None) -> list[SamplingRow]:
        ps, outs = params + ([extra] if extra else []), outputs + ([extra_output] if extra else [])
        return [SamplingRow(p, [1, 2], o) for p, o in zip(ps, outs, strict=True)]

    first = cache.build(rows())
    assert first.positions.tolist() == [0]
    for out in outputs:
        out.append(5)
    assert cache.build(rows()) is first  # the same requests, one token on: nothing reads the output
    assert first.positions.tolist() == [1]
    outputs[0] = [5]  # another request with the same params object in row 0
    assert cache.build(rows()) is not first
    joined = cache.build(rows(SP(temperature=1.0), []))
    assert joined is not first and len(joined.greedy) == 4
    penalised, seen = SP(presence_penalty=1.0), [5]
    a = cache.build(rows(penalised, seen))
    seen.append(5)
    b = cache.build(rows(penalised, seen))
    assert a is not b and b.penalties.token_ids.shape[1] == 2  # counts follow the output
    held, history = SP(min_tokens=2), []
    unmet = cache.build(rows(held, history))
    history.append(7)
    assert cache.build(rows(held, history)) is not unmet  # EOS masked until the 2nd token
    history.append(8)
    released = cache.build(rows(held, history))
    history.append(9)
    assert cache.build(rows(held, history)) is released and released.min_tokens is None

"""Speculative decoding, unit level: the n-gram proposer, the vectorised verification of point-mass drafts,
and multi-token steps through the scheduler (a request gains 1..K+1 tokens; nothing after its end gets out;
rejected drafts' KV is rolled back and lookahead blocks freed; the engine ends idle)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from actors.engine.metrics import SpecStats
from actors.engine.speculative import propose_ngram
from gpu.sampling import Sampler, SamplingMetadata, SamplingRow
from gpu.sampling.spec import NO_DRAFT, num_emitted, row_uniforms, verify_draft_probs
from messages.sampling_params import SamplingParams
from tests.scheduler_harness import EOS, Harness, chain, expected, prompts


def test_ngram_proposes_what_followed_the_most_recent_longest_match():
    seq = np.array([1, 2, 3, 9, 1, 2, 3, 8, 7, 5, 2, 3])
    assert propose_ngram(seq, 2, 1, 3) == [8, 7]  # "2 3" (no "5 2 3" earlier) most recently followed by 8
    assert propose_ngram(seq, 2, 3, 3) == []  # no earlier "5 2 3"
    assert propose_ngram(np.array([4, 4, 4]), 5, 1, 4) == [4]  # "4 4" recurs at 0, one token follows it
    assert propose_ngram(np.array([1, 2, 3, 4, 1, 2]), 10, 2, 2) == [3, 4, 1, 2]
    assert propose_ngram(np.array([7]), 3, 1, 2) == []


def test_num_emitted_is_the_accepted_prefix_plus_one():
    rows = [  # (sampled, drafts): the last position of each row is the bonus one
        ([5, 6, 7], [5, 6]),  # all accepted: 2 drafts + bonus
        ([9], []),  # no drafts: the plain sample
        ([1, 2, 3, 4], [8, 2, 3]),  # first rejected
        ([1, 2, 3, 4], [1, 9, 3]),  # middle rejected (a later match does not count)
        ([1, 2, 3, 4], [1, 2, 9]),  # last rejected
    ]
    sampled = torch.tensor([t for s, _ in rows for t in s])
    drafts = torch.tensor([t for _, d in rows for t in (*d, NO_DRAFT)])
    counts = torch.tensor([len(s) for s, _ in rows])
    assert num_emitted(sampled == drafts, counts).tolist() == [3, 1, 1, 2, 3]


def oracle(max_model_len=64):
    """A proposer that knows the model: every draft is accepted."""
    return lambda req, k: chain(req.prompt_token_ids + req.output_token_ids, k)


def noisy(seed: int):
    """Drafts from the model, each replaced by a random token with probability 1/3."""
    rng = random.Random(seed)
    return lambda req, k: [
        t if rng.random() < 2 / 3 else rng.randrange(97) for t in chain(req.prompt_token_ids + req.output_token_ids, k)
    ]


@pytest.mark.parametrize("proposer", [oracle(), noisy(1), lambda req, k: [3] * k], ids=["oracle", "noisy", "wrong"])
@pytest.mark.parametrize("one_ahead", [False, True])
def test_speculative_outputs_equal_plain_decoding(proposer, one_ahead):
    h = Harness(one_ahead=one_ahead, num_blocks=40, max_num_seqs=4, budget=24, proposer=proposer)
    cases = {}
    for i, prompt in enumerate(prompts(8, seed=3)):
        p = SamplingParams(max_tokens=5 + 7 * i, stop_token_ids=[11] if i % 3 == 0 else [], min_tokens=i % 4)
        h.add(f"r{i}", prompt, **{f: getattr(p, f) for f in ("max_tokens", "stop_token_ids", "min_tokens")})
        cases[f"r{i}"] = expected(prompt, p, 64)
    h.run()
    for rid, (tokens, finish) in cases.items():
        assert (h.tokens[rid], h.finish[rid]) == (tokens, finish), rid
    if not one_ahead:
        assert any(len(r.draft_token_ids) > 1 for b in h.batches for r in b.rows)


def test_a_run_is_cut_at_its_end_and_the_rest_discarded():
    prompt = [5, 6, 7]
    tokens = chain(prompt, 12)
    h = Harness(proposer=oracle())
    h.add("eos", prompt, max_tokens=12, stop_token_ids=[tokens[2]])
    h.add("len", prompt, max_tokens=2)
    h.run()
    assert h.tokens["eos"] == tokens[:3] and h.finish["eos"] == ("stop", tokens[2])
    assert h.tokens["len"] == tokens[:2] and h.finish["len"] == ("length", None)
    assert h.sched.num_discarded_samples >= 1  # tokens of the accepted run after the stop token


def test_rejected_drafts_roll_back_and_lookahead_blocks_are_freed():
    h = Harness(num_blocks=16, block_size=4, proposer=lambda req, k: [EOS - 1] * k)  # always rejected
    h.add("a", [1, 2, 3], max_tokens=20, ignore_eos=True)
    h.step()  # prefill
    h.step()  # decode with up to 19 drafts... all rejected
    req = h.sched.requests["a"]
    assert req.num_computed_tokens == 4 and len(req.block_table) == 1  # prompt + 1 token: one block kept
    assert h.sched.spec.num_drafts == 1 and h.sched.spec.num_accepted_tokens == 0
    h.run()


def test_an_abort_during_a_speculative_step_frees_everything():
    h = Harness(proposer=oracle())
    h.add("a", [1, 2, 3], max_tokens=30, ignore_eos=True)
    h.step()  # prefill
    batch = h.sched.schedule(h.drafts())
    assert batch.rows[0].draft_token_ids  # a speculative step, in flight from here ...
    result = h.model.execute(batch)
    assert h.sched.abort("a")  # ... when the abort comes: nothing is freed yet (I5)
    assert h.drained() == [] and h.sched.requests["a"].block_table
    h._update(batch, result)
    assert h.acks == ["a"] and len(h.tokens["a"]) == 1  # the prefill's token; the step's are discarded
    h.run()


def test_spec_stats_count_acceptance_per_position():
    s = SpecStats()
    s.observe(3, 2)
    s.observe(4, 0)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.accepted_per_pos) == (2, 7, 2, [1, 1, 0, 0])
    assert s.since(SpecStats()) == "2 drafts, acceptance rate 28.6%, mean accepted length 2.00"


def _one_hot(token: int, v: int = 8) -> torch.Tensor:
    return torch.zeros(v, dtype=torch.float64).index_fill_(0, torch.tensor([token]), 1.0)


def test_verify_draft_probs_edge_cases():
    """vLLM's cases for the rejection sampler with draft distributions, one position each (then the bonus)."""
    v, u = 8, torch.tensor([0.5, 0.0], dtype=torch.float64)
    p_uniform = torch.full((v,), 1.0 / v, dtype=torch.float64)

    def run(p0, q0, draft, sampled_bonus=7, u_accept=u, u_residual=u):
        p = torch.stack([p0, p_uniform])
        q = torch.stack([q0, torch.zeros(v, dtype=torch.float64)])
        tokens, accepted = verify_draft_probs(
            p, q, torch.tensor([draft, NO_DRAFT]), torch.tensor([0, sampled_bonus]), u_accept, u_residual
        )
        return tokens.tolist(), accepted.tolist(), num_emitted(accepted, torch.tensor([2])).item()

    assert run(p_uniform, p_uniform, 3) == ([3, 7], [True, False], 2)  # p == q: always accepted, then the bonus
    assert run(_one_hot(3), _one_hot(3), 3) == ([3, 7], [True, False], 2)  # greedy, the draft is the argmax
    assert run(_one_hot(5), _one_hot(3), 3) == ([5, 7], [False, False], 1)  # greedy: rejected, the argmax emitted
    zero_p = p_uniform.clone().index_fill_(0, torch.tensor([3]), 0.0) * v / (v - 1)
    for ua in (0.0, 0.5, 0.999):  # zero target probability: always rejected, never re-drawn
        tokens, accepted, n = run(zero_p, p_uniform, 3, u_accept=torch.tensor([ua, 0.0], dtype=torch.float64))
        assert not accepted[0] and tokens[0] != 3 and n == 1
    half = torch.tensor([0.5, 0.5] + [0.0] * (v - 2), dtype=torch.float64)
    assert run(half, _one_hot(0), 0, u_accept=torch.tensor([0.49, 0], dtype=torch.float64))[1][0]  # 0.49 < 0.5
    assert not run(half, _one_hot(0), 0, u_accept=torch.tensor([0.51, 0], dtype=torch.float64))[1][0]
    assert run(half, _one_hot(0), 0, u_accept=torch.tensor([0.51, 0], dtype=torch.float64))[0][0] == 1  # residual


def test_seeded_uniforms_are_keyed_by_seed_position_and_stream():
    rows = [SamplingRow(SamplingParams(seed=3), [], [], position) for position in (0, 1, 0)]
    a, b = row_uniforms(rows, 2, "cpu"), row_uniforms(rows, 2, "cpu")
    assert torch.equal(a, b) and a[0] == a[2] and a[0] != a[1]
    assert not torch.equal(row_uniforms(rows, 3, "cpu"), a)


def _run_preempting(proposer, seed: int, one_ahead: bool = False) -> int:
    h = Harness(one_ahead=one_ahead, num_blocks=20, block_size=4, budget=24, max_num_seqs=6, proposer=proposer)
    cases = {}
    for i, prompt in enumerate(prompts(6, seed=seed)):
        h.add(f"r{i}", prompt, max_tokens=30, ignore_eos=True)
        cases[f"r{i}"] = expected(prompt, SamplingParams(max_tokens=30, ignore_eos=True), 64)
    h.run()
    for rid, (tokens, finish) in cases.items():
        assert (h.tokens[rid], h.finish[rid]) == (tokens, finish), rid
    return h.sched.num_preemptions


def test_drafts_never_preempt_another_request():
    """Lookahead blocks are optional: a request whose drafts do not fit runs without them. (Rejected drafts used
    to evict others for their lookahead: 254 preemptions against 143 without drafts over 10 such runs.)"""
    seeds = range(6)
    with_drafts = sum(_run_preempting(lambda req, k: [3] * k, seed) for seed in seeds)
    assert with_drafts <= sum(_run_preempting(None, seed) for seed in seeds)


def test_a_speculative_row_preempted_in_flight_recomputes():
    """One step ahead, a request may be preempted while its speculative row is in flight: no rollback then."""
    for seed in (16, 17, 18):
        _run_preempting(lambda req, k: [3] * k, seed, one_ahead=True)


def test_processed_probs_are_a_point_mass_for_greedy_and_non_finite_rows():
    x = torch.randn(3, 70, generator=torch.Generator().manual_seed(0))
    x[2, 5] = float("inf")
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=4), SamplingParams(top_p=0.9)]
    p = Sampler().probs(x, SamplingMetadata.build([SamplingRow(q, [], []) for q in params], 70, "cpu"))
    assert p.sum(-1).tolist() == pytest.approx([1.0] * 3)
    assert p[0, x[0].argmax()] == 1.0 and p[2, 5] == 1.0  # greedy; +inf wins, as in the sampler
    assert (p[1] > 0).sum() == 4 and set((p[1] > 0).nonzero().flatten().tolist()) == set(x[1].topk(4).indices.tolist())


@pytest.mark.parametrize("one_ahead", [False, True])
def test_guided_pairs_speculate_only_in_lockstep(one_ahead):
    """A CFG pair verifies drafts only when both sequences feed just their last token: a companion still
    prefilling (its parent's prompt chunked ahead of it) once got the parent's pending token and the drafts
    after its own prompt, and the pair overran the step budget (CI: 67 tokens for 64, then a division by zero).
    Random traffic with chunked prefill, preemption and prefix caching; outputs equal plain decoding."""
    for seed in range(8):
        rng = random.Random(seed)
        h = Harness(one_ahead, num_blocks=40, budget=16, max_num_seqs=6, proposer=noisy(seed), long_prefill=4)
        h.sched.block_manager.enable_caching = seed % 2 == 0
        cases = {}
        for i, prompt in enumerate(prompts(10, seed=seed)):
            negative = [rng.randrange(96) for _ in range(rng.randint(1, 10))] if i % 2 else None
            p = SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True)
            h.add(f"r{i}", prompt, negative, max_tokens=p.max_tokens, ignore_eos=True)
            cases[f"r{i}"] = expected(prompt, p, 64)
            h.step()
        h.run()
        assert {rid: (h.tokens[rid], h.finish[rid]) for rid in cases} == cases
        assert any(r.draft_token_ids and r.guidance_scale for b in h.batches for r in b.rows)

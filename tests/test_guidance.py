"""Classifier-free guidance through the real engine (tiny model, fp32) against HF transformers: each guided token
is drawn from l_u + s * (l_c - l_u), l_c the logits of prompt + output so far and l_u those of the negative prompt
(or BOS alone) + the same output; pairs stay together through chunked prefill, async scheduling and preemption."""

from __future__ import annotations

import asyncio

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from actors.engine.config import SpeculativeConfig
from frontend.offline import AsyncLLM
from messages.sampling_params import SamplingParams
from tests.cancel_harness import assert_idle, engine_config, model_dir, start  # noqa: F401 (fixtures)

BOS = 1  # the tiny model's
ALPHA = 0.001  # significance level of the chi-square test


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(100, 5000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def hf(model_dir):  # noqa: F811
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def guided_reference(hf, prompt: list[int], negative: list[int], scale: float, steps: int) -> tuple[list, list]:
    """Greedy guided tokens and each step's guided log-distribution, computed plainly with HF."""
    out, dists = [], []
    with torch.inference_mode():
        for _ in range(steps):
            cond = hf(torch.tensor([prompt + out])).logits[0, -1]
            uncond = hf(torch.tensor([negative + out])).logits[0, -1]
            guided = (uncond + scale * (cond - uncond)).log_softmax(-1)
            dists.append(guided)
            out.append(int(guided.argmax()))
    return out, dists


@pytest.mark.parametrize("scale", [1.5, 3.0])
async def test_processed_logprobs_are_the_guided_distribution(model_dir, hf, scale):  # noqa: F811
    """--logprobs-mode processed_logprobs, temperature 1: the first token's top-5 logprobs equal HF's guided
    log_softmax within 1e-3, with a negative prompt and with the BOS default."""
    prompt, negative = list(range(300, 340)), [BOS, 7, 8, 9]
    config = engine_config(model_dir, logprobs_mode="processed_logprobs")
    async with AsyncLLM(config) as llm:
        for neg in (negative, None):
            params = SamplingParams(temperature=1.0, seed=3, max_tokens=1, logprobs=5, guidance_scale=scale)
            params.negative_prompt_token_ids = neg
            out = await llm.generate_one(prompt, params)
            _, (dist,) = guided_reference(hf, prompt, neg or [BOS], scale, 1)
            top = dist.topk(5)
            assert out.logprobs.top_ids[0] == top.indices.tolist(), (neg, out)
            assert torch.allclose(torch.tensor(out.logprobs.top_logprobs[0]), top.values, atol=1e-3)
        await assert_idle(llm)  # (eventually: an async step in flight may hold a finished request)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
async def test_greedy_guided_matches_hf_through_chunked_prefill(model_dir, hf, async_scheduling):  # noqa: F811
    """A 50-token prompt and a 20-token negative prompt against a 32-token step budget: the pair is prefilled in
    chunks of different lengths; every greedy token is HF's guided argmax; an unguided request beside it is
    unchanged."""
    prompt, negative, scale = random_ids(50, 0), random_ids(20, 1), 5.0
    expected, _ = guided_reference(hf, prompt, negative, scale, 8)
    with torch.inference_mode():
        plain = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :].tolist()
    assert expected != plain  # guidance changes this output: the test can tell
    guided = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, guidance_scale=scale)
    guided.negative_prompt_token_ids = negative
    unguided = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    async with AsyncLLM(engine_config(model_dir, async_scheduling=async_scheduling)) as llm:
        a, b = await llm.generate([prompt, prompt], [guided, unguided])
        assert a.token_ids == expected and b.token_ids == plain
        await assert_idle(llm)  # (eventually: an async step in flight may hold a finished request)


async def test_pairs_survive_preemption_and_aborts(model_dir, hf):  # noqa: F811
    """Four guided requests in a 12-block cache (each pair needs ~6 blocks by its end): pairs are preempted and
    resumed together and every output is HF's guided greedy one; aborted guided requests free both halves."""
    prompts = [random_ids(30, 10 + i) for i in range(4)]
    negative, scale = [BOS, *random_ids(2, 9)], 5.0
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, guidance_scale=scale)
    params.negative_prompt_token_ids = negative
    async with AsyncLLM(engine_config(model_dir, num_kv_blocks=12, max_model_len=96)) as llm:
        outs = await llm.generate(prompts, params)
        stats, _ = await llm.fresh_stats()
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.token_ids == guided_reference(hf, prompt, negative, scale, 24)[0]
        assert stats.num_preemptions_total > 0
        ids = [llm.new_id() for _ in range(3)]
        runs = [llm.generate_one(p, params, rid) for p, rid in zip(prompts, ids, strict=False)]
        tasks = [asyncio.ensure_future(r) for r in runs]
        await asyncio.sleep(0)
        for rid in ids:
            llm.abort(rid)
        done = await asyncio.gather(*tasks)
        assert all(o.finish_reason in ("abort", "length") for o in done)
        await assert_idle(llm)  # (eventually: an async step in flight may hold a finished request)


async def test_guided_completion_over_http_with_n_2(server, hf_server):
    """guidance_scale and negative_prompt (token ids) through the OpenAI client: both choices of n = 2 (each with
    its own companion) are HF's guided greedy output."""
    prompt, negative, scale = random_ids(30, 0), random_ids(5, 1), 5.0
    expected, _ = guided_reference(hf_server, prompt, negative, scale, 6)
    response = await server.client().completions.create(
        model=None,
        prompt=prompt,
        max_tokens=6,
        temperature=0.0,
        n=2,
        extra_body={"ignore_eos": True, "guidance_scale": scale, "negative_prompt": negative},
    )
    texts = [c.text for c in response.choices]
    assert texts == [server.tokenizer.decode(expected)] * 2
    assert response.usage.prompt_tokens == 30 and response.usage.completion_tokens == 12


@pytest.fixture(scope="module")
def hf_server(server):
    return AutoModelForCausalLM.from_pretrained(server.model_dir, dtype=torch.float32).eval()


async def test_seeded_guided_draws_follow_the_guided_distribution(model_dir, hf):  # noqa: F811
    """Chi-square at significance level 0.001 over 1,200 seeded first tokens (temperature 1, top-k 6): they follow
    HF's guided distribution renormalised over its top 6, and the same counts reject the unguided one."""
    prompt, negative, scale, n = random_ids(12, 5), random_ids(3, 6), 3.0, 1200
    config = engine_config(model_dir, max_num_seqs=64, num_kv_blocks=256, max_num_batched_tokens=512)
    params = [SamplingParams(temperature=1.0, top_k=6, seed=i, max_tokens=1, guidance_scale=scale) for i in range(n)]
    for p in params:
        p.negative_prompt_token_ids = negative
    async with AsyncLLM(config) as llm:
        outs = await llm.generate([prompt] * n, params)
    _, (guided,) = guided_reference(hf, prompt, negative, scale, 1)
    with torch.inference_mode():
        unguided = hf(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    drawn = [o.token_ids[0] for o in outs]

    def p_value(logprobs: torch.Tensor) -> float:
        top = logprobs.topk(6)
        expected = top.values.double().softmax(-1).numpy() * n
        observed = [sum(t == token for t in drawn) for token in top.indices.tolist()]
        if sum(observed) < n:  # a draw outside this distribution's support
            return 0.0
        return chisquare(observed, expected).pvalue

    assert p_value(guided) > ALPHA
    assert p_value(unguided) < ALPHA


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
async def test_guided_speculative_decoding_is_guided_decoding(model_dir, hf, method):  # noqa: F811
    """Both halves are fed the drafts and verified over the K + 1 positions against the guided target (the draft
    itself unguided): greedy guided output is HF's guided argmax, with drafts accepted; aborts leave nothing."""
    spec = SpeculativeConfig(method=method, num_speculative_tokens=3, prompt_lookup_min=1)
    if method == "draft_model":
        spec.model = str(model_dir)
    prompts = [random_ids(8, 20) * 4, random_ids(30, 21)]
    negative, scale = [BOS, *random_ids(4, 22)], 1.5
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, guidance_scale=scale)
    params.negative_prompt_token_ids = negative
    async with AsyncLLM(engine_config(model_dir, speculative=spec, max_num_batched_tokens=64)) as llm:
        outs = await llm.generate(prompts, params)
        stats, _ = await llm.fresh_stats()
        await assert_idle(llm)  # (eventually: an async step in flight may hold a finished request)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == guided_reference(hf, prompt, negative, scale, 16)[0]
    assert stats.spec_num_accepted_tokens > 0


async def test_a_longer_negative_prompt_ends_the_request_at_the_context_end(model_dir):  # noqa: F811
    """max_model_len bounds both halves: with a 40-token negative prompt and a 10-token prompt in a 64-token
    context, the companion reaches the end after 24 output tokens, and so does the request ("length")."""
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, guidance_scale=2.0)
    params.negative_prompt_token_ids = random_ids(40, 30)
    async with AsyncLLM(engine_config(model_dir, max_model_len=64)) as llm:
        out = await llm.generate_one(random_ids(10, 31), params)
        assert (out.finish_reason, len(out.token_ids)) == ("length", 24)
        await assert_idle(llm)  # (eventually: an async step in flight may hold a finished request)


async def test_a_pair_that_may_outgrow_the_kv_cache_is_refused_naming_guidance_scale(model_dir):  # noqa: F811
    """16 KV blocks of 16 tokens: a 100-token prompt and a 100-token negative prompt with max_tokens 100 need
    2 x 13 blocks at their longest (199 tokens each): refused before they run, naming guidance_scale (the client's
    400; the pair used to be admitted, then preempt itself and re-prefill forever). With max_tokens 8 (107 and 107
    tokens: 7 + 7 blocks) the same pair runs."""
    prompt, negative = random_ids(100, 40), random_ids(100, 41)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, guidance_scale=2.0)
    params.negative_prompt_token_ids = negative
    async with AsyncLLM(engine_config(model_dir, num_kv_blocks=16)) as llm:
        fin = await start(llm, prompt, params).done()
        assert (fin.finish_reason, fin.error_kind, fin.error_param) == ("error", "invalid", "guidance_scale")
        assert "needs 26 KV blocks of 16 tokens" in fin.error and "the KV cache has 16" in fin.error
        params.max_tokens = 8
        out = await llm.generate_one(prompt, params)
        assert (out.finish_reason, len(out.token_ids)) == ("length", 8)
        await assert_idle(llm)  # (eventually: an async step in flight may hold a finished request)

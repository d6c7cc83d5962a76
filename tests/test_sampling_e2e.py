"""Sampling parameters that read the output so far, through the real engine (async scheduling: the host's output
list lags the device by a step there)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from frontend.offline import AsyncLLM
from messages.sampling_params import SamplingParams
from tests.cancel_harness import clean_llm, engine_config, model_dir  # noqa: F401 (fixtures)

EOS = 2  # the tiny model's


async def test_min_tokens_holds_eos_then_releases_it(clean_llm):  # noqa: F811
    """EOS biased to win every step: masked for the first min_tokens tokens, then it ends the request."""
    prompt = clean_llm.tokenizer.encode("The meaning of life is")
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=3, logit_bias={EOS: 100.0})
    out = await clean_llm.generate_one(prompt, params)
    assert (out.finish_reason, len(out.token_ids), out.token_ids[-1]) == ("stop", 4, EOS), out
    assert EOS not in out.token_ids[:3]


async def test_min_tokens_holds_stop_token_ids_then_releases_them(clean_llm):  # noqa: F811
    prompt = clean_llm.tokenizer.encode("Once upon a time")
    params = SamplingParams(
        temperature=0.8, seed=5, max_tokens=12, min_tokens=5, stop_token_ids=[700], logit_bias={700: 100.0}
    )
    out = await clean_llm.generate_one(prompt, params)
    assert (out.finish_reason, out.stop_reason, len(out.token_ids)) == ("stop", 700, 6), out


async def test_logprobs_and_prompt_logprobs_match_hf_across_prefill_chunks(clean_llm, model_dir):  # noqa: F811
    """Raw logprobs of every prompt token after the first (its logit at the position before), their ranks and the
    top-3, through a prompt prefilled in three chunks (32-token budget); and the sampled tokens' logprobs."""
    prompt = list(range(300, 380))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=3)
    out = await clean_llm.generate_one(prompt, params)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        ref = model(torch.tensor([prompt + out.token_ids])).logits[0].log_softmax(-1)
    plp = out.prompt_logprobs
    assert plp is not None and len(plp.sampled) == len(prompt) - 1
    expected = ref[torch.arange(len(prompt) - 1), prompt[1:]]
    assert torch.allclose(torch.tensor(plp.sampled), expected, atol=1e-4)
    rows = ref[: len(prompt) - 1]
    ranks = torch.tensor(plp.ranks)  # within what HF's own rounding allows
    assert ((rows > expected[:, None] + 1e-4).sum(-1) <= ranks).all()
    assert (ranks <= (rows >= expected[:, None] - 1e-4).sum(-1)).all()
    top = torch.tensor(plp.top_logprobs)
    assert torch.allclose(top, rows.topk(3).values, atol=1e-4)
    assert torch.allclose(rows.gather(1, torch.tensor(plp.top_ids)), top, atol=1e-4)
    lp = out.logprobs
    decode = ref[len(prompt) - 1 : -1]
    assert lp.top_ids == decode.topk(2).indices.tolist() and [ids[0] for ids in lp.top_ids] == out.token_ids
    assert torch.allclose(torch.tensor(lp.sampled), decode.max(-1).values, atol=1e-4) and lp.ranks == [1] * 4


async def test_no_prompt_logprobs_unless_asked(clean_llm):  # noqa: F811
    out = await clean_llm.generate_one([5, 6, 7], SamplingParams(temperature=0, max_tokens=2))
    assert out.prompt_logprobs is None and out.logprobs is None
    out = await clean_llm.generate_one([5, 6, 7], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))
    assert len(out.prompt_logprobs.sampled) == 2 and out.prompt_logprobs.top_ids == [[], []]


async def test_prompt_logprobs_survive_preemption(clean_llm, model_dir):  # noqa: F811
    """A KV cache too small for three 70-token prompts: requests are preempted (recompute), some mid-prefill, and
    prompt logprobs computed again from position 0 must replace, not extend, the partial ones."""
    prompts = [list(range(1000 + 100 * i, 1070 + 100 * i)) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    solo = [await clean_llm.generate_one(p, params) for p in prompts]
    async with AsyncLLM(
        engine_config(model_dir, num_kv_blocks=9, max_model_len=128, max_num_batched_tokens=16, step_gate=False)
    ) as llm:
        together = await llm.generate(prompts, params)
        engine, _ = await llm.fresh_stats()
    assert engine.num_preemptions_total > 0
    for a, b in zip(solo, together, strict=True):
        assert len(b.prompt_logprobs.sampled) == 69 and a.token_ids == b.token_ids
        assert torch.allclose(
            torch.tensor(a.prompt_logprobs.sampled), torch.tensor(b.prompt_logprobs.sampled), atol=1e-4
        )


async def test_processed_logprobs_mode_reports_the_distribution_sampled_from(model_dir):  # noqa: F811
    """logprobs_mode "processed_logprobs" through the engine: with top_k=3 at temperature 0.8 each step's top-5
    logprobs are the model's logits / 0.8 renormalised over their top 3 (HF's, fp32), the other two -inf, and the
    sampled token among the three; prompt logprobs stay raw."""
    prompt = list(range(300, 340))
    params = SamplingParams(temperature=0.8, top_k=3, seed=7, max_tokens=4, logprobs=5, prompt_logprobs=1)
    async with AsyncLLM(engine_config(model_dir, logprobs_mode="processed_logprobs")) as llm:
        out = await llm.generate_one(prompt, params)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0]
    top3 = (logits[len(prompt) - 1 : -1] / 0.8).topk(3)
    expected = torch.cat([top3.values.log_softmax(-1), torch.full((4, 2), float("-inf"))], 1)
    lp = out.logprobs
    assert torch.allclose(torch.tensor(lp.top_logprobs), expected, atol=1e-4)
    assert [ids[:3] for ids in lp.top_ids] == top3.indices.tolist()
    assert all(token in ids[:3] for token, ids in zip(out.token_ids, lp.top_ids, strict=True))
    raw = logits[: len(prompt) - 1].log_softmax(-1)[torch.arange(len(prompt) - 1), prompt[1:]]
    assert torch.allclose(torch.tensor(out.prompt_logprobs.sampled), raw, atol=1e-4)

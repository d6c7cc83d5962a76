"""Prefix caching through the real engine (tiny model, fp32) and over HTTP: outputs are identical with caching on
and off for a workload that shares prefixes (multi-turn chats on a common system prompt, CFG and grammar-
constrained requests among them) under chunked prefill, preemption and aborts; usage reports cached_tokens and
/metrics the hits; prompt_logprobs requests compute every position."""

from __future__ import annotations

import asyncio

import openai
import pytest

from frontend.offline import AsyncLLM
from messages.sampling_params import SamplingParams, StructuredOutput
from tests.cancel_harness import abort_once_decoding, assert_idle, engine_config, model_dir  # noqa: F401 (fixtures)
from tests.test_guidance import random_ids
from tests.waits import eventually


def conversations() -> list[list[int]]:
    """Three chats of four turns on one 40-token system prompt: each turn's prompt extends the one before."""
    system, prompts = random_ids(40, 0), []
    for chat in range(3):
        history = list(system)
        for turn in range(4):
            history += random_ids(5 + turn, 10 * chat + turn)
            prompts.append(list(history))
    return prompts


def params(i: int) -> SamplingParams:
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    if i % 5 == 1:  # guided against the system prompt: the companion hits the conversations' cached blocks
        p.guidance_scale, p.negative_prompt_token_ids = 2.0, random_ids(40, 0)
    if i % 5 == 3:
        p.structured, p.ignore_eos = StructuredOutput(kind="regex", spec=r"[a-z]{3,6}"), False
    return p


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
async def test_outputs_identical_with_and_without_caching(model_dir, async_scheduling):  # noqa: F811
    """12 prompts with shared prefixes, a 32-token budget and an 8-block cache (preemption), run twice with caching
    on (the second pass hits what the first left) and off, then once more after aborts mid-decode: the same tokens
    every time (what an aborted request cached stays valid), hits counted; aborted requests leave the engine idle
    (no block referenced)."""
    prompts = conversations()
    runs = {}
    for caching in (False, True):
        config = engine_config(
            model_dir,
            enable_prefix_caching=caching,
            num_kv_blocks=8,
            max_model_len=128,
            async_scheduling=async_scheduling,
        )
        async with AsyncLLM(config) as llm:
            outs = [await llm.generate(prompts, [params(i) for i in range(len(prompts))]) for _ in range(2)]
            stats, _ = await llm.fresh_stats()
            await asyncio.gather(*(abort_once_decoding(llm, p, params(0)) for p in prompts[:4]))
            await assert_idle(llm)  # (eventually: an async step in flight may hold a finished request)
            outs.append(await llm.generate(prompts, [params(i) for i in range(len(prompts))]))  # after the aborts
        runs[caching] = [[o.token_ids for o in run] for run in outs]
        assert (stats.prefix_cache_hits_total > 0) == caching and stats.num_preemptions_total > 0
        cached = [o.num_cached_tokens for o in outs[1]]
        assert (max(cached) >= 48) == caching, cached  # the second pass finds whole conversations
    assert all(run == runs[False][0] for run in (*runs[False], *runs[True]))


async def test_usage_metrics_and_prompt_logprobs_over_http(server):
    """A repeated 300-token prompt reports prompt_tokens_details.cached_tokens (whole blocks, its last token
    computed); /metrics counts queries and hits; a prompt_logprobs request gets every prompt position, cached or
    not."""
    client, prompt = server.client(), random_ids(300, 42)
    before = await server.metric("sluice:prefix_cache_hits_total")
    first = await client.completions.create(model=None, prompt=prompt, max_tokens=2, temperature=0)
    second = await client.completions.create(model=None, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens < 288 <= second.usage.prompt_tokens_details.cached_tokens
    assert second.choices[0].text == first.choices[0].text

    async def hits() -> bool:  # (EngineStats every 0.5 s)
        return await server.metric("sluice:prefix_cache_hits_total") >= before + 288

    await eventually(hits, "the hits on /metrics", every=0.1)
    assert await server.metric("sluice:prefix_cache_queries_total") >= 600
    third = await client.completions.create(
        model=None, prompt=prompt, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    assert third.usage.prompt_tokens_details.cached_tokens == 0
    assert len(third.choices[0].prompt_logprobs) == 300


async def test_cache_salt_over_http(server):
    """A repeated prompt under another cache_salt finds nothing cached; under the same salt it does; a bad salt is
    a 400 naming it."""
    client, prompt = server.client(), random_ids(100, 43)

    async def cached(salt: str | None) -> int:
        out = await client.completions.create(
            model=None, prompt=prompt, max_tokens=1, temperature=0, extra_body={"cache_salt": salt}
        )
        return out.usage.prompt_tokens_details.cached_tokens

    assert await cached("tenant-1") == 0
    assert await cached("tenant-2") == 0 and await cached(None) == 0
    assert await cached("tenant-1") >= 96 and await cached(None) >= 96
    with pytest.raises(openai.BadRequestError) as e:
        await cached("")
    assert e.value.body["param"] == "cache_salt"


async def test_chat_usage_reports_cached_tokens_whole_and_streamed(server):
    """A chat re-sending its 300-token system message: the second call's usage (and a streamed call's final usage
    chunk) counts the cached prompt tokens, as OpenAI's prompt_tokens_details.cached_tokens."""
    client = server.client()
    system = {"role": "system", "content": " ".join(f"w{i}" for i in range(150))}
    messages = [system, {"role": "user", "content": "one"}]
    first = await client.chat.completions.create(model=None, messages=messages, max_tokens=2, temperature=0)
    messages[1]["content"] = "two"
    second = await client.chat.completions.create(model=None, messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens < 64 <= second.usage.prompt_tokens_details.cached_tokens
    messages[1]["content"] = "three"
    chunks = await client.chat.completions.create(
        model=None, messages=messages, max_tokens=2, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    usage = [chunk.usage async for chunk in chunks if chunk.usage][-1]
    assert usage.prompt_tokens_details.cached_tokens >= 64

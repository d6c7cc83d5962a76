"""prompt_logprobs over HTTP (vLLM's extension), through the official `openai` client on the tiny model."""

from __future__ import annotations

import openai
import pytest

GREEDY = {"temperature": 0.0, "max_tokens": 2}


async def test_completion_prompt_logprobs_per_choice(server):
    prompt = server.tokenizer.encode("The quick brown fox jumps")
    out = await server.client().completions.create(
        model=None, prompt=prompt, n=2, extra_body={"prompt_logprobs": 2}, **GREEDY
    )
    for choice in out.choices:
        plp = choice.model_extra["prompt_logprobs"]
        assert len(plp) == len(prompt) and plp[0] is None
        for token, entry in zip(prompt[1:], plp[1:], strict=True):
            assert str(token) in entry and 2 <= len(entry) <= 3  # the prompt token and the top-2
            mine = entry[str(token)]
            assert (
                mine["logprob"] <= 0 and mine["rank"] >= 1 and mine["decoded_token"] == server.tokenizer.decode([token])
            )
            by_rank = {e["rank"]: e["logprob"] for e in entry.values()}
            assert by_rank[1] >= by_rank[2] >= mine["logprob"] or mine["rank"] <= 2
    plain = await server.client().completions.create(model=None, prompt=prompt, **GREEDY)
    assert plain.choices[0].model_extra["prompt_logprobs"] is None  # present and null when not asked for (vLLM)


async def test_chat_prompt_logprobs_once_per_response(server):
    messages = [{"role": "user", "content": "Hi"}]
    out = await server.client().chat.completions.create(
        model=None, messages=messages, extra_body={"prompt_logprobs": 0}, **GREEDY
    )
    plp = out.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == out.usage.prompt_tokens and all(len(e) == 1 for e in plp[1:])


async def test_prompt_logprobs_with_stream_is_a_400(server):
    with pytest.raises(openai.BadRequestError) as e:
        await server.client().completions.create(
            model=None, prompt="Hi", stream=True, extra_body={"prompt_logprobs": 1}, **GREEDY
        )
    assert e.value.body["param"] == "prompt_logprobs"


async def test_echo_with_logprobs_covers_the_prompt_then_the_output(server):
    prompt = server.tokenizer.encode("Echo me back")
    out = await server.client().completions.create(model=None, prompt=prompt, echo=True, logprobs=1, **GREEDY)
    lp = out.choices[0].logprobs
    n = len(prompt) + 2
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
    assert "".join(lp.tokens) == out.choices[0].text  # the echoed prompt, then the completion
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    alone = await server.client().completions.create(model=None, prompt=prompt, logprobs=1, **GREEDY)
    # (equal up to float32 rounding: the echo's prefill computes logits at every prompt position, a batch of rows
    # whose normalizer torch sums otherwise than one row's, split over the threads; exact in batch-invariant mode)
    assert lp.token_logprobs[-2:] == pytest.approx(alone.choices[0].logprobs.token_logprobs, rel=1e-5, abs=1e-5)


async def test_a_one_token_prompt_has_no_prompt_logprobs_but_the_first_null(server):
    one = {"model": None, "prompt": [5], **GREEDY}
    out = await server.client().completions.create(**one, extra_body={"prompt_logprobs": 1})
    assert out.choices[0].model_extra["prompt_logprobs"] == [None]
    echoed = await server.client().completions.create(**one, echo=True, logprobs=1)
    lp = echoed.choices[0].logprobs
    assert len(lp.tokens) == 3 and lp.token_logprobs[0] is None and lp.text_offset[0] == 0

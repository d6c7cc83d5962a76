"""vLLM/OpenAI conformance (issue 18, first part) with the official `openai` client and raw HTTP: a max_tokens
beyond the context is served up to its end; the model card by id (404 otherwise) and `model: ""`; vLLM's
/tokenize, /detokenize and /version."""

from __future__ import annotations

import json

import openai
import pytest

CHAT = [{"role": "user", "content": "Hi there"}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_max_tokens_beyond_the_context_ends_with_length(server, stream):
    """The shared server's context is 512 tokens: a 500-token prompt with max_tokens 10,000 gets 12 tokens."""
    client = server.client()
    kwargs = dict(model="", prompt=[5] * 500, max_tokens=10_000, temperature=0, extra_body={"ignore_eos": True})
    if stream:
        chunks = await client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
        reasons, usage = [], None
        async for chunk in chunks:
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
            usage = chunk.usage or usage
    else:
        response = await client.completions.create(**kwargs)
        reasons, usage = [response.choices[0].finish_reason], response.usage
    assert reasons == ["length"] and (usage.prompt_tokens, usage.completion_tokens) == (500, 12)


async def test_model_card_and_unknown_model(server):
    client = server.client()
    name = server.model_dir.name
    card = await client.models.retrieve(name)
    assert (card.id, card.object, card.owned_by) == (name, "model", "sluice")
    assert card.model_extra["max_model_len"] == 512 and card.model_extra["root"] == str(server.model_dir)
    assert [m.id for m in (await client.models.list()).data] == [name]
    with pytest.raises(openai.NotFoundError) as e:
        await client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found"


async def test_tokenize_detokenize_and_version(server):
    tok = server.tokenizer
    async with server.session() as s:
        async with s.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}) as resp:
            body = await resp.json()
        assert body["tokens"] == tok.encode("Hello world") and body["count"] == len(body["tokens"])
        assert body["max_model_len"] == 512 and "".join(body["token_strs"]).endswith("world")
        async with s.post("/tokenize", json={"messages": CHAT}) as resp:
            chat = await resp.json()
        assert chat["tokens"] == tok.encode(tok.render_chat(CHAT), add_special_tokens=False)
        async with s.post("/detokenize", json={"tokens": body["tokens"]}) as resp:
            assert (await resp.json())["prompt"] == tok.decode(body["tokens"])
        for path, payload, param in [
            ("/tokenize", {"prompt": "x", "messages": CHAT}, "prompt"),
            ("/tokenize", {"prompt": "x", "model": "gpt-4"}, "model"),
            ("/detokenize", {"tokens": [10**7]}, "tokens"),
            ("/detokenize", {"tokens": "abc"}, "tokens"),
        ]:
            async with s.post(path, json=payload) as resp:
                assert resp.status in (400, 404) and (await resp.json())["error"]["param"] == param, payload
        async with s.get("/version") as resp:
            assert (await resp.json())["version"] == "0.1.0"


async def test_continuous_usage_stats(server):
    """stream_options.continuous_usage_stats: every chunk carries the usage so far, growing to the final one."""
    chunks = await server.client().chat.completions.create(
        model=None, messages=CHAT, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    counts = [chunk.usage.completion_tokens async for chunk in chunks]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 6 and len(counts) >= 3


async def test_response_shape_fields(server):
    """system_fingerprint (null) on responses and chunks; prompt_logprobs present and null when not asked for (per
    choice on completions, once on chat), filled when asked for."""
    async with server.session() as s:
        async with s.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as resp:
            body = await resp.json()
        assert body["system_fingerprint"] is None and body["choices"][0]["prompt_logprobs"] is None
        async with s.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}) as resp:
            body = await resp.json()
        assert body["system_fingerprint"] is None and "prompt_logprobs" in body and body["prompt_logprobs"] is None
        async with s.post(
            "/v1/completions", json={"prompt": "hi there", "max_tokens": 1, "prompt_logprobs": 1}
        ) as resp:
            body = await resp.json()
        assert body["choices"][0]["prompt_logprobs"][0] is None and len(body["choices"][0]["prompt_logprobs"]) > 1
        payload = {"messages": CHAT, "max_tokens": 2, "stream": True}
        async with s.post("/v1/chat/completions", json=payload) as resp:
            text = await resp.text()
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert chunks and all("system_fingerprint" in c for c in chunks)

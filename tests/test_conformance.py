"""vLLM/OpenAI conformance (issue 18) with the official `openai` client and raw HTTP: a max_tokens beyond the
context is served up to its end; the model card by id (404 otherwise) and `model: ""`; vLLM's /tokenize,
/detokenize and /version; the response's shape; vLLM's request extras; /openapi.json (more in
tests/test_conformance_more.py, which shares the `api` fixture).

Against Sluice's shared test server by default. The same tests run against another server as a control, e.g.
vLLM's CPU build serving the converted SmolLM2 (../shared/notes/peers.md) with `--max-model-len 512
--served-model-name SmolLM2-135M-Instruct`:

    SLUICE_CONFORMANCE_URL=http://127.0.0.1:8100 pytest tests/test_conformance.py

(what only Sluice promises, its own names and the field its errors name, is checked on Sluice alone).
"""

from __future__ import annotations

import json
import os

import openai
import pytest

from tests.conftest import ServerHandle
from tests.test_tokenizer import SMOL_DIR

CHAT = [{"role": "user", "content": "Hi there"}]
CONTROL = os.environ.get("SLUICE_CONFORMANCE_URL")


@pytest.fixture(scope="module", name="api")
def api_fixture(request) -> ServerHandle:
    """Sluice's shared server, or the control server at SLUICE_CONFORMANCE_URL (serving the converted SmolLM2)."""
    return request.getfixturevalue("server") if CONTROL is None else ServerHandle(None, SMOL_DIR, remote=CONTROL)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_max_tokens_beyond_the_context_ends_with_length(api, stream):
    """The shared server's context is 512 tokens: a 500-token prompt with max_tokens 100 gets 12 tokens, and so does
    one with 10,000 on Sluice (vLLM 0.32 refuses a max_tokens above the context length with a 400; issue 18 asks
    for the request to be served)."""
    client = api.client()
    kwargs = dict(model="", prompt=[5] * 500, max_tokens=10_000 if api.local else 100, temperature=0)
    kwargs["extra_body"] = {"ignore_eos": True}
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


async def test_model_card_and_unknown_model(api):
    """The model list's card (vLLM's max_model_len and root); on Sluice also by id (OpenAI's models.retrieve, which
    vLLM 0.32 answers 404) and a 404 naming model_not_found for another id."""
    client = api.client()
    name = api.model_dir.name
    [card] = (await client.models.list()).data
    assert (card.id, card.object, card.owned_by) == (name, "model", "sluice" if api.local else card.owned_by)
    assert card.model_extra["max_model_len"] == 512 and card.model_extra["root"] == str(api.model_dir)
    assert card.model_extra["parent"] is None  # (vLLM: a LoRA adapter's base model; none here)
    if not api.local:
        return
    assert await client.models.retrieve(name) == card
    with pytest.raises(openai.NotFoundError) as e:
        await client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found"


async def test_tokenize_detokenize_and_version(api):
    tok = api.tokenizer
    async with api.session() as s:
        async with s.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}) as resp:
            body = await resp.json()
        assert body["tokens"] == tok.encode("Hello world") and body["count"] == len(body["tokens"])
        assert body["max_model_len"] == 512 and "".join(body["token_strs"]).endswith("world")
        async with s.post("/tokenize", json={"messages": CHAT}) as resp:
            chat = await resp.json()
        assert chat["tokens"] == tok.encode(tok.render_chat(CHAT), add_special_tokens=False)
        said = [*CHAT, {"role": "assistant", "content": "Once"}]
        payload = {"messages": said, "continue_final_message": True, "add_generation_prompt": False}
        async with s.post("/tokenize", json=payload) as resp:
            going_on = await resp.json()
        assert tok.decode(going_on["tokens"]).endswith("<|im_start|>assistant\nOnce")
        async with s.post("/detokenize", json={"tokens": body["tokens"]}) as resp:
            assert (await resp.json())["prompt"] == tok.decode(body["tokens"])
        for path, payload, param in [  # (vLLM 0.32 takes the messages of the first, and detokenizes the third to "")
            ("/tokenize", {"prompt": "x", "messages": CHAT}, "prompt"),
            ("/tokenize", {"prompt": "x", "model": "gpt-4"}, "model"),
            ("/detokenize", {"tokens": [10**7]}, "tokens"),
            ("/detokenize", {"tokens": "abc"}, "tokens"),
        ][: None if api.local else 0]:
            async with s.post(path, json=payload) as resp:
                assert resp.status in (400, 404) and (await resp.json())["error"]["param"] == param, payload
        async with s.get("/version") as resp:
            assert (await resp.json())["version"] == ("0.1.0" if api.local else "0.32.0")


async def test_response_shape_fields(api):
    """system_fingerprint (null) on responses and chunks; prompt_logprobs present and null when not asked for (per
    choice on completions, once on chat), filled when asked for."""
    async with api.session() as s:
        async with s.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as resp:
            body = await resp.json()
        assert fingerprint(api, body) is None and body["choices"][0]["prompt_logprobs"] is None
        async with s.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}) as resp:
            body = await resp.json()
        assert fingerprint(api, body) is None and "prompt_logprobs" in body and body["prompt_logprobs"] is None
        async with s.post(
            "/v1/completions", json={"prompt": "hi there", "max_tokens": 1, "prompt_logprobs": 1}
        ) as resp:
            body = await resp.json()
        assert body["choices"][0]["prompt_logprobs"][0] is None and len(body["choices"][0]["prompt_logprobs"]) > 1
        payload = {"messages": CHAT, "max_tokens": 2, "stream": True}
        async with s.post("/v1/chat/completions", json=payload) as resp:
            text = await resp.text()
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert chunks and all("system_fingerprint" in c for c in chunks if api.local)  # (vLLM 0.32: not in chunks)


def fingerprint(api, body: dict) -> str | None:
    """system_fingerprint: present; null on Sluice (vLLM 0.32 writes its version there)."""
    return body["system_fingerprint"] if api.local else None


def ids_of(tokens: list[str]) -> list[int]:
    """return_tokens_as_token_ids: logprob tokens read "token_id:N"."""
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


async def test_return_token_ids_and_tokens_as_token_ids_on_completions(api):
    """return_token_ids: each choice carries its prompt's ids and its output's (streamed: the prompt's on the
    choice's first chunk, each chunk's own ids after); return_tokens_as_token_ids writes logprob tokens as
    "token_id:N", which name exactly the output ids. Neither field is present unless asked for."""
    client, tok = api.client(), api.tokenizer
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True}
    kwargs = dict(model="", prompt="Hello world", max_tokens=8, temperature=0, logprobs=1, extra_body=extra)
    choice = (await client.completions.create(**kwargs)).choices[0]
    extra_fields = choice.model_extra
    assert extra_fields["prompt_token_ids"] == tok.encode("Hello world") and len(extra_fields["token_ids"]) == 8
    assert ids_of(choice.logprobs.tokens) == extra_fields["token_ids"]
    assert all(ids_of(list(top)) for top in choice.logprobs.top_logprobs)
    streamed, prompts = [], []
    async for chunk in await client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            prompts.append(c.model_extra.get("prompt_token_ids"))
            streamed += c.model_extra["token_ids"]
            assert ids_of(c.logprobs.tokens) == c.model_extra["token_ids"]
    assert prompts[0] == tok.encode("Hello world") and not any(prompts[1:])
    assert streamed == extra_fields["token_ids"]
    plain = (await client.completions.create(model="", prompt="Hello world", max_tokens=2, logprobs=0)).choices[0]
    assert plain.model_extra.get("token_ids") is None and plain.model_extra.get("prompt_token_ids") is None
    assert not any(t.startswith("token_id:") for t in plain.logprobs.tokens)


async def test_return_token_ids_on_chat(api):
    """Chat: prompt_token_ids once per response (the first chunk when streamed), token_ids per choice; with
    return_tokens_as_token_ids the logprobs' tokens and bytes are those of "token_id:N"."""
    client, tok = api.client(), api.tokenizer
    want_prompt = tok.encode(tok.render_chat(CHAT), add_special_tokens=False)
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True}
    kwargs = dict(model="", messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2, extra_body=extra)
    response = await client.chat.completions.create(**kwargs)
    ids = response.choices[0].model_extra["token_ids"]
    assert response.model_extra["prompt_token_ids"] == want_prompt and len(ids) == 6
    content = response.choices[0].logprobs.content
    assert ids_of([lp.token for lp in content]) == ids
    assert [lp.bytes for lp in content] == [list(tok.token_bytes(t)) for t in ids]  # the tokens' own bytes
    assert all(ids_of([t.token for t in lp.top_logprobs]) for lp in content)
    chunks = [chunk async for chunk in await client.chat.completions.create(**kwargs, stream=True)]
    assert chunks[0].model_extra["prompt_token_ids"] == want_prompt
    assert not any(c.model_extra.get("prompt_token_ids") for c in chunks[1:])
    assert [t for c in chunks for ch in c.choices for t in ch.model_extra.get("token_ids") or []] == ids


async def test_chat_echo_continue_final_message_and_truncation(api):
    """vLLM's extras end to end: continue_final_message continues the assistant's last message, and echo puts
    that message first in the reply (whole and streamed, usage unchanged); truncate_prompt_tokens serves a prompt
    longer than the context from its last tokens; both continue_final_message and add_generation_prompt true is
    a 400 naming the first."""
    client = api.client()
    said = [*CHAT, {"role": "assistant", "content": "Once upon"}]
    base = dict(model="", messages=said, max_tokens=5, temperature=0)
    going_on = {"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True}
    plain = await client.chat.completions.create(**base, extra_body=going_on)
    echoed = await client.chat.completions.create(**base, extra_body=going_on | {"echo": True})
    assert echoed.choices[0].message.content == "Once upon" + plain.choices[0].message.content
    assert echoed.usage == plain.usage
    chunks = [c async for c in await client.chat.completions.create(**base, extra_body=going_on | {"echo": True},
                                                                        stream=True)]  # fmt: skip
    assert "".join(ch.delta.content or "" for c in chunks for ch in c.choices) == echoed.choices[0].message.content
    long = list(range(5, 605))  # 600 tokens: more than the 512 of the context
    extra = {"truncate_prompt_tokens": 100, "return_token_ids": True}
    cut = await client.completions.create(model="", prompt=long, max_tokens=2, extra_body=extra)
    assert cut.usage.prompt_tokens == 100 and cut.choices[0].model_extra["prompt_token_ids"] == long[-100:]
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(
            **base, extra_body={"continue_final_message": True, "add_generation_prompt": True}
        )
    assert e.value.body["param"] == ("continue_final_message" if api.local else e.value.body["param"])


@pytest.mark.skipif(CONTROL is not None, reason="Sluice's own endpoints")
async def test_openapi_describes_every_endpoint_and_its_bodies(api):
    """GET /openapi.json: every endpoint, each body's schema generated from the Structs the server decodes (vLLM's
    extras in, refused fields out, nested types as components)."""
    async with api.session() as s, s.get("/openapi.json") as resp:
        doc = await resp.json()
    assert doc["openapi"].startswith("3.1") and set(doc["paths"]) == {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/models/{model}",
        "/tokenize",
        "/detokenize",
        "/version",
        "/health",
        "/metrics",
        "/openapi.json",
        "/v1/responses",
        "/v1/responses/{id}",
        "/v1/responses/{id}/cancel",
        "/v1/responses/{id}/input_items",
        "/v1/embeddings",
        "/score",
        "/rerank",
        "/classify",
    }  # fmt: skip  (every runner's: a model serves its own, frontend/routes.py)
    assert set(doc["paths"]["/v1/responses/{id}"]) == {"get", "delete"}
    schemas = doc["components"]["schemas"]
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    chat = schemas[body["$ref"].rsplit("/", 1)[1]]["properties"]
    assert {"messages", "return_token_ids", "continue_final_message", "truncate_prompt_tokens"} <= set(chat)
    assert {"use_beam_search", "length_penalty", "early_stopping"} <= set(chat) and "functions" not in chat
    body = doc["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    responses = schemas[body["$ref"].rsplit("/", 1)[1]]["properties"]
    assert {"input", "instructions", "max_output_tokens", "previous_response_id", "background", "top_k"} <= set(
        responses
    )
    assert not {"max_tokens", "n", "messages", "response_format", "prompt_logprobs"} & set(responses)

    assert {"enum": ["left", "right"]} in chat["truncation_side"]["anyOf"]
    assert chat["stream_options"]["anyOf"][0] == {"$ref": "#/components/schemas/StreamOptions"}
    assert set(schemas["StreamOptions"]["properties"]) == {"include_usage", "continuous_usage_stats"}

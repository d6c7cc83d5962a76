"""vLLM/OpenAI conformance, round 2 (issue 35), against Sluice's shared server or the control server
(SLUICE_CONFORMANCE_URL, tests/test_conformance.py's `api` fixture): non-JSON bodies are 415s; a logit_bias key that
is not a token id is named; the last streamed chat chunk's content is "" (vLLM's: a client may concatenate every
delta.content); a completion cut inside a multi-byte character ends at the last whole character, its token ids
still reporting every byte."""

from __future__ import annotations

import json

import pytest

from tests.test_conformance import CHAT, api_fixture  # noqa: F401  (the `api` fixture)

BODIES = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": CHAT, "max_tokens": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
    "/tokenize": {"prompt": "hi"},
}


@pytest.mark.parametrize("path", BODIES)
@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data"])
async def test_a_body_that_is_not_json_by_its_type_is_a_415(api, path, content_type):
    if path == "/v1/responses" and not api.local:
        pytest.skip("the control server has no Responses API")
    async with api.session() as s:
        data = json.dumps(BODIES[path])
        async with s.post(path, data=data, headers={"Content-Type": content_type}) as resp:
            assert resp.status == 415
            error = (await resp.json())["error"]
            assert content_type in error["message"] or not api.local
        for ok in ("application/json", "application/json; charset=utf-8"):
            async with s.post(path, data=data, headers={"Content-Type": ok}) as resp:
                assert resp.status == 200, await resp.text()


async def test_a_logit_bias_key_that_is_not_a_token_id_is_named(api):
    body = {"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": 1, "not_a_token_id": 2}}
    async with api.session() as s, s.post("/v1/completions", json=body) as resp:
        error = (await resp.json())["error"]
    assert resp.status == 400 and "not_a_token_id" in error["message"]
    if api.local:
        assert error["param"] == "logit_bias" and error["message"] == "logit_bias: 'not_a_token_id' is not a token id"


@pytest.mark.parametrize("max_tokens", [1, 3])
async def test_the_finish_chunk_of_a_chat_stream_has_content(api, max_tokens):
    """Every chunk after the role chunk carries a string content, the finish chunk included (possibly "")."""
    stream = await api.client().chat.completions.create(model="", messages=CHAT, max_tokens=max_tokens,
                                                        temperature=0, stream=True)  # fmt: skip
    chunks = [c async for c in stream]
    last = chunks[-1].choices[0]
    assert last.finish_reason == "length" and isinstance(last.delta.content, str)
    assert all(isinstance(c.choices[0].delta.content, str) for c in chunks)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_cut_inside_a_character_ends_at_the_last_whole_one(api, stream):
    """The only token allowed writes " " and the first two bytes of 🤗: the text is " " (no U+FFFD), the token id is
    reported all the same."""
    first = api.tokenizer.encode(" 🤗", add_special_tokens=False)[0]
    assert api.tokenizer.decode([first]) == " \ufffd"
    kwargs = dict(model="", prompt="Hug:", max_tokens=1, logprobs=0,
                  extra_body={"allowed_token_ids": [first], "return_token_ids": True})  # fmt: skip
    if stream:
        chunks = [c async for c in await api.client().completions.create(**kwargs, stream=True)]
        text = "".join(c.choices[0].text for c in chunks)
        ids = [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])]
    else:
        choice = (await api.client().completions.create(**kwargs)).choices[0]
        text, ids = choice.text, choice.model_extra["token_ids"]
    assert "\ufffd" not in text and ids == [first]
    if api.local:
        assert text == " "

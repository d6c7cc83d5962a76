"""Bad Responses API requests are 400s (404s for unknown ids) in OpenAI's error shape, naming the field as the
Responses API spells it (an input item, a flat tool's field, text.format, max_output_tokens), decided before the
engine sees anything (the fake engine receives no request)."""

from __future__ import annotations

import pytest

BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}}
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
CASES = {
    "no input": ({"input": None}, "input"),
    "empty input": ({"input": []}, "input"),
    "unknown item": ({"input": [{"type": "computer_call"}]}, "input[0].type"),
    "wrong role": ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    "role not a string": ({"input": [{"role": ["user"], "content": "x"}]}, "input[0].role"),
    "image part": ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                   "input[0].content[0]"),
    "output part from the user": ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
                                  "input[0].content[0]"),
    "call output without call_id": ({"input": [{"type": "function_call_output", "output": "x"}]},
                                    "input[0].call_id"),
    "not an item": ({"input": ["hi"]}, "input[0]"),
    "call arguments not JSON": ({"input": [{"type": "function_call", "call_id": "c", "name": "f",
                                 "arguments": "{"}]}, "input[0]"),
    "second item's call arguments": ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call",
                                      "call_id": "c", "name": "f", "arguments": "{"}]}, "input[1]"),
    "hosted tool": ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    "bad tool name": ({"tools": [{**TOOL, "name": "a b"}], "tool_choice": "required"}, "tools[0].name"),
    "unknown forced tool": ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    "hosted tool_choice": ({"tools": [TOOL], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    "uncompilable tool": ({"tools": [{**TOOL, "parameters": BAD_SCHEMA}], "tool_choice": "required"},
                          "tools[0].parameters"),
    "uncompilable schema": ({"text": {"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}}},
                            "text.format.schema"),
    "unknown format": ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    "verbosity": ({"text": {"verbosity": "low"}}, "text.verbosity"),
    "chat's max_tokens": ({"max_tokens": 5}, "max_tokens"),
    "chat's messages": ({"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    "chat's response_format": ({"response_format": {"type": "json_object"}}, "response_format"),
    "n": ({"n": 2}, "n"),
    "negative max_output_tokens": ({"max_output_tokens": -1}, "max_output_tokens"),
    "reasoning effort": ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    "include": ({"include": ["reasoning.encrypted_content"]}, "include[0]"),
    "background unstored": ({"background": True, "store": False}, "background"),
    "metadata": ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    "conversation": ({"conversation": "conv_1"}, "conversation"),
    "moderation": ({"moderation": {"mode": "block"}}, "moderation"),
    "truncation auto": ({"truncation": "auto"}, "truncation"),
    "service tier": ({"service_tier": "priority"}, "service_tier"),
    "temperature": ({"temperature": -1}, "temperature"),
    "too long for the context": ({"input": "x" * 3_000_000}, "input"),
    "instructions not a string": ({"instructions": ["x"]}, "instructions"),
}  # fmt: skip


@pytest.mark.parametrize(("fields", "param"), CASES.values(), ids=CASES.keys())
async def test_bad_requests_name_the_field(fake, fields, param):
    body = {"input": "hi", "max_output_tokens": 4, **fields}
    async with fake.session() as s, s.post("/v1/responses", json=body) as resp:
        error = (await resp.json())["error"]
    assert resp.status == 400, error
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert fake.engine.added == []


async def test_unknown_ids(fake):
    async with fake.session() as s:
        body = {"input": "hi", "previous_response_id": "resp_nope"}
        async with s.post("/v1/responses", json=body) as resp:
            assert resp.status == 404 and (await resp.json())["error"]["param"] == "previous_response_id"
        for method, path in [("GET", ""), ("DELETE", ""), ("POST", "/cancel"), ("GET", "/input_items")]:
            async with s.request(method, f"/v1/responses/resp_nope{path}") as resp:
                assert resp.status == 404, (method, path)
                assert set((await resp.json())["error"]) == {"message", "type", "param", "code"}
        async with s.get("/v1/responses/resp_nope?starting_after=x") as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "starting_after"


async def test_the_api_key_guards_the_endpoint(fake):
    import aiohttp

    async with aiohttp.ClientSession(fake.url) as s:
        for method, path in [("POST", ""), ("GET", "/resp_x"), ("POST", "/resp_x/cancel")]:
            async with s.request(method, f"/v1/responses{path}", json={"input": "hi"}) as resp:
                assert resp.status == 401

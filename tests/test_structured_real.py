"""Structured outputs on SmolLM2 (the shared real-model server): a JSON object and a named tool call that a real
model writes sensibly, each valid and ended by the grammar."""

from __future__ import annotations

import json

import pytest

from tests.test_tools_http import WEATHER, assert_valid

pytestmark = pytest.mark.real_model


async def test_json_object_and_schema(real_server):
    client = real_server.client()
    messages = [{"role": "user", "content": "Describe a cat in JSON with the keys name and color."}]
    response = await client.chat.completions.create(
        model=None, messages=messages, max_tokens=80, temperature=0, response_format={"type": "json_object"}
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict), choice
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "cat", "schema": schema}}
    response = await client.chat.completions.create(
        model=None, messages=messages, max_tokens=40, temperature=0, response_format=fmt
    )
    value = json.loads(response.choices[0].message.content)
    assert list(value) == ["name"] and 0 < len(value["name"]) <= 20


async def test_named_tool_call(real_server):
    response = await real_server.client().chat.completions.create(
        model=None,
        messages=[{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}],
        max_tokens=60,
        temperature=0,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_weather"
    assert_valid(choice.message.tool_calls, [WEATHER])

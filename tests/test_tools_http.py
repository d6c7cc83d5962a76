"""Chat tools over HTTP with the official `openai` client (tiny model): every tool_choice writes calls that parse
into message.tool_calls whose arguments validate against their tool's schema (jsonschema), streamed as OpenAI
streams them and whole; invalid tools are 400s naming the field, the tool's own where one is at fault."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
NOOP = {"type": "function", "function": {"name": "noop"}}
CHAT = [{"role": "user", "content": "What is the weather in Rome?"}]


def assert_valid(calls, tools: list[dict]) -> None:
    """Each call names one of `tools` and its arguments validate against that tool's parameters."""
    schemas = {t["function"]["name"]: t["function"].get("parameters", {}) for t in tools}
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-"), call
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


async def streamed(client: openai.AsyncOpenAI, **kwargs) -> tuple[str, list[dict], list[str]]:
    """(content, the calls as their deltas add up, finish reasons) of a streamed chat; each call's deltas are
    asserted to be OpenAI's: the first carries its index, id, type, name and arguments "", the rest only
    fragments of its arguments."""
    content, calls, reasons = "", [], []
    async for chunk in await client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasons += [choice.finish_reason] if choice.finish_reason else []
            for d in choice.delta.tool_calls or []:
                if d.index == len(calls):
                    assert d.id and d.type == "function" and d.function.name and d.function.arguments == "", d
                    calls.append({"id": d.id, "name": d.function.name, "arguments": ""})
                else:
                    assert d.index == len(calls) - 1 and d.id is d.type is d.function.name is None, d
                    calls[-1]["arguments"] += d.function.arguments
    return content, calls, reasons


async def whole_and_streamed(client: openai.AsyncOpenAI, tools: list[dict], **kwargs):
    """The choice of a whole response, after checking its calls are valid and that the same request streamed
    (greedy: the same output) gives the same content, calls and finish reason."""
    kwargs = {"model": None, "messages": CHAT, "max_tokens": 300, "temperature": 0, "tools": tools, **kwargs}
    choice = (await client.chat.completions.create(**kwargs)).choices[0]
    assert_valid(choice.message.tool_calls, tools)
    content, calls, reasons = await streamed(client, **kwargs)
    assert content == (choice.message.content or "") and reasons == [choice.finish_reason]
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    return choice


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}], ids=["required", "named"]
)
async def test_forced_tool_calls(server, tool_choice):
    """tool_choice required (one call: parallel_tool_calls false) and a named function: one call, no content,
    finish_reason tool_calls."""
    kwargs = {"tool_choice": tool_choice, "parallel_tool_calls": False}
    choice = await whole_and_streamed(server.client(), [WEATHER, NOOP], **kwargs)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    names = [c.function.name for c in choice.message.tool_calls]
    assert names in (["get_weather"], ["noop"]) if tool_choice == "required" else names == ["get_weather"]


async def test_required_with_parallel_calls(server):
    """tool_choice required with parallel_tool_calls left at its default: the model writes several calls, each
    valid. (The tiny model would write calls until max_tokens: a small frequency penalty, lowering the
    separating newline's logit with every call, makes it end after three.)"""
    client = server.client()
    choice = await whole_and_streamed(client, [WEATHER, NOOP], tool_choice="required", frequency_penalty=0.03)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    calls = choice.message.tool_calls
    assert len({c.id for c in calls}) == len(calls) > 1, calls


async def test_auto_writes_a_call(tools_server):
    """tool_choice auto: the tiny random model never writes `<tool_call>` of itself, so a ladder of logit biases
    over the trigger's tokens (each 0.8 below the one before) with presence and frequency penalties (4 once a
    token is written, so it falls below the next) makes greedy decoding spell it. The grammar then makes the
    call a valid one; parallel_tool_calls false ends the output after it."""
    trigger = tools_server.tokenizer.encode("<tool_call>", add_special_tokens=False)
    assert len(set(trigger)) == len(trigger)  # the ladder needs distinct tokens
    bias = {str(t): 100 - 0.8 * k for k, t in enumerate(trigger)}
    kwargs = dict(tool_choice="auto", parallel_tool_calls=False, presence_penalty=2, frequency_penalty=2)
    choice = await whole_and_streamed(tools_server.client(), [WEATHER], logit_bias=bias, **kwargs)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    assert len(choice.message.tool_calls) == 1


async def test_auto_and_none_and_a_tool_conversation(server):
    """With tools, tool_choice auto (the server runs with the hermes parser) and none answer in text (the tiny
    model writes no call); a conversation with an assistant tool call and the tool's result is accepted."""
    client = server.client()
    for choice in ("auto", "none"):
        response = await client.chat.completions.create(
            model=None, messages=CHAT, max_tokens=8, temperature=0, tools=[WEATHER], tool_choice=choice
        )
        assert response.choices[0].finish_reason in ("stop", "length") and response.choices[0].message.content
        assert not response.choices[0].message.tool_calls
    messages = [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
    ]  # fmt: skip
    response = await client.chat.completions.create(model=None, messages=messages, max_tokens=4, tools=[WEATHER])
    assert response.choices[0].finish_reason in ("stop", "length")


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


UNIQUE = tool("tag", {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}})
NONSENSE = tool("f", {"type": "nonsense"})


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "not among the tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [tool("bad name!", {})]}, "tools[0].function.name", "must match"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "not unique"),
        ({"tools": [WEATHER, tool("f", [])], "tool_choice": "required"}, "tools[1].function.parameters",
         "JSON schema object"),
        ({"tools": [WEATHER, UNIQUE], "tool_choice": "required"}, "tools[1].function.parameters",
         "tools[1].function.parameters.properties.tags: 'uniqueItems' is not supported"),
        ({"tools": [UNIQUE, WEATHER], "tool_choice": {"type": "function", "function": {"name": "tag"}}},
         "tools[0].function.parameters", "'uniqueItems' is not supported"),
        ({"tools": [WEATHER, NOOP, NONSENSE], "tool_choice": "required"}, "tools[2].function.parameters",
         "nonsense"),
        ({"tools": [NOOP, NONSENSE], "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tools[1].function.parameters", "nonsense"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tools",
         "cannot be combined"),
        ({"tools": [WEATHER], "tool_choice": "required", "echo": True}, "echo", "echo"),  # (it would be parsed)
    ],
    ids=["unknown_name", "bad_choice", "no_tools", "bad_name", "duplicate", "not_a_schema", "unique_items",
         "unique_items_named", "bad_schema", "bad_schema_named", "with_response_format", "with_echo"],
)  # fmt: skip
async def test_invalid_tools_are_400s(server, extra, param, says):
    with pytest.raises(openai.BadRequestError) as e:
        await server.client().chat.completions.create(model=None, messages=CHAT, max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param and says in e.value.body["message"], e.value.body


async def test_unenforced_keywords_in_tools_not_called(server):
    """A tool outside the grammar (tool_choice none, or another tool named) constrains nothing: its schema is
    only rendered, so a keyword the grammar could not enforce is no reason to refuse the request."""
    client = server.client()
    for choice in ("none", {"type": "function", "function": {"name": "get_weather"}}):
        response = await client.chat.completions.create(
            model=None, messages=CHAT, max_tokens=60, temperature=0, tools=[UNIQUE, WEATHER], tool_choice=choice
        )
        assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")


async def test_auto_needs_the_parser(fake):
    """On a server without --enable-auto-tool-choice (no parser), tool_choice auto, also by default with tools, is
    a 400 explaining the flags, as vLLM answers; none is served."""
    client = fake.client()
    for extra in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model=None, messages=CHAT, max_tokens=4, extra_body=extra)
        assert e.value.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in e.value.body["message"]
    assert not fake.engine.added
    extra = {"tools": [WEATHER], "tool_choice": "none"}
    response = await client.chat.completions.create(model=None, messages=CHAT, max_tokens=4, extra_body=extra)
    assert response.choices[0].message.content and len(fake.engine.added) == 1


@pytest.fixture(scope="module")
async def tools_server(tiny_model_dir):
    """A server with --chat-template frontend/templates/chatml_tools.jinja (SmolLM2's own has no tool section)."""
    from pathlib import Path

    from actors.engine.config import EngineConfig
    from frontend.http_base import HttpConfig
    from frontend.launch import start_server
    from tests.conftest import ServerHandle

    template = (Path(__file__).parents[1] / "frontend" / "templates" / "chatml_tools.jinja").read_text()
    engine = EngineConfig(model=str(tiny_model_dir), max_model_len=1024, num_kv_blocks=128, engine_threads=1)
    http = HttpConfig(port=0, chat_template=template, tool_call_parser="hermes")
    srv = await start_server(engine, http, log_level="WARNING")
    yield (handle := ServerHandle(srv, tiny_model_dir))
    await handle.close_clients()
    await srv.stop()


async def test_a_chat_template_with_tools(tools_server):
    """The replacement template renders the tools into the prompt (their JSON costs prompt tokens) and the
    conversation's tool call and result; a forced call is served as ever."""
    client = tools_server.client()
    plain = await client.chat.completions.create(model=None, messages=CHAT, max_tokens=1)
    with_tools = await client.chat.completions.create(
        model=None, messages=CHAT, max_tokens=100, temperature=0, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False,
    )  # fmt: skip
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 100
    assert with_tools.choices[0].finish_reason == "tool_calls", with_tools.choices[0]

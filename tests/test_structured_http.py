"""Structured outputs over HTTP with the official `openai` client (tiny model): OpenAI's response_format, vLLM's
structured_outputs and guided_* spellings on both endpoints, streamed and not; every invalid spec is a 400 naming
its field, decided before the engine sees the request."""

from __future__ import annotations

import json
import re

import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["color", "n"],
}
CHAT = [{"role": "user", "content": "Pick a color."}]


def valid_json(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"color", "n"} and value["color"] in ("red", "green") and 0 <= value["n"] <= 9


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_response_format_json_schema_on_chat(server, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
    client = server.client()
    if stream:
        chunks = await client.chat.completions.create(
            model=None, messages=CHAT, max_tokens=40, temperature=0, response_format=fmt, stream=True
        )
        parts, reasons = [], []
        async for chunk in chunks:
            parts += [c.delta.content or "" for c in chunk.choices]
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
        text = "".join(parts)
    else:
        response = await client.chat.completions.create(
            model=None, messages=CHAT, max_tokens=40, temperature=0, response_format=fmt
        )
        text, reasons = response.choices[0].message.content, [response.choices[0].finish_reason]
    assert valid_json(text) and reasons == ["stop"]


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"structured_outputs": {"regex": r"[a-z]{3}-\d"}}, lambda t: re.fullmatch(r"[a-z]{3}-\d", t)),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, valid_json),
        ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] "y"'}}, lambda t: re.fullmatch(r"x[0-9]y", t)),
        ({"guided_json": SCHEMA}, valid_json),
        ({"guided_regex": r"\d\d"}, lambda t: re.fullmatch(r"\d\d", t)),
        ({"guided_choice": ["up", "down"], "guided_decoding_backend": "xgrammar"}, lambda t: t in ("up", "down")),
        ({"guided_grammar": 'root ::= "a" | "b"'}, lambda t: t in ("a", "b")),
    ],
    ids=["regex", "choice", "json", "grammar", "g_json", "g_regex", "g_choice", "g_grammar"],
)
async def test_every_spelling_on_completions(server, extra, check):
    """Seeded sampling at temperature 1 (the tiny model's greedy choice would be one path only), n = 2; grammars
    whose outputs are bounded (a random model would fill an open-ended JSON object until max_tokens: json_object
    is tested on SmolLM2, tests/test_structured_real.py)."""
    response = await server.client().completions.create(
        model=None, prompt="Answer:", max_tokens=60, temperature=1.0, seed=7, n=2, extra_body=extra
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop" and check(choice.text), (extra, choice.text)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"guided_choice": ["a"], "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"guided_choice": ["a"], "min_tokens": 2}, "min_tokens"),
        ({"guided_choice": ["a"], "bad_words": ["a"]}, "bad_words"),
        ({"guided_regex": "a" * 70000}, "guided_regex"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ],
    ids=["schema", "format_type", "regex", "grammar", "choice", "two_keys", "unknown_key", "json_text", "two_fields",
         "backend", "min_tokens", "bad_words", "too_long", "tools_on_completions"],
)  # fmt: skip
async def test_invalid_specs_are_400s_naming_the_field(server, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        await server.client().completions.create(model=None, prompt="x", max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body
    assert await server.idle() and all(not any(v for v in r.values()) for r in (await server.idle()).values())


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


def valid_weather(call) -> bool:
    args = json.loads(call.function.arguments)
    return call.function.name == "get_weather" and args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 7


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}], ids=["required", "named"]
)
async def test_forced_tool_calls(server, tool_choice):
    """tool_choice required (one call: parallel_tool_calls false) and a named function: the output parses into
    message.tool_calls whose arguments validate against the schema; finish_reason tool_calls; streamed, the first
    delta of the call carries its id, type and name, and the argument fragments add up to the same call."""
    kwargs = dict(
        model=None, messages=CHAT, max_tokens=60, temperature=0, tools=[WEATHER, NOOP], tool_choice=tool_choice,
        parallel_tool_calls=False,
    )  # fmt: skip
    client = server.client()
    response = await client.chat.completions.create(**kwargs)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    if tool_choice == "required":  # the grammar may pick either tool
        assert [c.function.name for c in choice.message.tool_calls] in (["get_weather"], ["noop"])
    else:
        (call,) = choice.message.tool_calls
        assert valid_weather(call) and call.type == "function" and call.id.startswith("chatcmpl-tool-")
    chunks = await client.chat.completions.create(**kwargs, stream=True)
    deltas, reasons, content = [], [], ""
    async for chunk in chunks:
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            content += c.delta.content or ""
            reasons += [c.finish_reason] if c.finish_reason else []
    assert reasons == ["tool_calls"] and content == ""
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.arguments == ""
    assert all(d.id is None and d.function.name is None and d.index == 0 for d in deltas[1:])
    streamed = "".join(d.function.arguments for d in deltas)
    assert deltas[0].function.name == choice.message.tool_calls[0].function.name
    assert streamed == choice.message.tool_calls[0].function.arguments  # greedy: the same call


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


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
          "tool_choice": "required"}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "echo": True}, "echo"),  # (echo would enter the parser)
    ],
    ids=["unknown_name", "bad_choice", "no_tools", "bad_name", "duplicate", "bad_schema", "with_response_format",
         "with_echo"],
)  # fmt: skip
async def test_invalid_tools_are_400s(server, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        await server.client().chat.completions.create(model=None, messages=CHAT, max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body


def test_auto_needs_the_parser(server):
    """Without --enable-auto-tool-choice (no parser), tool_choice auto, also by default with tools, is a 400
    explaining the flags, as vLLM answers."""
    from frontend.body import RequestError
    from frontend.protocol import ServingContext, parse_chat

    ctx = ServingContext(server.tokenizer, ["tiny"], 512, 49152)
    for body in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):
        with pytest.raises(RequestError, match="--enable-auto-tool-choice") as e:
            parse_chat(json.dumps({"messages": CHAT, **body}).encode(), ctx)
        assert e.value.param == "tool_choice"
    assert parse_chat(json.dumps({"messages": CHAT, "tools": [WEATHER], "tool_choice": "none"}).encode(), ctx)


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
    yield ServerHandle(srv, tiny_model_dir)
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

"""Reasoning outputs over HTTP with the real `openai` client (issue 29): the real HTTP process started with
`--reasoning-parser qwen3` and a Qwen3-style chat template, against tests.fake_engine's scripted outputs (their
think tags cut across deltas): `message.reasoning` / `reasoning_content` whole and streamed, `include_reasoning:
false`, the tool parser reading only the content, a structured output's grammar sent to the engine after the
reasoning, and `chat_template_kwargs` (Qwen3's `enable_thinking`) changing the prompt /tokenize gives."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.conftest import ServerHandle
from tests.test_reasoning import CHAT, QWEN3_TEMPLATE
from tests.test_tools_http import WEATHER

SCRIPT = ["<thi", "nk>Let me", " think.</th", "ink>\n\nIt is", " 4."]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}\n</tool_call>'


@pytest.fixture(scope="module")
async def thinking(tiny_model_dir):
    """The HTTP process with a qwen3 reasoning parser; the fake engine answers only as a test scripts it."""
    from actors.engine.config import EngineConfig
    from frontend.http_base import HttpConfig
    from frontend.launch import Server, pick_port
    from frontend.preflight import http_processes, resolve_model
    from tests.fake_engine import FakeEngine

    model = resolve_model(str(tiny_model_dir))
    config = HttpConfig(port=0, reasoning_parser="qwen3", chat_template=QWEN3_TEMPLATE, tool_call_parser="hermes")
    http, engine = pick_port(config), FakeEngine()
    engine.hold = True
    srv = Server(http_processes(model, EngineConfig(model=str(model.path)), http), http, local=[engine])
    await srv.start()
    yield (handle := ServerHandle(srv, tiny_model_dir, engine=engine))
    await handle.close_clients()
    await srv.stop()


async def chat(server: ServerHandle, script: list[str], stream: bool, **kwargs) -> tuple[str | None, str, list]:
    """(reasoning, content, tool calls) of a chat the engine answers with `script`, one delta per piece; streamed,
    each chunk is checked to carry reasoning or content, never a tag."""
    engine, before = server.engine, len(server.engine.added)
    create = server.client().chat.completions.create(model="", messages=CHAT, stream=stream, **kwargs)
    answer = asyncio.ensure_future(create)
    rid = (await engine.wait_added(before)).request_id
    for i, piece in enumerate(script):
        engine.emit(rid, piece, [100 + i])
    engine.finish(rid, "stop")
    response = await answer
    if not stream:
        message = response.choices[0].message
        assert message.reasoning == message.reasoning_content
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
        return message.reasoning, message.content, calls
    reasoning, content, calls = None, "", []
    async for chunk in response:
        for choice in chunk.choices:
            delta = choice.delta
            part = getattr(delta, "reasoning_content", None)
            assert part == getattr(delta, "reasoning", None) and "think>" not in (part or "") + (delta.content or "")
            reasoning = part if reasoning is None else reasoning + (part or "")
            content += delta.content or ""
            for d in delta.tool_calls or []:
                calls += [[d.function.name, ""]] if d.id else []
                calls[-1][1] += d.function.arguments
    return reasoning, content, [(name, json.loads(args)) for name, args in calls]


@pytest.mark.parametrize("stream", [False, True])
async def test_reasoning_is_split_out_of_the_content(thinking, stream):
    assert await chat(thinking, SCRIPT, stream) == ("Let me think.", "\n\nIt is 4.", [])
    no_block = await chat(thinking, ["It is", " 4."], stream)
    assert no_block == (None, "It is 4.", [])  # qwen3: no <think>, no reasoning


@pytest.mark.parametrize("stream", [False, True])
async def test_include_reasoning_false_drops_the_reasoning(thinking, stream):
    dropped = await chat(thinking, SCRIPT, stream, extra_body={"include_reasoning": False})
    assert dropped == (None, "\n\nIt is 4.", [])


@pytest.mark.parametrize("stream", [False, True])
async def test_the_tool_parser_reads_only_the_content(thinking, stream):
    """A <tool_call> in the reasoning is reasoning; the call after it is parsed; the grammar sent to the engine
    lets an optional think block come first."""
    script = ["<think>I could write <tool", "_call> now.</think>", "Sure.", CALL[:30], CALL[30:]]
    reasoning, content, calls = await chat(thinking, script, stream, tools=[WEATHER])
    assert (reasoning, content) == ("I could write <tool_call> now.", "Sure.")
    assert calls == [("get_weather", {"city": "Rome", "days": 1})]
    grammar = json.loads(thinking.engine.added[-1].params.structured.spec)["format"]
    assert [e["type"] for e in grammar["elements"]] == ["optional", "triggered_tags"]


async def test_a_structured_output_applies_after_the_reasoning(thinking):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    reasoning, content, _ = await chat(thinking, ["<think>Hmm.</think>", '{"a": 4}'], False, response_format=fmt)
    assert (reasoning, json.loads(content)) == ("Hmm.", {"a": 4})
    structured = thinking.engine.added[-1].params.structured
    elements = json.loads(structured.spec)["format"]["elements"]
    assert structured.kind == "structural_tag" and elements[1]["json_schema"] == schema


async def test_enable_thinking_reaches_the_template(thinking):
    """/tokenize with and without chat_template_kwargs: the template closes an empty think block when asked; the
    chat then starts outside any reasoning (a later <think> would still open one, as qwen3 reads it)."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    async with thinking.session() as s:
        texts = []
        for extra in ({}, off):
            async with s.post("/tokenize", json={"messages": CHAT, **extra}) as resp:
                texts.append(thinking.tokenizer.decode((await resp.json())["tokens"]))
    assert texts[0].endswith("<|im_start|>assistant\n") and texts[1] == texts[0] + "<think>\n\n</think>\n\n"
    assert await chat(thinking, ["It is 4."], True, extra_body=off) == (None, "It is 4.", [])


async def respond(server: ServerHandle, script: list[str], stream: bool, **kwargs) -> list[tuple]:
    """The Responses API's output items, as (type, text) pairs, of a response the engine answers with `script`;
    streamed, the reasoning and text deltas are checked to add up to their items."""
    engine, before = server.engine, len(server.engine.added)
    answer = asyncio.ensure_future(server.client().responses.create(model="", input=CHAT, stream=stream, **kwargs))
    rid = (await engine.wait_added(before)).request_id
    for i, piece in enumerate(script):
        engine.emit(rid, piece, [100 + i])
    engine.finish(rid, "stop")
    response = await answer
    if stream:
        events = [e async for e in response]
        response = events[-1].response
        deltas = {"reasoning": "", "message": ""}
        for e in events:
            if e.type in ("response.reasoning_text.delta", "response.output_text.delta"):
                deltas["reasoning" if "reasoning" in e.type else "message"] += e.delta
        assert deltas == {kind: "".join(_text(o) for o in response.output if o.type == kind) for kind in deltas}
    assert response.status == "completed"
    return [(o.type, _text(o)) for o in response.output]


def _text(item) -> str:
    if item.type == "function_call":
        return f"{item.name} {item.arguments}"
    return item.content[0].text


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_reasoning_items(thinking, stream):
    """A Response says what the chat says: a reasoning item, then the message or the call."""
    assert await respond(thinking, SCRIPT, stream) == [("reasoning", "Let me think."), ("message", "\n\nIt is 4.")]
    script = ["<think>Hmm.</think>", CALL[:30], CALL[30:]]
    tool = {"type": "function", **WEATHER["function"]}
    called = await respond(thinking, script, stream, tools=[tool])
    assert called == [("reasoning", "Hmm."), ("function_call", 'get_weather {"city": "Rome", "days": 1}')]
    then = await respond(thinking, [CALL + "\nAfter."], stream, tools=[tool])  # (one delta: the call, then text)
    assert then == [("function_call", 'get_weather {"city": "Rome", "days": 1}'), ("message", "\nAfter.")]

"""The Responses API with the official `openai` client (tiny model, a store of its own): create (text, instructions,
items), the semantic stream (event order and sequence numbers; its text is the non-streamed greedy text), greedy
output equal to chat completions' for the same conversation, function tools (a forced call, then its output's
turn), text.format json_schema, stored responses (retrieve, input items, delete), and previous_response_id across a
server restart."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.test_tools_http import WEATHER

GREEDY = {"temperature": 0, "max_output_tokens": 12}
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["color", "n"],
    "additionalProperties": False,
}
FLAT_WEATHER = {"type": "function", **WEATHER["function"]}  # the Responses API's function tool: flat


@pytest.fixture(scope="module")
async def served(tiny_model_dir, tmp_path_factory):
    """{"server": the server now (a test may restart it on the same store), "db": the store's path}."""
    from tests.conftest import ServerHandle

    db = tmp_path_factory.mktemp("responses") / "responses.sqlite3"
    holder = {"db": db}
    holder["server"] = ServerHandle(await start(tiny_model_dir, db), tiny_model_dir)
    yield holder
    await holder["server"].close_clients()
    await holder["server"].server.stop()


async def start(model_dir, db):
    from actors.engine.config import EngineConfig
    from frontend.http_base import HttpConfig
    from frontend.launch import start_server

    engine = EngineConfig(model=str(model_dir), max_model_len=512, max_num_seqs=8, num_kv_blocks=128, engine_threads=1)
    http = HttpConfig(port=0, tool_call_parser="hermes", responses_db=str(db))
    return await start_server(engine, http, log_level="WARNING")


@pytest.fixture
def client(served) -> openai.AsyncOpenAI:
    return served["server"].client()


def events_in_order(events) -> None:
    """Sequence numbers 0, 1, ...; created first and one terminal event last; every item added before its deltas
    and done after them."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert sum(k.startswith("response.") and k.count(".") == 1 for k in kinds[2:-1]) == 0, kinds
    open_items = set()
    for e in events[1:-1]:
        if e.type == "response.output_item.added":
            open_items.add(e.output_index)
        elif e.type == "response.output_item.done":
            open_items.remove(e.output_index)
        elif hasattr(e, "output_index"):
            assert e.output_index in open_items, e
    assert not open_items


async def test_text_equals_chat_and_the_stream(client):
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]
    chat = await client.chat.completions.create(model=None, messages=convo, temperature=0, max_completion_tokens=12)
    whole = await client.responses.create(model="", instructions="Be brief.", input="Name a fruit.", **GREEDY)
    assert whole.output_text == chat.choices[0].message.content
    assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    events = [e async for e in await client.responses.create(
        model="", instructions="Be brief.", input="Name a fruit.", stream=True, **GREEDY)]  # fmt: skip
    events_in_order(events)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert events[-1].response.output_text == text
    chunked = [e async for e in await client.responses.create(
        model="", instructions="Be brief.", input="Name a fruit.", stream=True, extra_body={"stream_interval": 4},
        **GREEDY)]  # fmt: skip
    deltas = [e.delta for e in chunked if e.type == "response.output_text.delta"]
    assert "".join(deltas) == text and len(deltas) <= 1 + (whole.usage.output_tokens - 1) // 4 + 1  # (the first, the
    # others of 4 tokens at least, the end's)


async def test_items(client):
    items = [
        {"role": "developer", "content": "Answer in one word."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    convo = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]  # fmt: skip
    chat = await client.chat.completions.create(model=None, messages=convo, temperature=0, max_completion_tokens=12)
    r = await client.responses.create(model="", input=items, **GREEDY)
    assert r.output_text == chat.choices[0].message.content


async def test_forced_call_then_its_output(client):
    first = await client.responses.create(
        model="", input="Weather in Rome?", tools=[FLAT_WEATHER], tool_choice={"type": "function", "name":
        "get_weather"}, temperature=0, max_output_tokens=60,
    )  # fmt: skip
    calls = [o for o in first.output if o.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])
    second = await client.responses.create(
        model="", previous_response_id=first.id, tools=[FLAT_WEATHER], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}], **GREEDY,
    )  # fmt: skip
    assert second.status in ("completed", "incomplete") and second.output[0].type == "message"
    listed = await client.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in listed.data] == ["message", "function_call", "function_call_output"]


async def test_json_schema_and_the_stream_helper(client):
    fmt = {"type": "json_schema", "name": "pick", "schema": SCHEMA, "strict": True}
    whole = await client.responses.create(model="", input="Pick.", text={"format": fmt}, temperature=0,
                                          max_output_tokens=40)  # fmt: skip
    jsonschema.validate(json.loads(whole.output_text), SCHEMA)
    async with client.responses.stream(model="", input="Pick.", text={"format": fmt}, temperature=0,
                                       max_output_tokens=40) as stream:  # fmt: skip
        events = [e async for e in stream]
        final = await stream.get_final_response()
    events_in_order(events)
    assert final.status == "completed" and final.output_text == whole.output_text


async def test_retrieve_delete(client):
    r = await client.responses.create(model="", input="Hi", **GREEDY)
    got = await client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    await client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(r.id)
    unstored = await client.responses.create(model="", input="Hi", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)


async def test_previous_response_across_a_restart(served, tiny_model_dir):
    client = served["server"].client()
    first = await client.responses.create(model="", input="My name is Ada.", **GREEDY)
    await served["server"].close_clients()
    await served["server"].server.stop()
    from tests.conftest import ServerHandle

    served["server"] = ServerHandle(await start(tiny_model_dir, served["db"]), tiny_model_dir)
    client = served["server"].client()
    second = await client.responses.create(model="", previous_response_id=first.id, input="My name?", **GREEDY)
    convo = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "My name?"}]  # fmt: skip
    chat = await client.chat.completions.create(model=None, messages=convo, temperature=0, max_completion_tokens=12)
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id


async def test_logprobs_and_cached_tokens(client):
    convo = [{"role": "user", "content": "Name a color, please, in one word."}]
    chat = await client.chat.completions.create(model=None, messages=convo, temperature=0, max_completion_tokens=6,
                                                logprobs=True, top_logprobs=2)  # fmt: skip
    r = await client.responses.create(model="", input=convo, temperature=0, max_output_tokens=6, top_logprobs=2,
                                      include=["message.output_text.logprobs"])  # fmt: skip
    got, want = r.output[0].content[0].logprobs, chat.choices[0].logprobs.content
    assert [(x.token, len(x.top_logprobs)) for x in got] == [(x.token, 2) for x in want]
    assert [x.logprob for x in got] == pytest.approx([x.logprob for x in want], abs=1e-3)
    assert r.usage.input_tokens_details.cached_tokens >= 16  # the chat's prompt blocks, found in the prefix cache

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
TAG = {  # xgrammar's structural tag: the schema's JSON between <v> and </v> (whitespace runs of 1 at most: the
    # random model would otherwise fill the free whitespace JSON allows until max_tokens)
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<v>",
        "content": {"type": "json_schema", "json_schema": SCHEMA, "max_whitespace_cnt": 1},
        "end": "</v>",
    },
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
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}, valid_json),
        (
            {"structured_outputs": {"structural_tag": TAG}},
            lambda t: t[:3] + t[-4:] == "<v></v>" and valid_json(t[3:-4]),
        ),
    ],
    ids=["regex", "choice", "json", "grammar", "g_json", "g_regex", "g_choice", "g_grammar", "format", "tag"],
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
        ({"structured_outputs": {"regex": "a", "disable_any_whitespace": False}},
         "structured_outputs.disable_any_whitespace"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"guided_choice": ["a"], "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"guided_choice": ["a"], "min_tokens": 2}, "min_tokens"),
        ({"guided_choice": ["a"], "bad_words": ["a"]}, "bad_words"),
        ({"guided_regex": "a" * 70000}, "guided_regex"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ],
    ids=["schema", "format_type", "regex", "grammar", "choice", "two_keys", "unknown_key", "any_whitespace",
         "json_text", "two_fields", "backend", "min_tokens", "bad_words", "too_long", "tools_on_completions"],
)  # fmt: skip
async def test_invalid_specs_are_400s_naming_the_field(server, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        await server.client().completions.create(model=None, prompt="x", max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body
    assert await server.idle() and all(not any(v for v in r.values()) for r in (await server.idle()).values())


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


async def test_an_unenforceable_schema_is_a_400_saying_why(server):
    """A keyword the grammar would not enforce (here `not`) is refused, not ignored: the 400 names the field and
    the keyword."""
    fmt = json_schema({"type": "object", "properties": {"a": {"not": {"type": "null"}}}})
    with pytest.raises(openai.BadRequestError) as e:
        await server.client().chat.completions.create(model=None, messages=CHAT, max_tokens=4, response_format=fmt)
    assert e.value.body["param"] == "response_format.json_schema.schema", e.value.body
    assert "properties.a: 'not' is not supported" in e.value.body["message"], e.value.body


GRAMMAR_TIMEOUT_S = 0.2


@pytest.fixture(scope="module")
async def deadline_server(tiny_model_dir):
    """The HTTP process alone (tests/fake_engine.py serves what it admits) with a short grammar compile deadline."""
    from actors.engine.config import EngineConfig
    from frontend.http_base import HttpConfig
    from frontend.launch import Server, pick_port
    from frontend.preflight import http_processes, resolve_model
    from tests.conftest import ServerHandle
    from tests.fake_engine import FakeEngine

    model = resolve_model(str(tiny_model_dir))
    http = pick_port(HttpConfig(port=0, grammar_timeout_s=GRAMMAR_TIMEOUT_S))
    srv = Server(http_processes(model, EngineConfig(model=str(model.path)), http), http, local=[FakeEngine()])
    await srv.start()
    yield (handle := ServerHandle(srv, tiny_model_dir))
    await handle.close_clients()
    await srv.stop()


async def test_a_spec_slow_to_compile_is_a_400(deadline_server):
    """A spec that compiles within --grammar-compile-timeout is served; a schema whose grammar takes longer (a
    string of up to 100,000 characters: 0.8 to 3 s on a 2-core CPU, against 0.2 s) is a 400 naming its field."""
    client = deadline_server.client()
    quick = {"structured_outputs": {"regex": "[a-z]"}}  # (first: the slow compile runs on after its 400)
    response = await client.chat.completions.create(model=None, messages=CHAT, max_tokens=4, extra_body=quick)
    assert response.choices[0].finish_reason == "length"
    slow = json_schema({"type": "object", "properties": {"s": {"type": "string", "maxLength": 100_000}}})
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=None, messages=CHAT, max_tokens=4, response_format=slow)
    assert e.value.body["param"] == "response_format.json_schema.schema", e.value.body
    assert f"took more than {GRAMMAR_TIMEOUT_S:g} s" in e.value.body["message"], e.value.body

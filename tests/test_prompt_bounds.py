"""What a chat's template renders is bounded before it is tokenized (issue 28): contents, names, tools and tool-call
arguments all count, as does what /tokenize and /detokenize take; JSON carried inside a field is held to the body's
rules (a 400 naming the field, never a RecursionError); and a guided chat's companion is the conversation exactly as
the request renders it, but for its negated user turn."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from frontend.body import MAX_JSON_DEPTH
from frontend.context import ServingContext
from frontend.protocol import RequestError, parse_chat, parse_completion
from frontend.tokenize import detokenize, tokenize
from frontend.tokenizer import Tokenizer
from tests.test_tokenizer import write_tiny_model_dir

TOOLS_TEMPLATE = (Path(__file__).parents[1] / "frontend" / "templates" / "chatml_tools.jinja").read_text()
LONG = "x" * 400_000  # at least 400_000 / max_token_chars tokens: far more than the contexts' 64 and 2048


@pytest.fixture(scope="module")
def ctx(tmp_path_factory) -> ServingContext:
    """The tiny tokenizer with a template that renders names (tests/test_tokenizer.py's); max_model_len 64."""
    tok = Tokenizer.from_model_dir(write_tiny_model_dir(tmp_path_factory.mktemp("tiny")))
    return ServingContext(tok, ["tiny"], max_model_len=64, vocab_size=tok.vocab_size, bos_token_id=1)


@pytest.fixture(scope="module")
def tools_ctx(ctx, tmp_path_factory) -> ServingContext:
    """The same with the ChatML tools template (renders tools and tool calls; its system prompt alone is ~500
    tokens), and max_model_len 2048."""
    tok = Tokenizer.from_model_dir(write_tiny_model_dir(tmp_path_factory.mktemp("tools"), TOOLS_TEMPLATE))
    return dataclasses.replace(ctx, tokenizer=tok, max_model_len=2048)


def refused(parse, ctx, body: dict, monkeypatch) -> RequestError:
    """The 400 `parse` answers, asserting nothing was tokenized first."""
    monkeypatch.setattr(ctx.tokenizer.hf, "encode_batch_fast", None, raising=False)  # (any encode now fails)
    with pytest.raises(RequestError) as e:
        parse(json.dumps(body).encode(), ctx)
    assert e.value.status == 400
    return e.value


def tool(description: str = "adds", parameters: dict | None = None) -> dict:
    fn = {"name": "add", "description": description, "parameters": parameters or {"type": "object"}}
    return {"type": "function", "function": fn}


def call(arguments: str) -> dict:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": arguments}}]}  # fmt: skip


USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("which", "body"),
    [
        ("ctx", {"messages": [{**USER, "name": LONG}]}),
        ("tools_ctx", {"messages": [USER], "tools": [tool(LONG)], "tool_choice": "none"}),
        ("tools_ctx", {"messages": [call(json.dumps({"a": LONG})), USER]}),
    ],
    ids=["a name", "a tool's description", "tool-call arguments"],
)
def test_everything_the_template_renders_counts_before_tokenizing(request, monkeypatch, which, body):
    ctx = request.getfixturevalue(which)
    error = refused(parse_chat, ctx, body, monkeypatch)
    assert error.param == "messages" and "at least" in error.message


DEEP = "[" * 5000 + "]" * 5000  # deeper than the recursion limit: json.loads raises RecursionError
TOO_DEEP = "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def nested_schema(depth: int) -> dict:
    schema = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("text", [DEEP, TOO_DEEP, '{"a": 1, "a": 2}', '{"a": NaN}', '"\\ud800"'])
@pytest.mark.parametrize(
    ("parse", "field", "param"),
    [
        (parse_completion, lambda t: {"guided_json": t}, "guided_json"),
        (parse_completion, lambda t: {"structured_outputs": {"json": t}}, "structured_outputs.json"),
        (parse_chat, lambda t: {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": t}}},
         "response_format.json_schema.schema"),
        (parse_chat, lambda t: {"messages": [call(t), USER]}, "messages[0].tool_calls[0]"),
    ],
)  # fmt: skip
def test_json_text_in_a_field_is_parsed_as_bodies_are(ctx, parse, field, param, text):
    """Nested too deeply (past the recursion limit, or past MAX_JSON_DEPTH), a duplicate key, NaN, a lone surrogate:
    each a 400 naming the field, as in a body."""
    base = {"prompt": "hi"} if parse is parse_completion else {"messages": [USER]}
    with pytest.raises(RequestError) as e:
        parse(json.dumps({**base, "max_tokens": 2, **field(text)}).encode(), ctx)
    assert (e.value.status, e.value.param) == (400, param)


def test_json_within_the_depth_bound_is_taken(ctx):
    inside = "[" * (MAX_JSON_DEPTH - 1) + "1" + "]" * (MAX_JSON_DEPTH - 1)
    body = {"messages": [call(json.dumps({"a": json.loads(inside)})), USER], "max_tokens": 2}
    assert parse_chat(json.dumps(body).encode(), ctx).prompts[0].token_ids
    body = {"prompt": "hi", "max_tokens": 2, "guided_json": json.dumps(nested_schema(MAX_JSON_DEPTH // 2 - 1))}
    assert parse_completion(json.dumps(body).encode(), ctx).prompts[0].params.structured is not None


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ({"tools": [tool(parameters=nested_schema(400))]}, "tools[0]"),
        ({"messages": [{"role": "user", "content": "hi", "extra": json.loads(TOO_DEEP)}]}, "messages"),
    ],
)
def test_values_walked_after_parsing_are_bounded_in_depth(tools_ctx, field, param):
    body = {"messages": [USER], "max_tokens": 2, **field}
    with pytest.raises(RequestError) as e:
        parse_chat(json.dumps(body).encode(), tools_ctx)
    assert (e.value.status, e.value.param) == (400, param)


def test_tokenize_and_detokenize_are_bounded_as_prompts_are(ctx, monkeypatch):
    assert tokenize(json.dumps({"prompt": "hi there"}).encode(), ctx)["count"] == len(ctx.tokenizer.encode("hi there"))
    too_many = list(range(3, 3 + 65))
    with pytest.raises(RequestError) as e:
        detokenize(json.dumps({"tokens": too_many}).encode(), ctx)
    assert (e.value.status, e.value.param) == (400, "tokens")
    assert detokenize(json.dumps({"tokens": too_many[:64]}).encode(), ctx)["prompt"]
    for body, param in [({"prompt": LONG}, "prompt"), ({"messages": [{**USER, "name": LONG}]}, "messages")]:
        assert refused(tokenize, ctx, body, monkeypatch).param == param


def test_tokenize_takes_up_to_the_context_and_refuses_past_it(ctx):
    """Under the characters' bound but over the context once tokenized: refused, saying how many tokens."""
    text = " ".join(["hello"] * 70)  # ~70 tokens, 419 characters (bound: at least 6)
    with pytest.raises(RequestError) as e:
        tokenize(json.dumps({"prompt": text}).encode(), ctx)
    assert e.value.param == "prompt" and str(len(ctx.tokenizer.encode(text))) in e.value.message
    full = " ".join(["hello"] * 200)
    fits = full[: next(i for i in range(len(full), 0, -1) if len(ctx.tokenizer.encode(full[:i])) == 64)]
    assert tokenize(json.dumps({"prompt": fits}).encode(), ctx)["count"] == 64  # (as /detokenize takes 64)


@pytest.mark.parametrize(
    "extra",
    [{}, {"continue_final_message": True, "add_generation_prompt": False}, {"tools": [tool()], "tool_choice": "none"}],
    ids=["plain", "continue_final_message", "tools"],
)
def test_a_guided_chats_companion_is_its_conversation_with_the_negated_turn(tools_ctx, extra):
    """The companion's text is the request's own rendered text with the last user turn's words replaced, and
    nothing else: same tools, same generation prompt (or continued final message)."""
    messages = [{"role": "user", "content": "praise cats"}, {"role": "assistant", "content": "Sure, "}]
    if "continue_final_message" not in extra:
        messages = messages[:1]
    body = {"messages": messages, "max_tokens": 2, "guidance_scale": 3, "negative_prompt": "praise dogs", **extra}
    parsed = parse_chat(json.dumps(body).encode(), tools_ctx).prompts[0]
    decode = tools_ctx.tokenizer.decode
    assert decode(parsed.params.negative_prompt_token_ids) == decode(parsed.token_ids).replace("cats", "dogs")
    assert "cats" in decode(parsed.token_ids)

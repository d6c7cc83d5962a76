"""frontend/tool_parser.py: Hermes tool calls out of text, whole and streamed in any chunking, with the same
result; arguments stream as they are read and concatenate to the exact JSON text."""

from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.tool_parser import ToolCallParser, parse_tool_calls


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


TRICKY = '{"s": "a } ] </tool_call> \\" {", "nested": {"b": [1, {"c": 2}]}}'
TEXTS = [
    call("f", '{"x": 1}'),
    "Sure.\n" + call("f", TRICKY) + "\n" + call("g", "{}") + "\nDone.",
    "no calls here <tool",
    "x <tool_call> not json </tool_call> y",
    '<tool_call>\n{"name": "f", "arg',
    'pre <tool_call>\n{"name": "f", "arguments": {"x": [1, 2',
    'a <tool_call>{ "name" : "h" , "arguments" :{}} </tool_call>  ',
    "  plain  text \n",
]


def streamed(text: str, cuts: list[int]) -> tuple[str, list[dict], dict[int, str], list]:
    parser, content, arguments, firsts = ToolCallParser(), "", {}, []
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    for piece in [*pieces, None]:
        more, deltas = parser.finish() if piece is None else parser.feed(piece)
        content += more
        for d in deltas:
            arguments[d.index] = arguments.get(d.index, "") + d.arguments
            if d.id is not None:
                firsts.append((d.index, d.name, d.arguments))
    return content, parser.calls, arguments, firsts


def test_calls_and_content():
    content, calls = parse_tool_calls(TEXTS[1])
    assert content == "Sure.\n\nDone."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", json.loads(TRICKY)),
        ("g", {}),
    ]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls)
    assert len(calls[0]["id"]) == len("chatcmpl-tool-") + 32 and calls[0]["id"] != calls[1]["id"]
    assert parse_tool_calls(TEXTS[0])[0] is None  # no content around the call


def test_what_is_not_a_call_stays_content():
    assert parse_tool_calls(TEXTS[2]) == ("no calls here <tool", [])
    assert parse_tool_calls(TEXTS[3]) == ("x <tool_call> not json </tool_call> y", [])
    assert parse_tool_calls(TEXTS[4]) == ('<tool_call>\n{"name": "f", "arg', [])  # cut inside the header
    assert parse_tool_calls(TEXTS[7]) == ("  plain  text \n", [])


def test_a_call_cut_after_its_header_keeps_its_partial_arguments():
    content, calls = parse_tool_calls(TEXTS[5])
    assert content == "pre " and [c["function"]["arguments"] for c in calls] == ['{"x": [1, 2']


def test_lenient_whitespace():
    assert [c["function"]["name"] for c in parse_tool_calls(TEXTS[6])[1]] == ["h"]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(min_value=0, max_value=400), max_size=30))
def test_any_chunking_streams_the_same_result(text, cuts):
    """Content and calls equal the whole-text parse; each call's first delta carries id and name with empty
    arguments, and its fragments concatenate to its arguments."""
    content, calls = parse_tool_calls(text)
    got, got_calls, arguments, firsts = streamed(text, cuts)
    assert (got if got.strip() or not calls else None) == content
    assert [c["function"] for c in got_calls] == [c["function"] for c in calls]
    assert [arguments[i] for i in range(len(calls))] == [c["function"]["arguments"] for c in calls]
    assert firsts == [(i, c["function"]["name"], "") for i, c in enumerate(calls)]


def test_arguments_stream_before_the_call_closes():
    parser = ToolCallParser()
    _, deltas = parser.feed('<tool_call>\n{"name": "f", "arguments": {"city": "Par')
    assert [(d.name, d.arguments) for d in deltas] == [("f", ""), (None, '{"city": "Par')]
    _, deltas = parser.feed('is"}}\n</tool_')
    assert [d.arguments for d in deltas] == ['is"}']
    assert parser.feed("call>") == ("", []) and parser.finish() == ("", [])

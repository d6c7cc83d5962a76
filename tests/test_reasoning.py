"""Reasoning outputs and chat_template_kwargs (issue 29), below HTTP: the qwen3 and deepseek_r1 splits of
`<think>...</think>` (frontend/reasoning.py) whole and streamed in every cut of the text, the phase the prompt starts
the output in, grammars applied after the reasoning (compiled and matched by xgrammar), and chat_template_kwargs
rendered wherever the chat is (the prompt, /tokenize, the CFG companion) and checked. Over HTTP with the `openai`
client: tests/test_reasoning_http.py."""

from __future__ import annotations

import json

import pytest

from actors.engine.grammar import grammars
from frontend.context import ServingContext
from frontend.protocol import RequestError, parse_chat
from frontend.reasoning import Phase, Reasoning, ReasoningParser, after_reasoning, start_phase
from frontend.tokenize import tokenize
from frontend.tokenizer import Tokenizer
from frontend.tools import tool_grammar, tool_parameters
from messages.sampling_params import StructuredOutput

# Qwen3's own logic: enable_thinking false closes an empty think block in the generation prompt
QWEN3_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)
CHAT = [{"role": "user", "content": "What is 2 + 2?"}]
CASES = [  # parser, output, its reasoning (None: none), its content
    ("qwen3", "<think>Let me see.</think>\n\nIt is 4.", "Let me see.", "\n\nIt is 4."),
    ("qwen3", "It is 4.", None, "It is 4."),
    ("qwen3", "So <think>a</think>b", "a", "So b"),
    ("qwen3", "<think>cut off by the length", "cut off by the length", ""),
    ("qwen3", "<think>a</think>b<think>c</think>", "a", "b<think>c</think>"),
    ("qwen3", "a</think>b", None, "a</think>b"),
    ("deepseek_r1", "Let me see.</think>It is 4.", "Let me see.", "It is 4."),
    ("deepseek_r1", "<think>Let me see.</think>It is 4.", "Let me see.", "It is 4."),
    ("deepseek_r1", "all of it reasoning <", "all of it reasoning <", ""),
    ("deepseek_r1", "</think>", "", ""),
]


def streamed(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning = content = ""
    for piece in [*pieces, None]:
        r, c = parser.feed(piece) if piece is not None else parser.finish()
        assert "think>" not in r, (pieces, r)  # a tag is never reasoning
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_whole_outputs_split_as_vllm_does(parser, text, reasoning, content):
    assert Reasoning(start_phase(parser, "<|im_start|>assistant\n")).split(text) == (reasoning, content)


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_streamed_outputs_split_alike_however_the_tags_are_cut(parser, text, reasoning, content):
    """Every cut of the text into three deltas (tags split anywhere), and one character at a time."""
    split = Reasoning(start_phase(parser, ""))
    cuts = [[text[:i], text[i:j], text[j:]] for i in range(len(text) + 1) for j in range(i, len(text) + 1)]
    for pieces in [*cuts, list(text)]:
        assert streamed(split.parser(), pieces) == (reasoning or "", content), pieces


def test_streaming_holds_back_only_what_may_be_a_tag():
    parser = ReasoningParser(Phase.BEFORE)
    assert parser.feed("Hi <th") == ("", "Hi ")
    assert parser.feed("ink>Let") == ("Let", "")
    assert parser.feed(" me</thin") == (" me", "")
    assert parser.feed("king") == ("</thinking", "")  # not a tag after all: reasoning
    assert parser.feed("</think>4<") == ("", "4<")  # after the reasoning nothing is held back
    assert parser.finish() == ("", "")


@pytest.mark.parametrize(
    ("parser", "prompt", "phase"),
    [
        ("qwen3", "<|im_start|>assistant\n", Phase.BEFORE),
        ("deepseek_r1", "<|im_start|>assistant\n", Phase.REASONING),
        ("qwen3", "<｜Assistant｜><think>\n", Phase.REASONING),  # the template opened the block (Qwen3.5, R1-0528)
        ("deepseek_r1", "<|im_start|>assistant\n<think>\n\n</think>\n\n", Phase.BEFORE),  # enable_thinking false
        ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", Phase.BEFORE),
        ("deepseek_r1", "<think>a</think>b<|im_end|>\n<|im_start|>assistant\n", Phase.BEFORE),  # a thought kept
    ],
)
def test_the_prompt_s_last_think_tag_decides_where_the_output_starts(parser, prompt, phase):
    assert start_phase(parser, prompt) is phase


def test_under_a_grammar_a_think_block_only_opens_the_output():
    split = Reasoning(Phase.BEFORE, leading=True)
    assert split.split('{"a": "<think>x</think>"}') == (None, '{"a": "<think>x</think>"}')
    assert split.split('<think>r</think>{"a": 1}') == ("r", '{"a": 1}')
    assert streamed(split.parser(), ["<", "thi", "nk>r</th", "ink>{}"]) == ("r", "{}")


@pytest.fixture(scope="module")
def compiler(tiny_model_dir):
    tok = Tokenizer.from_model_dir(tiny_model_dir)
    return grammars(str(tiny_model_dir), tok.vocab_size, tuple(tok.eos_token_ids))


def matches(compiler, spec: StructuredOutput, text: str) -> bool:
    """Whether the grammar takes `text` and is complete after it."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiler.compile(spec))
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize(
    ("kind", "spec", "good", "bad"),
    [
        ("json", '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}', '{"a": 1}', "{}"),
        ("json_object", "", '{"b": [1]}', "[1]"),
        ("regex", "[0-9]+", "42", "x"),
        ("choice", '["yes", "no"]', "no", "maybe"),
        ("grammar", 'root ::= "a"+', "aaa", "b"),
        ("structural_tag", '{"type": "structural_tag", "format": {"type": "const_string", "value": "ok"}}', "ok", "k"),
    ],
)
def test_grammars_apply_once_the_reasoning_ends(compiler, kind, spec, good, bad):
    """From REASONING: any text up to </think>, then the spec; from BEFORE: an optional think block first."""
    inner = StructuredOutput(kind=kind, spec=spec)
    after = after_reasoning(inner, Phase.REASONING, "p")
    assert matches(compiler, after, "Hmm, {x} <think> y.</think>" + good)
    assert not matches(compiler, after, "Hmm.</think>" + bad)
    assert not matches(compiler, after, good)  # (still inside the reasoning)
    optional = after_reasoning(inner, Phase.BEFORE, "p")
    assert matches(compiler, optional, good) and matches(compiler, optional, "<think>Hmm.</think>" + good)
    assert not matches(compiler, optional, "Hmm.</think>" + good)


def test_tool_grammars_after_reasoning_still_name_the_tool_at_fault():
    class Req:
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        tool_choice, parallel_tool_calls = "required", None

    _, spec, _ = tool_grammar(Req, None)
    assert tool_parameters(after_reasoning(spec, Phase.BEFORE, "tools")) == tool_parameters(spec)
    with pytest.raises(RequestError) as e:
        after_reasoning(StructuredOutput(kind="structural_tag", spec="{}"), Phase.BEFORE, "structured_outputs")
    assert e.value.param == "structured_outputs"


@pytest.fixture(scope="module")
def ctx(tiny_model_dir) -> ServingContext:
    tok = Tokenizer.from_model_dir(tiny_model_dir, QWEN3_TEMPLATE)
    return ServingContext(tok, ["tiny"], 512, tok.vocab_size, bos_token_id=1, reasoning_parser="qwen3")


def chat(ctx, **body):
    return parse_chat(json.dumps({"messages": CHAT, **body}).encode(), ctx)


def test_chat_template_kwargs_reach_every_render_of_the_chat(ctx):
    """The prompt, /tokenize's tokens of it and the CFG companion's (a negative prompt in the same conversation)."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    for kwargs, end in [({}, "<|im_start|>assistant\n"), (off, "assistant\n<think>\n\n</think>\n\n")]:
        parsed = chat(ctx, guidance_scale=2.0, negative_prompt="Say nothing.", **kwargs)
        ids, decode = parsed.prompts[0].token_ids, ctx.tokenizer.decode
        assert decode(ids).endswith(end) and decode(parsed.prompts[0].params.negative_prompt_token_ids).endswith(end)
        assert tokenize(json.dumps({"messages": CHAT, **kwargs}).encode(), ctx)["tokens"] == ids
        assert parsed.reasoning == Reasoning(Phase.BEFORE)


@pytest.mark.parametrize(
    "kwargs",
    [{"messages": []}, {"tools": []}, {"add_generation_prompt": False}, {"bos_token": "x"}, {"raise_exception": 1}],
)
def test_chat_template_kwargs_cannot_replace_the_template_s_own_variables(ctx, kwargs):
    with pytest.raises(RequestError) as e:
        chat(ctx, chat_template_kwargs=kwargs)
    assert (e.value.status, e.value.param) == (400, "chat_template_kwargs")
    assert repr(next(iter(kwargs))) in e.value.message


@pytest.mark.parametrize("kwargs", ["enable_thinking", [1], {"deep": json.loads("[" * 70 + "]" * 70)}])
def test_chat_template_kwargs_must_be_a_bounded_object(ctx, kwargs):
    with pytest.raises(RequestError) as e:
        chat(ctx, chat_template_kwargs=kwargs)
    assert (e.value.status, e.value.param) == (400, "chat_template_kwargs")


def test_a_grammar_is_wrapped_and_include_reasoning_kept_only_with_a_parser(ctx):
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    parsed = chat(ctx, response_format=schema, include_reasoning=False)
    assert parsed.reasoning == Reasoning(Phase.BEFORE, leading=True, include=False)
    structured = parsed.prompts[0].params.structured
    assert structured.kind == "structural_tag" and json.loads(structured.spec)["format"]["type"] == "sequence"
    plain = ServingContext(ctx.tokenizer, ["tiny"], 512, ctx.vocab_size, bos_token_id=1)
    parsed = chat(plain, response_format=schema, include_reasoning=False)
    assert parsed.reasoning is None and parsed.prompts[0].params.structured.kind == "json"

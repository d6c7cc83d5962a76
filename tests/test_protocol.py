"""frontend.protocol: OpenAI request bodies -> ParsedRequest, or a RequestError with the right
status, param and message for every validation rule."""

from __future__ import annotations

import json

import pytest

from frontend.context import ServingContext
from frontend.protocol import ParsedRequest, RequestError, parse_chat, parse_completion
from frontend.tokenizer import Tokenizer
from messages.sampling_params import RequestLimits, SamplingParams
from tests.test_tokenizer import write_tiny_model_dir

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def ctx(tmp_path_factory) -> ServingContext:
    tok = Tokenizer.from_model_dir(write_tiny_model_dir(tmp_path_factory.mktemp("tiny")))
    return ServingContext(
        tokenizer=tok,
        model_names=["tiny", "alias"],
        max_model_len=MAX_MODEL_LEN,
        vocab_size=tok.vocab_size,
        bos_token_id=1,
    )


def completion(ctx, **body) -> ParsedRequest:
    return parse_completion(json.dumps(body).encode(), ctx)


def chat(ctx, **body) -> ParsedRequest:
    return parse_chat(json.dumps(body).encode(), ctx)


USER_HI = [{"role": "user", "content": "hi"}]


def test_completion_full_request(ctx):
    req = completion(
        ctx,
        model="alias",
        prompt="hello world",
        max_tokens=8,
        temperature=0.5,
        top_p=0.9,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
        stop="fox",
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"5": 200, "7": -1.5},
        seed=42,
        logprobs=2,
        user="someone",
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.1,
        min_tokens=2,
        ignore_eos=True,
        stop_token_ids=[2],
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        bad_words=["lazy"],
        allowed_token_ids=[4, 5, 6],
        some_future_field={"ignored": True},
    )
    tok = ctx.tokenizer
    assert (req.kind, req.model, req.stream, req.include_usage, req.echo, req.n, req.logprobs) == (
        "completion",
        "alias",
        True,
        True,
        False,
        3,
        2,
    )
    assert req.request_id.startswith("cmpl-") and len(req.request_id) == 5 + 32
    [p] = req.prompts
    assert (p.text, p.token_ids) == ("hello world", tok.encode("hello world"))
    assert p.params == SamplingParams(
        n=3,
        temperature=0.5,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={5: 200.0, 7: -1.5},
        allowed_token_ids=[4, 5, 6],
        bad_words=["lazy"],
        bad_words_token_ids=tok.bad_words_token_ids(["lazy"]),
        min_tokens=2,
        seed=42,
        logprobs=2,
        max_tokens=8,
        stop=["fox"],
        stop_token_ids=[2],
        ignore_eos=True,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
    )


def test_completion_defaults_and_nulls(ctx):
    req = completion(ctx, prompt="hi")
    assert req.model == "tiny"  # no model: the first served name
    assert (req.stream, req.include_usage, req.logprobs) == (False, False, None)
    assert req.prompts[0].params == SamplingParams(max_tokens=16)  # OpenAI's completions default
    nulls = completion(ctx, prompt="hi", temperature=None, n=None, stop=None, logit_bias=None, seed=None)
    assert nulls.prompts[0].params == SamplingParams(max_tokens=16)


def test_completion_prompt_shapes_and_per_prompt_max_tokens(ctx):
    tok = ctx.tokenizer
    ids = tok.encode("the quick brown fox")
    req = completion(ctx, prompt=["hello", "the lazy dog"], max_tokens=None, echo=True, n=2)
    assert [(p.text, p.token_ids) for p in req.prompts] == [
        ("hello", tok.encode("hello")),
        ("the lazy dog", tok.encode("the lazy dog")),
    ]
    assert [p.params.max_tokens for p in req.prompts] == [MAX_MODEL_LEN - len(p.token_ids) for p in req.prompts]
    assert req.echo and req.n == 2
    assert [(p.text, p.token_ids) for p in completion(ctx, prompt=ids).prompts] == [(None, ids)]
    echoed = completion(ctx, prompt=[ids, [5]], echo=True)
    assert [(p.text, p.token_ids) for p in echoed.prompts] == [("the quick brown fox", ids), (tok.decode([5]), [5])]


def test_chat_request(ctx):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    req = chat(ctx, model="tiny", messages=messages, logprobs=True, top_logprobs=3, temperature=0, seed=1, stream=True)
    text = ctx.tokenizer.render_chat(messages)
    [p] = req.prompts
    assert (req.kind, req.echo, req.stream, req.include_usage, req.logprobs) == ("chat", False, True, False, 3)
    assert req.request_id.startswith("chatcmpl-")
    assert (p.text, p.token_ids) == (None, ctx.tokenizer.encode(text, add_special_tokens=False))  # (text: echoed)
    # chat's default max_tokens is whatever fits the context (vLLM)
    assert p.params == SamplingParams(temperature=0.0, seed=1, logprobs=3, max_tokens=MAX_MODEL_LEN - len(p.token_ids))


def test_chat_echo_continuation_and_truncation(ctx):
    """vLLM's chat extras: echo repeats the last message when it is the assistant's; continue_final_message leaves
    that message open (add_generation_prompt false by default then; both true is a 400); truncate_prompt_tokens
    keeps the prompt's last tokens, or its first with truncation_side right."""
    said = [*USER_HI, {"role": "assistant", "content": "Once upon"}]
    req = chat(ctx, messages=said, echo=True, continue_final_message=True)
    assert req.echo and req.prompts[0].text == "Once upon"
    assert ctx.tokenizer.decode(req.prompts[0].token_ids).endswith("<|im_start|>assistant\nOnce upon")
    assert not chat(ctx, messages=USER_HI, echo=True).echo
    opened = ctx.tokenizer.decode(chat(ctx, messages=USER_HI).prompts[0].token_ids)
    closed = ctx.tokenizer.decode(chat(ctx, messages=USER_HI, add_generation_prompt=False).prompts[0].token_ids)
    assert opened == closed + "<|im_start|>assistant\n"
    full = chat(ctx, messages=USER_HI).prompts[0].token_ids
    assert chat(ctx, messages=USER_HI, truncate_prompt_tokens=3).prompts[0].token_ids == full[-3:]
    right = chat(ctx, messages=USER_HI, truncate_prompt_tokens=3, truncation_side="right")
    assert right.prompts[0].token_ids == full[:3]
    for fields, param in [
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncation_side": "middle"}, "truncation_side"),
    ]:
        assert _error(parse_chat, ctx, json.dumps({"messages": USER_HI, **fields}).encode()).param == param


def test_chat_max_tokens_fields_and_logprobs_modes(ctx):
    assert chat(ctx, messages=USER_HI, max_tokens=5).prompts[0].params.max_tokens == 5
    assert chat(ctx, messages=USER_HI, max_tokens=5, max_completion_tokens=7).prompts[0].params.max_tokens == 7
    assert chat(ctx, messages=USER_HI, logprobs=True).logprobs == 0
    assert chat(ctx, messages=USER_HI, logprobs=False).logprobs is None


def test_max_tokens_beyond_the_context_is_clamped(ctx):
    """As vLLM: a max_tokens that does not fit beside the prompt is served up to the context's end."""
    [p] = completion(ctx, prompt=[5] * 10, max_tokens=10_000).prompts
    assert p.params.max_tokens == MAX_MODEL_LEN - 10
    [p] = chat(ctx, messages=USER_HI, max_completion_tokens=10_000).prompts
    assert p.params.max_tokens == MAX_MODEL_LEN - len(p.token_ids)
    assert completion(ctx, prompt=[5] * 10, max_tokens=3).prompts[0].params.max_tokens == 3


def test_unknown_model_is_404(ctx):
    for parse in (completion, chat):
        with pytest.raises(RequestError) as e:
            parse(ctx, model="gpt-4", prompt="hi", messages=USER_HI)
        assert (e.value.status, e.value.param, e.value.code) == (404, "model", "model_not_found")
        assert e.value.body() == {
            "error": {
                "message": "The model `gpt-4` does not exist.",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
        }


def _error(parse, ctx, body: bytes) -> RequestError:
    with pytest.raises(RequestError) as e:
        parse(body, ctx)
    assert e.value.status == 400
    assert e.value.body()["error"]["type"] == "invalid_request_error"
    return e.value


@pytest.mark.parametrize(
    ("body", "message"),
    [(b"{", "Invalid JSON"), (b"", "Invalid JSON"), (b"\xff", "Invalid JSON"), (b"[1]", "Expected `object`")],
)
def test_malformed_bodies(ctx, body, message):
    for parse in (parse_completion, parse_chat):
        err = _error(parse, ctx, body)
        assert err.param is None and message in err.message


def test_non_finite_numbers(ctx):
    assert _error(parse_completion, ctx, b'{"prompt": "hi", "temperature": NaN}').param is None  # not JSON
    err = _error(parse_completion, ctx, b'{"prompt": "hi", "temperature": 1e999}')
    assert (err.param, err.message) == ("temperature", "temperature must be a finite number, got inf")


COMPLETION_ERRORS = [
    # (body fields, param, message fragment)
    ({"prompt": "hi", "n": "x"}, "n", "Expected `int | null`, got `str`"),
    ({"prompt": "hi", "stream": 1}, "stream", "Expected `bool | null`"),
    ({"prompt": "hi", "stop": [1]}, "stop[0]", "Expected `str`"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature", "temperature must be in"),
    ({"prompt": "hi", "top_p": 0}, "top_p", "top_p must be in (0.0, 1.0]"),
    ({"prompt": "hi", "top_k": -2}, "top_k", "top_k"),
    ({"prompt": "hi", "n": 129}, "n", "n must be in [1, 128]"),
    ({"prompt": "hi", "n": 0}, "n", "n must be in"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs", "logprobs must be in [0, 20]"),
    ({"prompt": "hi", "logprobs": True}, "logprobs", "Expected `int | null`, got `bool`"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens must be in"),
    ({"prompt": "hi", "min_tokens": 9, "max_tokens": 8}, "min_tokens", "min_tokens (9) must be <= max_tokens (8)"),
    ({"prompt": "hi", "seed": 2**64}, "seed", "seed must be in"),
    ({"prompt": "hi", "stop": ["ok", ""]}, "stop", "non-empty"),
    ({"prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias", "token id 99999 is outside the vocabulary"),
    ({"prompt": "hi", "logit_bias": {"x": 1, "5": 1}}, "logit_bias", "logit_bias: 'x' is not a token id"),
    ({"prompt": "hi", "logit_bias": {"5": "high"}}, "logit_bias", "Expected `float`, got `str`"),
    ({"prompt": "hi", "stop_token_ids": [3, 99999]}, "stop_token_ids", "token id 99999"),
    ({"prompt": "hi", "allowed_token_ids": [-1]}, "allowed_token_ids", "token id -1"),
    ({"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids", "must not be empty"),
    ({"prompt": "hi", "bad_words": [" "]}, "bad_words", "must not be empty"),
    ({"prompt": "hi", "suffix": "!"}, "suffix", "suffix is not supported"),
    ({"prompt": "hi", "best_of": 2}, "best_of", "best_of 2 applies to beam search: set use_beam_search"),
    ({"prompt": "hi", "echo": True, "logprobs": 1, "stream": True}, "echo", "not available when stream is true"),
    ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not available when stream is true"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
    ({}, "prompt", "prompt must not be empty"),
    ({"prompt": ""}, "prompt", "prompt must not be empty"),
    ({"prompt": []}, "prompt", "prompt must not be empty"),
    ({"prompt": ["a", ""]}, "prompt", "prompt[1] must not be empty"),
    ({"prompt": [[5], []]}, "prompt", "prompt[1] must not be empty"),
    ({"prompt": 5}, "prompt", "Expected `str | array | null`, got `int`"),
    ({"prompt": [5, "a"]}, "prompt", "prompt must be a string, a list of strings"),
    ({"prompt": [True]}, "prompt", "prompt must be a string"),
    ({"prompt": [1.0]}, "prompt", "prompt must be a string"),
    ({"prompt": [5, 99999]}, "prompt", "token id 99999 is outside the vocabulary"),
    ({"prompt": [[5], [-3]]}, "prompt", "token id -3 is outside the vocabulary"),
    ({"prompt": [5] * 64, "max_tokens": None}, "prompt", "maximum context length is 64 tokens"),
    ({"prompt": [5] * 64, "max_tokens": 1}, "prompt", "the prompt has 64 tokens, which leaves no room"),
    ({"prompt": [5] * 60, "max_tokens": 10, "min_tokens": 5}, "min_tokens", "min_tokens (5) exceeds the 4 tokens"),
    (
        {"prompt": [5] * 63, "max_tokens": None, "min_tokens": 2},
        "min_tokens",
        "min_tokens (2) exceeds the 1 tokens left",
    ),
]


@pytest.mark.parametrize(("fields", "param", "message"), COMPLETION_ERRORS)
def test_completion_errors(ctx, fields, param, message):
    err = _error(parse_completion, ctx, json.dumps(fields).encode())
    assert err.param == param
    assert message in err.message


CHAT_ERRORS = [
    ({}, "messages", "messages is required"),
    ({"messages": []}, "messages", "messages must be a non-empty list"),
    ({"messages": "hi"}, "messages", "Expected `array | null`, got `str`"),
    ({"messages": [{"role": "", "content": "x"}]}, "messages[0].role", "must be a non-empty string"),
    ({"messages": [*USER_HI, {"role": "user", "content": None}]}, "messages[1].content", "a string or a list"),
    ({"messages": USER_HI, "logprobs": 1}, "logprobs", "Expected `bool | null`, got `int`"),
    ({"messages": USER_HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs must be in [0, 20]"),
    ({"messages": USER_HI, "top_logprobs": 2}, "top_logprobs", "top_logprobs requires logprobs"),
    ({"messages": USER_HI, "max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must be in"),
    ({"messages": [{"role": "user", "content": "fox " * 64}]}, "messages", "maximum context length is 64 tokens"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "tool messages are not supported"),
    ({"messages": USER_HI, "n": 200}, "n", "n must be in [1, 128]"),
]


@pytest.mark.parametrize(("fields", "param", "message"), CHAT_ERRORS)
def test_chat_errors(ctx, fields, param, message):
    err = _error(parse_chat, ctx, json.dumps(fields).encode())
    assert err.param == param
    assert message in err.message


def test_limits_come_from_the_context(ctx):
    limits = RequestLimits(max_n=4, max_logprobs=1)
    small = ServingContext(ctx.tokenizer, ["tiny"], MAX_MODEL_LEN, vocab_size=10, limits=limits)
    assert _error(parse_completion, small, b'{"prompt": [10]}').param == "prompt"
    assert _error(parse_completion, small, b'{"prompt": [9], "n": 5}').param == "n"
    assert _error(parse_completion, small, b'{"prompt": [9], "logprobs": 2}').param == "logprobs"
    assert completion(small, prompt=[9], n=4, logprobs=1).n == 4

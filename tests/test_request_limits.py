"""Bounded work before anything expensive (issue 11), unit level: strict JSON bodies, per-request size
limits, the length pre-check that refuses a prompt before tokenizing it, fields refused rather than
ignored, and tokenizing without the GIL."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest

from frontend.body import decode_body
from frontend.context import ServingContext
from frontend.fields import CompletionRequest
from frontend.protocol import RequestError, parse_chat, parse_completion
from frontend.tokenizer import Tokenizer
from messages.sampling_params import RequestLimits
from tests.test_tokenizer import write_tiny_model_dir

LIMITS = RequestLimits(
    max_stop=2, max_stop_chars=5, max_bad_words=2, max_bad_word_chars=4, max_logit_bias=2, max_allowed_token_ids=3,
    max_stop_token_ids=2, max_choices=4, max_total_tokens=80,
)  # fmt: skip


@pytest.fixture(scope="module")
def ctx(tmp_path_factory) -> ServingContext:
    tok = Tokenizer.from_model_dir(write_tiny_model_dir(tmp_path_factory.mktemp("tiny")))
    return ServingContext(tok, ["tiny"], max_model_len=64, vocab_size=tok.vocab_size, limits=LIMITS, bos_token_id=1)


def _error(parse, ctx, body: bytes) -> RequestError:
    with pytest.raises(RequestError) as e:
        parse(body, ctx)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"prompt": "caf\xc3\x28"}', "not UTF-8"),
        (b'{"prompt": "a\\ud800b"}', "lone UTF-16 surrogate"),
        (b'{"prompt": "a\\udc00"}', "lone UTF-16 surrogate"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
        (b'{"prompt": "hi", "n": 1, "n": 2}', "duplicate key 'n'"),
        (b'{"prompt": "hi", "logit_bias": {"5": 1, "5": 2}}', "duplicate key '5'"),
        (b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", "Invalid JSON body"),
        (b'{"prompt": "hi", "temperature": -Infinity}', "not a JSON number"),
        (b'\xef\xbb\xbf{"prompt": "hi"}', "Invalid JSON body"),
    ],
)
def test_malformed_json_is_400_without_a_field(ctx, body, message):
    err = _error(parse_completion, ctx, body)
    assert err.param is None and message in err.message


def test_a_surrogate_pair_is_one_character(ctx):
    assert parse_completion(b'{"prompt": "\\ud83e\\udd17", "max_tokens": 1}', ctx).prompts[0].text == "🤗"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stop": ["a", "b", "c"]}, "stop"),
        ({"stop": "abcdef"}, "stop"),
        ({"bad_words": ["a", "b", "c"]}, "bad_words"),
        ({"bad_words": ["abcde"]}, "bad_words"),
        ({"logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias"),
        ({"allowed_token_ids": [1, 2, 3, 4]}, "allowed_token_ids"),
        ({"prompt": ["a", "b", "c", "d", "e"]}, "prompt"),
        ({"prompt": ["a", "b", "c"], "n": 2}, "n"),  # 6 choices > 4
        ({"n": 3, "max_tokens": 26}, "max_tokens"),  # 3 x (1 + 26) = 81 > max_total_tokens
        ({"stop_token_ids": [1, 2, 3]}, "stop_token_ids"),
    ],
)
def test_sizes_over_a_limit_are_400_naming_the_field(ctx, fields, param):
    err = _error(parse_completion, ctx, json.dumps({"prompt": "hi", **fields}).encode())
    assert err.param == param and "allowed" in err.message


def test_sizes_at_the_limits_are_accepted(ctx):
    body = {"prompt": ["a", "b"], "stop": ["abcde", "x"], "bad_words": ["abcd", "y"], "max_tokens": 19}
    body |= {"logit_bias": {"1": 1, "2": 1}, "allowed_token_ids": [1, 2, 3], "n": 2, "stop_token_ids": [4, 5]}
    assert len(parse_completion(json.dumps(body).encode(), ctx).prompts) == 2


def test_a_defaulted_max_tokens_counts_against_the_total(ctx):
    err = _error(parse_chat, ctx, json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 2}).encode())
    assert err.param == "n" and "may cost" in err.message


def test_a_prompt_that_cannot_fit_is_refused_from_its_length(ctx, monkeypatch):
    tokenized = []
    monkeypatch.setattr(ctx.tokenizer, "encode_batch", lambda texts, *a: tokenized.append(texts) or [[1]] * len(texts))
    long = "x" * (64 * ctx.tokenizer.max_token_chars)
    err = _error(parse_completion, ctx, json.dumps({"prompt": long}).encode())
    assert (
        err.param == "prompt"
        and f"the prompt has at least 64 tokens of {len(long)} characters, which leaves no room" in err.message
    )
    messages = [{"role": "user", "content": [{"type": "text", "text": long}]}]
    assert _error(parse_chat, ctx, json.dumps({"messages": messages}).encode()).param == "messages"
    assert _error(
        parse_chat, ctx, json.dumps({"messages": [{"role": "user", "content": "x"}] * 65}).encode()
    ).param == ("messages")
    assert tokenized == []  # refused before tokenizing


@pytest.mark.parametrize(
    ("parse", "fields", "param"),
    [
        (parse_chat, {"functions": [{"name": "f"}]}, "functions"),  # OpenAI's deprecated spelling of tools
        (parse_chat, {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        (parse_chat, {"chat_template": "{{ x }}"}, "chat_template"),
        (parse_completion, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),  # chat only
        (parse_completion, {"add_special_tokens": False}, "add_special_tokens"),
        (parse_chat, {"logprobs_mode": "raw_logprobs"}, "logprobs_mode"),  # server-wide: --logprobs-mode
        (parse_completion, {"request_id": "mine"}, "request_id"),  # vLLM's extras Sluice lacks
        (parse_chat, {"kv_transfer_params": {"remote": 1}}, "kv_transfer_params"),
    ],
)
def test_fields_not_honoured_are_refused(ctx, parse, fields, param):
    base = {"prompt": "hi"} if parse is parse_completion else {"messages": [{"role": "user", "content": "hi"}]}
    err = _error(parse, ctx, json.dumps({**base, "max_tokens": 1, **fields}).encode())
    assert err.param == param and err.message.startswith(f"{param} is not supported")


def test_their_no_op_values_are_accepted(ctx):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "tools": [], "tool_choice": "none"}
    body |= {"response_format": {"type": "text"}, "add_generation_prompt": True, "user": "u", "metadata": {"k": 1}}
    body |= {"store": False, "parallel_tool_calls": True, "service_tier": "auto", "stream_interval": 1}
    assert parse_chat(json.dumps(body).encode(), ctx).prompts


def test_decode_body_converts_string_keys_and_names_the_field():
    assert decode_body(b'{"logit_bias": {"12": 1}}', CompletionRequest).logit_bias == {12: 1.0}
    with pytest.raises(RequestError) as e:
        decode_body(b'{"logit_bias": {"x": 1}}', CompletionRequest)
    assert e.value.param == "logit_bias"


def test_tokenizing_releases_the_gil(ctx):
    """A thread tokenizing a long text leaves the interpreter to others (the event loop's heartbeat)."""
    text = "hello world " * 200_000
    ticks, done = [], threading.Event()

    def tick():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    start = time.perf_counter()
    try:
        ctx.tokenizer.encode(text)
        took = time.perf_counter() - start
    finally:
        done.set()
        ticker.join()
    during = [t for t in ticks if start <= t <= start + took]
    # a tokenizer holding the GIL lets the ticker run once at most (measured: 0 vs ~1 per ms)
    assert len(during) >= max(3, took / 0.001 / 10), (took, len(during))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]},
            "messages[0].tool_calls[0]",
        ),
        ({"best_of": 2}, "best_of"),
        ({"top_k": 10**23}, "top_k"),  # would not fit the wire's int64
        ({"stream_interval": 0}, "stream_interval"),
    ],
)
def test_more_fields_that_would_be_ignored_or_break_the_wire_are_refused(ctx, fields, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **fields}
    assert _error(parse_chat, ctx, json.dumps(body).encode()).param == param


@pytest.mark.parametrize(
    ("parse", "fields", "param"),
    [
        (parse_completion, {"guidance_scale": 0}, "guidance_scale"),
        (parse_chat, {"guidance_scale": 20.5}, "guidance_scale"),
        (parse_chat, {"guidance_scale": 1, "negative_prompt": [1, 2]}, "negative_prompt"),  # checked when off too
        (parse_completion, {"negative_prompt": "x" * 10**6}, "negative_prompt"),
        (parse_chat, {"guidance_scale": 2, "negative_prompt": [1, 2]}, "negative_prompt"),  # chat: a string
        (parse_completion, {"guidance_scale": 2, "negative_prompt": [1, True]}, "negative_prompt"),
        (parse_completion, {"guidance_scale": 2, "negative_prompt": [10**9]}, "negative_prompt"),
        (parse_completion, {"guidance_scale": 2, "negative_prompt": ""}, "negative_prompt"),
        (parse_completion, {"guidance_scale": 2, "negative_prompt": "x" * 10**6}, "negative_prompt"),
    ],
)
def test_bad_guidance_fields_are_refused(ctx, parse, fields, param):
    base = {"prompt": "hi"} if parse is parse_completion else {"messages": [{"role": "user", "content": "hi"}]}
    assert _error(parse, ctx, json.dumps({**base, "max_tokens": 1, **fields}).encode()).param == param


def test_negative_prompts_become_the_companions_prompt(ctx):
    body = {"prompt": "hi", "max_tokens": 1, "guidance_scale": 2.5, "negative_prompt": "bad text"}
    params = parse_completion(json.dumps(body).encode(), ctx).prompts[0].params
    assert (params.guidance_scale, params.negative_prompt_token_ids) == (2.5, ctx.tokenizer.encode("bad text"))
    body["negative_prompt"] = [5, 6]
    assert parse_completion(json.dumps(body).encode(), ctx).prompts[0].params.negative_prompt_token_ids == [5, 6]
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "praise cats"}]
    body = {"messages": chat, "max_tokens": 1, "guidance_scale": 3, "negative_prompt": "praise dogs"}
    params = parse_chat(json.dumps(body).encode(), ctx).prompts[0].params
    rendered = ctx.tokenizer.render_chat([chat[0], {"role": "user", "content": "praise dogs"}])
    assert params.negative_prompt_token_ids == ctx.tokenizer.encode(rendered, add_special_tokens=False)
    del body["negative_prompt"]  # the engine guides against BOS alone
    assert parse_chat(json.dumps(body).encode(), ctx).prompts[0].params.negative_prompt_token_ids is None


@pytest.mark.parametrize(
    ("parse", "negative"), [(parse_completion, "praise dogs"), (parse_completion, [5, 6]), (parse_chat, "praise dogs")]
)
def test_a_negative_prompt_at_scale_1_changes_nothing(ctx, parse, negative):
    """A client sweeping guidance_scale from 1 upward with one negative prompt: at 1 (off) the request is the
    unguided one (no companion, so the output is the unguided output)."""
    base = {"prompt": "hi"} if parse is parse_completion else {"messages": [{"role": "user", "content": "praise"}]}
    plain = parse(json.dumps({**base, "max_tokens": 3}).encode(), ctx).prompts
    for scale in ({}, {"guidance_scale": 1}):
        body = {**base, "max_tokens": 3, "negative_prompt": negative, **scale}
        assert parse(json.dumps(body).encode(), ctx).prompts == plain


def test_without_bos_chat_guides_against_an_empty_user_turn(ctx):
    ctx = dataclasses.replace(ctx, bos_token_id=None)  # (the model config's BOS, as the engine reads it)
    chat = [{"role": "user", "content": "praise cats"}]
    body = {"messages": chat, "max_tokens": 1, "guidance_scale": 3}
    rendered = ctx.tokenizer.render_chat([{"role": "user", "content": ""}])
    ids = parse_chat(json.dumps(body).encode(), ctx).prompts[0].params.negative_prompt_token_ids
    assert ids == ctx.tokenizer.encode(rendered, add_special_tokens=False)
    body = {"prompt": "hi", "max_tokens": 1, "guidance_scale": 3}
    assert _error(parse_completion, ctx, json.dumps(body).encode()).param == "negative_prompt"

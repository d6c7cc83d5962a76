"""frontend.openai_format: the builders produce exactly the OpenAI shapes (checked against the
`openai` package's pydantic models), JSON-safe logprobs, and SSE framing."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from frontend import openai_format as fmt
from frontend.tokenizer import Tokenizer
from messages.wire import TokenLogprobs
from tests.test_tokenizer import write_tiny_model_dir

RID, MODEL, CREATED = "cmpl-abc", "tiny", 1_700_000_000


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_model_dir(write_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def _logprobs(token_ids: list[int], top_n: int) -> TokenLogprobs:
    """Sampled logprobs (one -inf) and a top-N whose first entry is the sampled token."""
    sampled = [-0.5 - i for i in range(len(token_ids))]
    sampled[-1] = float("-inf")
    top_ids = [[t, *range(10, 10 + top_n - 1)][:top_n] for t in token_ids]
    top_lps = [[s, *[s - 1.0 - j for j in range(top_n - 1)]][:top_n] for s in sampled]
    return TokenLogprobs(sampled=sampled, ranks=[1] * len(token_ids), top_ids=top_ids, top_logprobs=top_lps)


def test_sse_framing():
    assert fmt.sse({"a": [1, "é"]}) == b'data: {"a":[1,"\xc3\xa9"]}\n\n'
    assert fmt.SSE_DONE == b"data: [DONE]\n\n"


def test_error_body_and_usage():
    assert fmt.error_body("bad n", param="n") == {
        "error": {"message": "bad n", "type": "invalid_request_error", "param": "n", "code": None}
    }
    assert (fmt.error_type(400), fmt.error_type(404), fmt.error_type(503)) == (
        "invalid_request_error",
        "invalid_request_error",
        "server_error",
    )
    assert fmt.usage(7, 5, 3) == {
        "prompt_tokens": 7,
        "completion_tokens": 5,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 3},
    }


def test_completion_response_with_logprobs(tok):
    ids = tok.encode("hello 🤗")
    lp = fmt.completion_logprobs(ids, _logprobs(ids, top_n=2), tok, text_offset=3)
    strs = [tok.token_str(t) for t in ids]
    assert lp["tokens"] == strs
    assert lp["token_logprobs"][-1] == -9999.0  # -inf is not JSON
    assert lp["text_offset"] == [3 + sum(len(s) for s in strs[:i]) for i in range(len(ids))]
    assert lp["top_logprobs"][0] == {strs[0]: -0.5, tok.token_str(10): -1.5}
    choice = fmt.completion_choice(0, "hello 🤗", "stop", stop_reason=2, logprobs=lp)
    body = fmt.completion(RID, MODEL, CREATED, [choice], fmt.usage(3, len(ids)))
    parsed = Completion.model_validate(json.loads(fmt.sse(body)[6:]))
    assert parsed.choices[0].logprobs.tokens == strs
    assert parsed.choices[0].model_extra == {"stop_reason": 2}
    assert parsed.usage.total_tokens == 3 + len(ids)
    assert (parsed.object, parsed.id, parsed.model, parsed.created) == ("text_completion", RID, MODEL, CREATED)


def test_completion_logprobs_without_top(tok):
    ids = tok.encode("fox")
    lp = TokenLogprobs(sampled=[-0.25] * len(ids), ranks=[3] * len(ids))  # logprobs=0: sampled only
    out = fmt.completion_logprobs(ids, lp, tok)
    assert out["top_logprobs"] == [{tok.token_str(t): -0.25} for t in ids]


def test_completion_stream_chunks():
    chunk = fmt.completion(RID, MODEL, CREATED, [fmt.completion_choice(1, "lo")])
    assert chunk == {
        "id": RID,
        "object": "text_completion",
        "created": CREATED,
        "model": MODEL,
        "choices": [{"index": 1, "text": "lo", "logprobs": None, "finish_reason": None, "stop_reason": None}],
        "system_fingerprint": None,
    }
    usage_chunk = fmt.completion(RID, MODEL, CREATED, [], fmt.usage(2, 3))
    assert Completion.model_validate(usage_chunk).usage.completion_tokens == 3


def test_chat_response_with_logprobs(tok):
    ids = tok.encode("hi 🤗")
    lp = fmt.chat_logprobs(ids, _logprobs(ids, top_n=3), tok)
    choice = fmt.chat_choice(0, "hi 🤗", "length", logprobs=lp)
    body = fmt.chat_completion("chatcmpl-x", MODEL, CREATED, [choice], fmt.usage(4, len(ids)))
    parsed = ChatCompletion.model_validate(json.loads(fmt.sse(body)[6:]))
    assert parsed.object == "chat.completion"
    c = parsed.choices[0]
    assert (c.message.role, c.message.content, c.finish_reason) == ("assistant", "hi 🤗", "length")
    content = c.logprobs.content
    assert bytes(b for e in content for b in e.bytes).decode() == "hi 🤗"  # split emoji bytes rebuild
    assert [e.token for e in content] == [tok.token_str(t) for t in ids]
    assert content[-1].logprob == -9999.0
    assert [len(e.top_logprobs) for e in content] == [3] * len(ids)
    assert content[0].top_logprobs[1].token == tok.token_str(10)
    assert content[0].top_logprobs[0].bytes == list(tok.token_bytes(ids[0]))


def test_chat_stream_sequence(tok):
    ids = tok.encode("quick fox")
    chunks = [
        fmt.chat_chunk("chatcmpl-x", MODEL, CREATED, [fmt.chat_delta(0, role="assistant", content="")]),
        fmt.chat_chunk("chatcmpl-x", MODEL, CREATED, [fmt.chat_delta(0, content="quick")]),
        fmt.chat_chunk(
            "chatcmpl-x",
            MODEL,
            CREATED,
            [fmt.chat_delta(0, content=" fox", logprobs=fmt.chat_logprobs(ids, _logprobs(ids, 0), tok))],
        ),
        fmt.chat_chunk(
            "chatcmpl-x", MODEL, CREATED, [fmt.chat_delta(0, content="", finish_reason="stop", stop_reason="!")]
        ),
        fmt.chat_chunk("chatcmpl-x", MODEL, CREATED, [], usage=fmt.usage(5, 2)),
    ]
    parsed = [ChatCompletionChunk.model_validate(json.loads(fmt.sse(c)[6:])) for c in chunks]
    assert all(p.object == "chat.completion.chunk" and p.id == "chatcmpl-x" for p in parsed)
    assert parsed[0].choices[0].delta.role == "assistant"
    assert chunks[1]["choices"][0] == {
        "index": 0,
        "delta": {"content": "quick"},
        "logprobs": None,
        "finish_reason": None,
    }
    assert "".join(p.choices[0].delta.content for p in parsed[:4]) == "quick fox"
    assert [p.choices[0].finish_reason for p in parsed[:4]] == [None, None, None, "stop"]
    assert chunks[3]["choices"][0]["stop_reason"] == "!"
    assert parsed[2].choices[0].logprobs.content[0].top_logprobs == []
    assert all("usage" not in c for c in chunks[:4])
    assert (parsed[4].choices, parsed[4].usage.total_tokens) == ([], 7)


def test_join_logprobs():
    a = TokenLogprobs(sampled=[-1.0], ranks=[1], top_ids=[[4]], top_logprobs=[[-1.0]])
    b = TokenLogprobs(sampled=[-2.0, -3.0], ranks=[2, 1], top_ids=[[5], [6]], top_logprobs=[[-0.5], [-3.0]])
    assert TokenLogprobs.join([a, b]) == TokenLogprobs(
        [-1.0, -2.0, -3.0], [1, 2, 1], [[4], [5], [6]], [[-1.0], [-0.5], [-3.0]]
    )
    assert a.sampled == [-1.0]  # inputs untouched

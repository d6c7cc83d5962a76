"""OpenAI response shapes as plain dicts, and the SSE framing.

Completions use object "text_completion" for responses and stream chunks alike; chat uses
"chat.completion" / "chat.completion.chunk". A chat stream is: a role chunk
(`chat_delta(i, role="assistant", content="")`), content deltas, a chunk carrying `finish_reason`,
then (stream_options.include_usage) a usage chunk with `choices: []`, then `SSE_DONE`. With a reasoning parser
(frontend/reasoning.py) a message carries `reasoning` (null when none) and a delta its part of it, each under its older
name `reasoning_content` too, as vLLM gives both. Logprobs are
JSON-safe: -inf (and NaN) become -9999.0 as in vLLM. `finish_reason` is passed through as given.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from messages.wire import TokenLogprobs

SSE_DONE = b"data: [DONE]\n\n"
LOGPROB_FLOOR = -9999.0

_encode = msgspec.json.Encoder().encode


def sse(obj) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def error_type(status: int) -> str:
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = 0) -> dict:
    """`cached_tokens`: prompt tokens served from the prefix cache, as OpenAI's prompt_tokens_details (None: left
    out, as vLLM's per-chunk usage)."""
    body = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


# ---------------------------------------------------------------- logprobs


class TokenVocab(Protocol):
    """How logprobs show a token id (frontend.tokenizer.Tokenizer implements it)."""

    def token_str(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


class TokenIds:
    """vLLM's return_tokens_as_token_ids: logprobs name every token "token_id:N" (JSON-safe whatever its bytes);
    chat's `bytes` stay the token's own (vLLM gives those of "token_id:N" for the top alternatives: a quirk)."""

    def __init__(self, vocab: TokenVocab):
        self.token_bytes = vocab.token_bytes

    @staticmethod
    def token_str(token_id: int) -> str:
        return f"token_id:{token_id}"


def _lp(x: float) -> float:
    return x if x >= LOGPROB_FLOOR else LOGPROB_FLOOR  # also maps NaN


def completion_logprobs(token_ids: list[int], lp: TokenLogprobs, vocab: TokenVocab, text_offset: int = 0) -> dict:
    """Completions logprobs; `top_logprobs[i]` holds the sampled token and the top-N (vLLM).
    `text_offset` is where the first token's text starts in the choice's text."""
    tokens = [vocab.token_str(t) for t in token_ids]
    token_logprobs = [_lp(x) for x in lp.sampled]
    top_logprobs, offsets = [], []
    for i, tok in enumerate(tokens):
        top = {tok: token_logprobs[i]}
        if lp.top_ids:
            for t, x in zip(lp.top_ids[i], lp.top_logprobs[i], strict=True):
                top.setdefault(vocab.token_str(t), _lp(x))
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def echo_logprobs(
    prompt_ids: list[int], plp: TokenLogprobs, token_ids: list[int], lp: TokenLogprobs, vocab: TokenVocab
) -> dict:
    """Completions logprobs with echo: the prompt's tokens first (the first one has no logprob), then the output's."""
    first = vocab.token_str(prompt_ids[0])
    head = completion_logprobs(prompt_ids[1:], plp, vocab, len(first))
    end = head["text_offset"][-1] + len(head["tokens"][-1]) if head["tokens"] else len(first)
    tail = completion_logprobs(token_ids, lp, vocab, end)
    lead = {"tokens": first, "token_logprobs": None, "top_logprobs": None, "text_offset": 0}
    return {key: [lead[key], *head[key], *tail[key]] for key in lead}


def prompt_logprobs(prompt_ids: list[int], lp: TokenLogprobs, vocab: TokenVocab) -> list[dict | None]:
    """vLLM's prompt_logprobs: None for the first prompt token, then for each next one {token id: {logprob, rank,
    decoded_token}} holding that token and the top-N of the position."""
    out: list[dict | None] = [None]
    for i, token in enumerate(prompt_ids[1:]):
        entry = {token: (lp.sampled[i], lp.ranks[i])}
        for rank, (t, x) in enumerate(zip(lp.top_ids[i], lp.top_logprobs[i], strict=True), 1):
            entry.setdefault(t, (x, rank))
        out.append(
            {str(t): {"logprob": _lp(x), "rank": r, "decoded_token": vocab.token_str(t)} for t, (x, r) in entry.items()}
        )
    return out


def _chat_entry(vocab: TokenVocab, token_id: int, logprob: float) -> dict:
    return {"token": vocab.token_str(token_id), "logprob": _lp(logprob), "bytes": list(vocab.token_bytes(token_id))}


def chat_logprobs(token_ids: list[int], lp: TokenLogprobs, vocab: TokenVocab) -> dict:
    content = []
    for i, t in enumerate(token_ids):
        entry = _chat_entry(vocab, t, lp.sampled[i])
        tops = zip(lp.top_ids[i], lp.top_logprobs[i], strict=True) if lp.top_ids else ()
        entry["top_logprobs"] = [_chat_entry(vocab, tt, x) for tt, x in tops]
        content.append(entry)
    return {"content": content}


# ---------------------------------------------------------------- completions


def completion_choice(
    index: int,
    text: str,
    finish_reason: str | None = None,
    stop_reason: int | str | None = None,
    logprobs: dict | None = None,
) -> dict:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def completion(request_id: str, model: str, created: int, choices: list[dict], usage: dict | None = None) -> dict:
    """A /v1/completions response (with usage) or stream chunk (usage only on the usage chunk)."""
    body = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": choices}
    body["system_fingerprint"] = None  # OpenAI's field; no fingerprint is published (as vLLM)
    if usage is not None:
        body["usage"] = usage
    return body


# ---------------------------------------------------------------- chat


def chat_choice(
    index: int,
    content: str | None,
    finish_reason: str,
    stop_reason: int | str | None = None,
    logprobs: dict | None = None,
    tool_calls: list[dict] | None = None,
    reasoning: str | msgspec.UnsetType | None = msgspec.UNSET,
) -> dict:
    """`reasoning`: unset without a reasoning parser (the message has no such field)."""
    message = {"role": "assistant", "content": content}
    if reasoning is not msgspec.UNSET:
        message |= _reasoning(reasoning)
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def chat_completion(request_id: str, model: str, created: int, choices: list[dict], usage: dict) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
        "system_fingerprint": None,
    }


def chat_delta(
    index: int,
    content: str | None = None,
    role: str | None = None,
    finish_reason: str | None = None,
    stop_reason: int | str | None = None,
    logprobs: dict | None = None,
    tool_calls: list[dict] | None = None,
    reasoning: str | None = None,
) -> dict:
    delta = {"role": role} if role is not None else {}
    if reasoning is not None:
        delta |= _reasoning(reasoning)
    if content is not None:
        delta["content"] = content
    if tool_calls:
        delta["tool_calls"] = tool_calls
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return choice


def _reasoning(text: str | None) -> dict:
    return {"reasoning": text, "reasoning_content": text}


def chat_chunk(request_id: str, model: str, created: int, choices: list[dict], usage: dict | None = None) -> dict:
    body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    body["system_fingerprint"] = None
    if usage is not None:
        body["usage"] = usage
    return body

"""An HttpRequest's state as OpenAI bodies: the SSE events of a stream, or the final JSON response.

A stream is: (chat) one role chunk per choice; then, each time the writer wakes, one event per
choice with everything buffered for it (text, logprobs, and its finish_reason once finished); then
an error event if the request failed, else the usage chunk (stream_options.include_usage); then
`data: [DONE]`. A chat's text is split into reasoning and content first (frontend/reasoning.py), then its
content into content and tool calls (frontend/tool_parser.py).
"""

from __future__ import annotations

import msgspec

from frontend import openai_format as fmt
from frontend.openai_format import SSE_DONE, TokenVocab, sse
from frontend.protocol import ParsedRequest, PromptInput
from frontend.request_state import Choice, HttpRequest
from frontend.tool_parser import ToolCallDelta, parse_tool_calls
from messages.wire import TokenLogprobs


def stream_head(req: HttpRequest) -> bytes:
    """Chat: a role chunk per choice, the first with the prompt's token ids when asked for (return_token_ids)."""
    p = req.parsed
    if p.kind != "chat":
        return b""
    chunks = []
    for c in req.choices:
        delta = fmt.chat_delta(c.index, role="assistant", content="")
        chunks.append(fmt.chat_chunk(p.request_id, p.model, p.created, [delta], _so_far(req, c)))
    if p.return_token_ids:
        chunks[0]["prompt_token_ids"] = p.prompts[0].token_ids
    return b"".join(map(sse, chunks))


def stream_events(req: HttpRequest, vocab: TokenVocab) -> bytes:
    """Drain every choice's buffer into at most one event per choice."""
    return b"".join(event for c in req.choices if (event := _event(req, c, vocab)))


def stream_tail(req: HttpRequest) -> bytes:
    p = req.parsed
    if req.error is not None:
        return sse(req.error.body()) + SSE_DONE
    if not p.include_usage:
        return SSE_DONE
    chunk = fmt.chat_chunk if p.kind == "chat" else fmt.completion
    return sse(chunk(p.request_id, p.model, p.created, [], _usage(req))) + SSE_DONE


def _event(req: HttpRequest, c: Choice, vocab: TokenVocab) -> bytes:
    p = req.parsed
    vocab = fmt.TokenIds(vocab) if p.tokens_as_ids else vocab
    fin = c.finished if c.finished is not None and c.finished.finish_reason != "error" else None
    ending = fin is not None and not c.final_sent
    if not (c.text or ((p.logprobs is not None or p.return_token_ids) and c.token_ids) or ending):
        return b""
    text, ids, lps = c.take()
    reason, stop_reason = (fin.finish_reason, fin.stop_reason) if ending else (None, None)
    c.final_sent |= ending
    if p.kind == "chat":
        logprobs = fmt.chat_logprobs(ids, TokenLogprobs.join(lps), vocab) if p.logprobs is not None and ids else None
        calls, reasoning = None, ""
        if c.reasoning is not None:  # text -> reasoning and content
            reasoning, text = c.reasoning.feed(text)
            if ending:
                more, rest = c.reasoning.finish()
                reasoning, text = reasoning + more, text + rest
            reasoning = reasoning if p.reasoning.include else ""
        if c.tools is not None:  # content -> content and tool-call deltas
            text, deltas = c.tools.feed(text)
            if ending:
                rest, more = c.tools.finish()
                text, deltas = text + rest, deltas + more
                reason = "tool_calls" if c.tools.calls and reason == "stop" else reason
            calls = [_delta(d) for d in deltas]
        if not (text or reasoning or calls or logprobs or ending or (p.return_token_ids and ids)):
            return b""  # (what the parsers hold back)
        content = text or ("" if ending and not calls else None)  # (vLLM: the finish chunk's content is "")
        delta = fmt.chat_delta(
            c.index, content, finish_reason=reason, stop_reason=stop_reason, logprobs=logprobs, tool_calls=calls,
            reasoning=reasoning or None,
        )  # fmt: skip
        delta |= {"token_ids": ids} if p.return_token_ids else {}
        return sse(fmt.chat_chunk(p.request_id, p.model, p.created, [delta], _so_far(req, c)))
    logprobs = None
    if p.logprobs is not None and ids:
        logprobs = fmt.completion_logprobs(ids, TokenLogprobs.join(lps), vocab, c.text_offset)
        c.text_offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
    choice = fmt.completion_choice(c.index, text, reason, stop_reason, logprobs)
    if p.return_token_ids:  # (vLLM: the prompt's on the choice's first chunk)
        choice |= {"token_ids": ids} if c.started else {"prompt_token_ids": _prompt(p, c).token_ids, "token_ids": ids}
    c.started = True
    return sse(fmt.completion(p.request_id, p.model, p.created, [choice], _so_far(req, c)))


def response_body(req: HttpRequest, vocab: TokenVocab) -> dict:
    """The non-streaming response of a request whose choices all finished without error."""
    p = req.parsed
    vocab = fmt.TokenIds(vocab) if p.tokens_as_ids else vocab
    choices, extra = [], {"prompt_logprobs": None}  # (present, null, when not asked for: as vLLM)
    for c in req.choices:
        text, ids, lps = c.take()
        fin = c.finished
        if p.kind == "chat":
            logprobs = _logprobs(fmt.chat_logprobs, ids, lps, vocab) if p.logprobs is not None else None
            content, calls, reason, reasoning = text, None, fin.finish_reason, msgspec.UNSET
            if p.reasoning is not None:
                reasoning, content = p.reasoning.split(text)
            if p.tool_calls:
                content, calls = parse_tool_calls(content)
                reason = "tool_calls" if calls and reason == "stop" else reason
            if p.reasoning is not None:  # (vLLM: no content after the reasoning is null)
                content = None if reasoning and not content else content
                reasoning = (reasoning or None) if p.reasoning.include else None
            choices.append(fmt.chat_choice(c.index, content, reason, fin.stop_reason, logprobs, calls, reasoning))
        elif p.echo and p.logprobs is not None:
            prompt = _prompt(p, c).token_ids
            logprobs = fmt.echo_logprobs(prompt, fin.prompt_logprobs, ids, TokenLogprobs.join(lps), vocab)
            choices.append(fmt.completion_choice(c.index, text, fin.finish_reason, fin.stop_reason, logprobs))
        else:
            logprobs = _logprobs(fmt.completion_logprobs, ids, lps, vocab) if p.logprobs is not None else None
            choices.append(fmt.completion_choice(c.index, text, fin.finish_reason, fin.stop_reason, logprobs))
        # vLLM: per choice for completions, once per response for chat
        holder = choices[-1] if p.kind == "completion" else extra
        if fin.prompt_logprobs is not None and holder.get("prompt_logprobs") is None:
            holder["prompt_logprobs"] = fmt.prompt_logprobs(_prompt(p, c).token_ids, fin.prompt_logprobs, vocab)
        holder.setdefault("prompt_logprobs", None)
        if p.return_token_ids:
            holder["prompt_token_ids"] = _prompt(p, c).token_ids
            choices[-1]["token_ids"] = ids
    build = fmt.chat_completion if p.kind == "chat" else fmt.completion
    return build(p.request_id, p.model, p.created, choices, _usage(req)) | (extra if p.kind == "chat" else {})


def _prompt(p: ParsedRequest, c: Choice) -> PromptInput:
    return p.prompts[c.index // p.n]


def _delta(d: ToolCallDelta) -> dict:
    """A streamed tool-call delta as OpenAI sends it: id, type and name on a call's first delta only."""
    first = d.id is not None
    function = {"name": d.name, "arguments": d.arguments} if first else {"arguments": d.arguments}
    return {"index": d.index, **({"id": d.id, "type": "function"} if first else {}), "function": function}


def _logprobs(build, ids: list[int], lps: list[TokenLogprobs], vocab: TokenVocab) -> dict:
    return build(ids, TokenLogprobs.join(lps), vocab)


def _so_far(req: HttpRequest, c: Choice) -> dict | None:
    """stream_options.continuous_usage_stats (with include_usage): on each chunk of a choice, the usage so far of
    that choice, as vLLM: its prompt's tokens and its own output tokens, without prompt_tokens_details (the
    cached count arrives with the finish; vLLM reports it on the final usage only). None: not asked for."""
    if not req.parsed.continuous_usage:
        return None
    return fmt.usage(len(_prompt(req.parsed, c).token_ids), c.num_output_tokens, cached_tokens=None)


def _usage(req: HttpRequest) -> dict:
    return fmt.usage(req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens)

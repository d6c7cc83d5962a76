"""OpenAI request parsing: JSON body -> validated, tokenized `ParsedRequest`, or a `RequestError`.

Pure functions (no event loop, no actors), so the HTTP actor can run them in an executor. The
fields each endpoint reads, and those it refuses, are in `frontend.fields`; `suffix` and streamed
`echo` with `logprobs` are refused here. Work is bounded before anything expensive:
sizes against `RequestLimits` before iterating, a prompt's length in characters against the context
before tokenizing (`Tokenizer.max_token_chars`), and a call's choices and their tokens (prompt + max_tokens)
against `max_choices` and `max_total_tokens`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from frontend.body import RequestError, decode_body, json_field, token_ids
from frontend.budget import PromptInput, check_chars, check_total, fit, truncate, truncation
from frontend.context import ServingContext
from frontend.fields import (
    NOT_HONOURED_IN_CHAT,
    NOT_HONOURED_IN_COMPLETIONS,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    beam_search,
)
from frontend.guidance import negative_prompt_ids
from frontend.reasoning import Reasoning, after_reasoning, request_reasoning
from frontend.structured import structured_output
from frontend.tokenizer import chat_message
from frontend.tools import tool_grammar
from messages.sampling_params import ParamError, SamplingParams, StructuredOutput

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class ParsedRequest:
    kind: Literal["completion", "chat"]
    request_id: str  # cmpl-<hex> / chatcmpl-<hex>; engine ids are derived from it per choice
    model: str
    created: int
    prompts: list[PromptInput]  # choice index = prompt index * n + sample index
    stream: bool
    include_usage: bool
    echo: bool
    grammar_param: str | None = None  # the field the prompts' StructuredOutput came from (compiled before admission)
    tool_calls: bool = False  # chat with tools: the output is parsed into message.tool_calls
    continuous_usage: bool = False  # continuous_usage_stats with include_usage: usage so far on every chunk (vLLM)
    return_token_ids: bool = False  # vLLM: prompt_token_ids and token_ids in the response
    stream_interval: int | None = None  # vLLM's: tokens per stream event after the first (None: the server's)
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprob tokens read "token_id:N"
    reasoning: Reasoning | None = None  # chat with --reasoning-parser: how the output splits into reasoning, content
    fields: dict[str, str] = field(default_factory=dict)  # the engine's name of a field -> this request's (errors)

    @property
    def n(self) -> int:
        return self.prompts[0].params.n

    @property
    def logprobs(self) -> int | None:
        """Top-N logprobs per token (0 = only the sampled token's), None when not requested."""
        return self.prompts[0].params.logprobs


_SAMPLING_KEYS = set(SamplingFields.__struct_fields__) & set(SamplingParams.__struct_fields__) - {"max_tokens", "stop"}
_PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of lists of token ids"


def new_request_id(prefix: str) -> str:
    """cmpl-<hex> / chatcmpl-<hex>: named before parsing, so every log line about the call carries it."""
    return f"{prefix}-{uuid.uuid4().hex}"


def parse_completion(body: bytes, ctx: ServingContext, request_id: str | None = None) -> ParsedRequest:
    req = decode_body(body, CompletionRequest, NOT_HONOURED_IN_COMPLETIONS)
    model = _model(req, ctx)
    if req.suffix is not None:
        raise RequestError(400, "suffix is not supported", "suffix")
    if req.echo and req.logprobs is not None:
        if req.stream:
            raise RequestError(400, "echo with logprobs is not available when stream is true", "echo")
        req.prompt_logprobs = max(req.prompt_logprobs or 0, req.logprobs)  # the echoed prompt's logprobs
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is msgspec.UNSET else req.max_tokens
    structured, grammar_param = structured_output(req)
    fields = {"structured_outputs": grammar_param or "structured_outputs"}
    params = _sampling_params(req, ctx, max_tokens, req.logprobs, fields, structured)
    params.negative_prompt_token_ids = negative_prompt_ids(req, ctx)
    prompts, keep = [], truncation(req, ctx)
    for text, ids in _completion_prompts(req.prompt, ctx, keep is None):
        if len(cut := truncate(ids, keep, req.truncation_side)) < len(ids):
            ids, text = cut, None
        if text is None and req.echo:
            text = ctx.tokenizer.decode(ids)
        prompts.append(fit(text, ids, params, max_tokens, ctx, "prompt"))
    check_total(prompts, ctx, "max_tokens" if req.max_tokens else "n")
    rid = request_id or new_request_id("cmpl")
    extra = {"grammar_param": grammar_param, "fields": fields}
    return _parsed("completion", rid, model, prompts, req, echo=bool(req.echo), **extra)


def parse_chat(body: bytes, ctx: ServingContext, request_id: str | None = None) -> ParsedRequest:
    return chat_request(decode_body(body, ChatCompletionRequest, NOT_HONOURED_IN_CHAT), ctx, request_id)


def chat_request(req: ChatCompletionRequest, ctx: ServingContext, request_id: str | None = None) -> ParsedRequest:
    """A decoded chat request, validated and tokenized (the Responses API's requests come here as chat requests)."""
    model = _model(req, ctx)
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
    max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens
    if max_tokens is None and req.max_tokens is not msgspec.UNSET:
        max_tokens = req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    structured, grammar_param = structured_output(req)
    tools, tool_spec, tool_param = tool_grammar(req, ctx.tool_call_parser)
    tool_calls = tool_spec is not None
    if tool_calls:
        if structured is not None:
            raise RequestError(400, f"{grammar_param} cannot be combined with tool_choice {req.tool_choice!r}", "tools")
        structured, grammar_param = tool_spec, tool_param
    fields = {"logprobs": "top_logprobs", "max_tokens": max_param, "prompt": "messages",
              "structured_outputs": grammar_param or "structured_outputs"}  # fmt: skip
    params = _sampling_params(req, ctx, max_tokens, logprobs, fields, structured)
    if req.messages is None:
        raise RequestError(400, "messages is required", "messages")
    chat, text = rendered_chat(req, ctx, tools)
    if (keep := truncation(req, ctx)) is None:
        check_chars(len(text), ctx, "messages")  # everything the template rendered: contents, names, tools, ...
    ids = truncate(ctx.tokenizer.encode(text, add_special_tokens=False), keep, req.truncation_side)  # (the
    # template wrote any BOS itself)
    params.negative_prompt_token_ids = negative_prompt_ids(req, ctx, chat)
    reasoning = request_reasoning(ctx.reasoning_parser, text, req.include_reasoning, params.structured)
    if reasoning is not None and params.structured is not None:  # the grammar applies once the reasoning ends
        params.structured = after_reasoning(params.structured, reasoning.start, grammar_param)
    echo = _chat_echo(req, tool_calls)
    prompt = fit(echo, ids, params, max_tokens, ctx, "messages")  # (a chat prompt's text: what is echoed)
    check_total([prompt], ctx, max_param if max_tokens else "n")
    rid = request_id or new_request_id("chatcmpl")
    extra = {"grammar_param": grammar_param, "tool_calls": tool_calls, "fields": fields, "reasoning": reasoning}
    return _parsed("chat", rid, model, [prompt], req, echo=echo is not None, **extra)


def rendered_chat(req, ctx: ServingContext, tools: list[dict] | None) -> tuple[dict, str]:
    """A chat request's `Tokenizer.render_chat` arguments (its messages, tools, turn and chat_template_kwargs) and
    the text they render to; its messages and kwargs are first held to the body's JSON bounds (the template walks
    them)."""
    if len(req.messages) > ctx.max_model_len:  # every message renders to one token at least
        raise RequestError(
            400, f"messages: {len(req.messages)} messages cannot fit in {ctx.max_model_len} tokens", "messages"
        )
    kwargs = json_field(req.chat_template_kwargs, "chat_template_kwargs") if req.chat_template_kwargs else None
    chat = {
        "messages": json_field(req.messages, "messages"),
        "tools": tools,
        **chat_turn(req),
        "template_kwargs": kwargs,
    }
    try:
        return chat, ctx.tokenizer.render_chat(**chat)
    except ParamError as e:
        raise RequestError(400, str(e), e.param) from e


def chat_turn(req: ChatCompletionRequest) -> dict:
    """vLLM: add_generation_prompt (default true) opens the assistant's turn; continue_final_message (implies
    add_generation_prompt false) leaves the last message's turn open, to be continued."""
    if req.continue_final_message and req.add_generation_prompt:
        raise RequestError(
            400, "continue_final_message and add_generation_prompt cannot both be true", "continue_final_message"
        )
    opened = not req.continue_final_message if req.add_generation_prompt is None else req.add_generation_prompt
    return {"add_generation_prompt": opened, "continue_final": bool(req.continue_final_message)}


def _chat_echo(req: ChatCompletionRequest, tool_calls: bool) -> str | None:
    """vLLM's chat echo: the reply starts with the last message's content when that message is the assistant's."""
    if not req.echo:
        return None
    if tool_calls:
        raise RequestError(400, "echo cannot be combined with tools", "echo")
    last = req.messages[-1]
    return chat_message(len(req.messages) - 1, last)["content"] if last.get("role") == "assistant" else None


def _model(req: SamplingFields, ctx: ServingContext) -> str:
    if not req.model:  # absent or "": the served model (as vLLM)
        return ctx.model_names[0]
    if not ctx.knows(req.model):
        raise RequestError(404, f"The model `{req.model}` does not exist.", "model", code="model_not_found")
    return req.model


def _sampling_params(
    req,
    ctx: ServingContext,
    max_tokens: int | None,
    logprobs: int | None,
    names: dict[str, str],
    structured: StructuredOutput | None = None,
) -> SamplingParams:
    """`names`: SamplingParams' name of a field -> the request's, for the errors."""
    beam = beam_search(req)
    if req.stream_options is not None and not req.stream:
        raise RequestError(400, "stream_options is only allowed when stream is true", "stream_options")
    if req.prompt_logprobs is not None and req.stream:  # as vLLM
        raise RequestError(400, "prompt_logprobs is not available when stream is true", "prompt_logprobs")
    fields = {k: v for k in _SAMPLING_KEYS if (v := getattr(req, k)) is not None}
    stop = [req.stop] if isinstance(req.stop, str) else req.stop or []
    # a defaulted max_tokens is resolved per prompt in _fit; verify against the largest possible
    limit = ctx.max_model_len if max_tokens is None else max_tokens
    params = SamplingParams(**fields, stop=stop, logprobs=logprobs, max_tokens=limit, structured=structured, beam=beam)
    if req.model not in ctx.model_names and (lora := (ctx.loras or {}).get(req.model)) is not None:
        params.lora = lora.digest
    try:
        params.verify(ctx.vocab_size, ctx.limits)  # sizes first: nothing below iterates over an unbounded list
        if params.bad_words:
            params.bad_words_token_ids = ctx.tokenizer.bad_words_token_ids(params.bad_words)
            params.verify(ctx.vocab_size, ctx.limits)  # again, for the bad words' token ids
    except ParamError as e:
        param = names.get(e.param, e.param)
        raise RequestError(400, str(e).replace(e.param, param, 1), param) from e
    return params


def _completion_prompts(prompt, ctx: ServingContext, check: bool) -> list[tuple[str | None, list[int]]]:
    """The prompts' texts (None for token ids) and token ids; `check`: refuse a text too long for the context
    before tokenizing it (not when the prompt is to be truncated)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise RequestError(400, "prompt must not be empty", "prompt")
    if (ids := token_ids(prompt)) is not None:
        prompt = [ids]
    if len(prompt) > ctx.limits.max_choices:
        raise RequestError(
            400, f"prompt: {len(prompt)} prompts, more than the {ctx.limits.max_choices} allowed", "prompt"
        )
    out: list[tuple[str | None, list[int]]] = []
    texts = []  # (index in out, text): tokenized together, in parallel and without the GIL
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            if check:
                check_chars(len(p), ctx, "prompt")
            texts.append((i, p))
            ids, text = [], p
        elif (ids := token_ids(p)) is not None:
            text = None
            if ids and (min(ids) < 0 or max(ids) >= ctx.vocab_size):
                bad = next(t for t in ids if not 0 <= t < ctx.vocab_size)
                raise RequestError(
                    400, f"prompt: token id {bad} is outside the vocabulary [0, {ctx.vocab_size})", "prompt"
                )
        else:
            raise RequestError(400, f"prompt must be {_PROMPT_SHAPES}", "prompt")
        out.append((text, ids))
    for (i, text), ids in zip(texts, ctx.tokenizer.encode_batch([t for _, t in texts]), strict=True):
        out[i] = (text, ids if text else [])
    for i, (_, ids) in enumerate(out):
        if not ids:
            where = f"prompt[{i}]" if len(prompt) > 1 else "prompt"
            raise RequestError(400, f"{where} must not be empty", "prompt")
    return out


def _parsed(kind, request_id: str, model: str, prompts: list[PromptInput], req, echo: bool, **extra) -> ParsedRequest:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    extra["continuous_usage"] = include_usage and bool(req.stream_options.continuous_usage_stats)  # (as vLLM)
    extra["return_token_ids"], extra["tokens_as_ids"] = bool(req.return_token_ids), bool(req.return_tokens_as_token_ids)
    if req.stream_interval is not None and req.stream_interval < 1:
        raise RequestError(400, f"stream_interval must be at least 1, got {req.stream_interval}", "stream_interval")
    extra["stream_interval"] = req.stream_interval
    created = int(time.time())
    return ParsedRequest(kind, request_id, model, created, prompts, bool(req.stream), include_usage, echo, **extra)

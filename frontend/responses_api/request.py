"""A `POST /v1/responses` body -> a ResponsesCall: the chat request it runs as, and what its response echoes.

Two steps, so the handler can read the previous response from the store between them: `decode_responses` (the
body's JSON and the checks that need nothing else) and `responses_call` (the conversation rendered, validated and
tokenized by chat's own path, frontend/protocol.py `chat_request`). An error of the chat path names the Responses
field it came from: `messages[i]` -> the input item (or `instructions`, or `previous_response_id` for a message of
the stored conversation), `max_completion_tokens` -> `max_output_tokens`, `response_format` -> `text.format`,
`tools[i].function.X` -> `tools[i].X`.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass

from frontend.body import RequestError, decode_body
from frontend.context import ServingContext
from frontend.fields import ChatCompletionRequest, SamplingExtras
from frontend.protocol import ParsedRequest, chat_request
from frontend.responses_api.fields import NOT_HONOURED_IN_RESPONSES, OUTPUT_LOGPROBS, ResponsesRequest
from frontend.responses_api.items import chat_messages, chat_tool_choice, chat_tools, input_items

MAX_METADATA, MAX_KEY, MAX_VALUE = 16, 64, 512  # OpenAI's bounds on metadata
_FORMAT_KEYS = ("type", "name", "schema", "strict", "description")  # text.format's
_RENAMES = [
    (re.compile(r"^max_completion_tokens$|^max_tokens$"), "max_output_tokens"),
    (re.compile(r"^n$"), "input"),  # (check_total without max tokens: the prompt is what is too long)
    (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
    (re.compile(r"^(tools\[\d+\])\.function"), r"\1"),
    (re.compile(r"^messages$"), "input"),
]


@dataclass(frozen=True)
class ResponsesCall:
    request: ResponsesRequest
    parsed: ParsedRequest  # the chat request it runs as (its request_id: resp_<hex>)
    input: list[dict]  # this call's items (frontend/responses_api/items.py)
    history: list[dict]  # the conversation before them: previous_response_id's input and output
    created_at: int
    names: FieldNames  # a chat field -> the Responses field it came from (for errors found later: compile_check)

    @property
    def background(self) -> bool:
        return bool(self.request.background)

    @property
    def store(self) -> bool:
        return self.request.store is not False

    def echo(self) -> dict:
        """The request's fields a Response object repeats (tools and text.format with their own keys only)."""
        r = self.request
        fmt = (r.text.format if r.text is not None else None) or {"type": "text"}
        fmt = {k: v for k, v in fmt.items() if k in _FORMAT_KEYS}
        p = self.parsed.prompts[0].params
        return {
            "background": self.background,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "metadata": r.metadata or {},
            "model": self.parsed.model,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "safety_identifier": r.safety_identifier,
            "service_tier": "default",
            "store": self.store,
            "temperature": p.temperature,
            "text": {"format": fmt},
            "tool_choice": r.tool_choice if r.tool_choice is not None else ("auto" if r.tools else "none"),
            "tools": [{"type": "function", **tool["function"]} for tool in chat_tools(r.tools) or []],
            "top_logprobs": r.top_logprobs,
            "top_p": p.top_p,
            "truncation": "disabled",
            "user": r.user,
        }


def decode_responses(body: bytes, ctx: ServingContext, request_id: str) -> ResponsesRequest:
    req = decode_body(body, ResponsesRequest, NOT_HONOURED_IN_RESPONSES)
    if req.input is None:
        raise RequestError(400, "input is required", "input")
    if req.reasoning is not None:
        for key in ("effort", "summary", "generate_summary"):
            if getattr(req.reasoning, key) is not None:
                raise RequestError(400, f"reasoning.{key} is not supported (only null)", f"reasoning.{key}")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise RequestError(400, "text.verbosity is not supported (only null or 'medium')", "text.verbosity")
    for i, entry in enumerate(req.include or []):
        if entry != OUTPUT_LOGPROBS:
            raise RequestError(
                400, f"include[{i}] {entry!r} is not supported (only {OUTPUT_LOGPROBS})", f"include[{i}]"
            )
    if req.metadata is not None:
        _check_metadata(req.metadata)
    if req.service_tier not in (None, "auto", "default"):
        raise RequestError(400, "service_tier: only 'auto' or 'default' (one tier here)", "service_tier")
    if req.background and req.store is False:
        raise RequestError(400, "background responses must be stored: store cannot be false", "background")
    return req


def responses_call(
    req: ResponsesRequest, ctx: ServingContext, request_id: str, history: list[dict] | None = None
) -> ResponsesCall:
    """The conversation (`history`, then this call's input) run as a chat request."""
    history = history or []
    items = input_items(req.input)
    if len(history) + len(items) > ctx.max_model_len:  # every item renders to one token at least
        raise RequestError(400, f"input: {len(items)} items cannot fit in {ctx.max_model_len} tokens", "input")
    messages, starts = chat_messages(history + items)
    if req.instructions is not None:
        messages.insert(0, {"role": "system", "content": req.instructions})
    sampling = {k: getattr(req, k) for k in SamplingExtras.__struct_fields__}
    logprobs = req.top_logprobs is not None or OUTPUT_LOGPROBS in (req.include or [])
    chat = ChatCompletionRequest(
        **(sampling | {"stream": False}),
        messages=messages,
        max_completion_tokens=req.max_output_tokens,
        logprobs=logprobs,
        top_logprobs=req.top_logprobs,
        tools=chat_tools(req.tools),
        tool_choice=chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        chat_template_kwargs=req.chat_template_kwargs,
    )
    if req.text is not None and req.text.format is not None:
        chat.response_format = _response_format(req.text.format)
    names = FieldNames(starts, len(history), req.instructions is not None)
    try:
        parsed = chat_request(chat, ctx, request_id)
    except RequestError as e:
        raise names.error(e) from e
    parsed = dataclasses.replace(parsed, fields={k: names(v) for k, v in parsed.fields.items()})
    return ResponsesCall(req, parsed, items, history, int(time.time()), names)


def _response_format(fmt: dict) -> dict:
    """text.format in chat's response_format shape."""
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        return {"type": kind, "json_schema": {k: fmt[k] for k in _FORMAT_KEYS[1:] if k in fmt}}
    raise RequestError(400, "text.format.type must be text, json_object or json_schema", "text.format.type")


def _check_metadata(metadata: dict[str, str]) -> None:
    if len(metadata) > MAX_METADATA:
        raise RequestError(400, f"metadata: at most {MAX_METADATA} pairs", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_KEY or len(value) > MAX_VALUE:
            raise RequestError(
                400, f"metadata: keys of at most {MAX_KEY} and values of at most {MAX_VALUE} characters", "metadata"
            )


@dataclass(frozen=True)
class FieldNames:
    """A chat field -> the Responses field it came from (module docstring)."""

    starts: list[int]  # the item each chat message (after the instructions) starts at
    num_history: int
    instructions: bool

    def __call__(self, param: str | None) -> str | None:
        if param is None:
            return None
        if m := re.match(r"messages\[(\d+)\]", param):
            i = int(m[1]) - self.instructions
            if i < 0:
                return "instructions"
            item = self.starts[i]
            return "previous_response_id" if item < self.num_history else f"input[{item - self.num_history}]"
        for pattern, to in _RENAMES:
            param = pattern.sub(to, param)
        return param

    def error(self, e: RequestError) -> RequestError:
        """A chat path's error, naming the Responses field."""
        param, message = self(e.param), e.message
        if e.param and message.startswith(e.param):
            message = param + message[len(e.param) :]
        return RequestError(e.status, message, param, e.type, e.code)

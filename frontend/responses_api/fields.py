"""The fields of a `POST /v1/responses` body: OpenAI's, and Sluice's sampling extras as in chat (SamplingExtras).

Refused with a 400 naming the field (any value other than the listed no-ops): what the Responses API spells
otherwise (`max_tokens`: max_output_tokens; `response_format`: text.format; `messages`: input), what it has no
place for (`n` > 1, prompt logprobs, token ids, echo), the API's features Sluice does not build (`conversation`
objects, stored `prompt` templates, `truncation: "auto"`, `max_tool_calls`, reasoning effort and summaries,
`text.verbosity`, stream obfuscation, `include` entries other than output logprobs), and chat's refusals.
"""

from __future__ import annotations

from typing import Any

import msgspec

from frontend.fields import NOT_HONOURED_IN_CHAT, SamplingExtras, _empty, _is

OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the one `include` entry honoured


class Reasoning(msgspec.Struct):
    effort: Any = None  # refused unless null: no model here takes an effort (chat_template_kwargs may)
    summary: Any = None  # refused unless null: Sluice writes no summaries
    generate_summary: Any = None  # (OpenAI's older spelling of summary)


class TextOptions(msgspec.Struct):
    format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    verbosity: str | None = None  # refused unless null or "medium"


class ResponsesRequest(SamplingExtras, kw_only=True):
    input: Any = None  # a string, or a list of items (frontend/responses_api/items.py)
    instructions: str | None = None  # a system message first; not carried on by previous_response_id
    max_output_tokens: int | None = None
    tools: Any = None  # function tools only
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: Reasoning | None = None
    metadata: dict[str, str] | None = None  # at most 16 pairs, keys of 64 and values of 512 characters
    user: str | None = None  # echoed
    safety_identifier: str | None = None  # echoed
    service_tier: str | None = None  # null, "auto" or "default" (one tier here): echoed as "default"
    store: bool | None = None  # default true
    background: bool | None = None  # needs store
    previous_response_id: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None  # with include message.output_text.logprobs, or alone
    truncation: str | None = None  # "disabled" only
    chat_template_kwargs: dict[str, Any] | None = None  # as chat (frontend/tokenizer.py)


NOT_HONOURED_IN_RESPONSES = {
    **{k: v for k, v in NOT_HONOURED_IN_CHAT.items() if k != "functions"},
    "messages": _is(None),
    "max_tokens": _is(None),
    "max_completion_tokens": _is(None),
    "response_format": _is(None),
    "n": _is(None, 1),
    "best_of": _is(None, 1),
    "use_beam_search": _is(None, False),  # (chat's and completions')
    "length_penalty": _is(None, 1, 1.0),
    "early_stopping": _is(None, False),
    "logprobs": _is(None, False),
    "prompt_logprobs": _is(None),
    "echo": _is(None, False),
    "return_token_ids": _is(None, False),
    "return_tokens_as_token_ids": _is(None, False),
    "continue_final_message": _is(None, False),
    "add_generation_prompt": _is(None, True),
    "conversation": _is(None),
    "prompt": _is(None),
    "prompt_cache_key": _is(None),
    "prompt_cache_retention": _is(None),
    "max_tool_calls": _is(None),
    "truncation": _is(None, "disabled"),
    "stream_options": _is(None, {}, {"include_obfuscation": False}),
    "functions": _empty,
    **dict.fromkeys(
        ("context_management", "moderation", "background_options", "prompt_cache_options", "image", "access_programs"),
        _empty,
    ),  # (the client's newer options, none built)
}

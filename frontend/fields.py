"""The request bodies' fields: what each endpoint reads (msgspec Structs; `null` means "default"
for every optional field, unknown fields are ignored: OpenAI clients send `user`, `metadata`,
`service_tier`), and the fields of
OpenAI's or vLLM's (0.32) API that Sluice does not honour (yet), each
with the values that are its no-op. Any other value of those is refused with a 400 naming it: a
field accepted but ignored would silently change the answer. Beam search's fields (`use_beam_search`,
`length_penalty`, `early_stopping`, and `best_of` > n) are refused with the reason, BEAM_SEARCH.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from frontend.body import RequestError

BEAM_SEARCH = (
    "beam search is not implemented: a beam group would have to be one unit for the scheduler, the prefix cache "
    "and the abort protocol"
)


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage so far in every chunk


class SamplingExtras(msgspec.Struct, kw_only=True):
    """Fields of every generation endpoint (the Responses API's too): OpenAI's, then vLLM's extras."""

    model: str | None = None
    stream: bool | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    guidance_scale: float | None = None  # classifier-free guidance (frontend/guidance.py)
    negative_prompt: str | list[Any] | None = None
    # structured outputs (frontend/structured.py): vLLM's, and its older spellings
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    truncate_prompt_tokens: int | None = None  # keep this many prompt tokens (-1: the context's length)
    truncation_side: Literal["left", "right"] | None = None  # which end truncation drops from (default left)
    cache_salt: str | None = None  # prefix caching shared only among requests with the same salt


class SamplingFields(SamplingExtras, kw_only=True):
    """Fields common to completions and chat completions."""

    max_tokens: int | msgspec.UnsetType | None = msgspec.UNSET
    n: int | None = None
    stream_options: StreamOptions | None = None
    prompt_logprobs: int | None = None
    response_format: Any = None  # OpenAI's structured outputs (frontend/structured.py)
    # vLLM's token-in/token-out extras (frontend/responses.py)
    return_token_ids: bool | None = None  # prompt and output token ids in the response (streamed per chunk)
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:N"
    best_of: int | None = None  # null or n (check_best_of): more is beam search's


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[Any] | None = None
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: Any = None  # frontend/tools.py
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extras (frontend/protocol.py)
    echo: bool | None = None  # the reply starts with the last message's content when that is the assistant's
    add_generation_prompt: bool | None = None  # open the assistant's turn (default true)
    continue_final_message: bool | None = None  # continue the last message instead (its turn left open)
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template (frontend/tokenizer.py)
    include_reasoning: bool | None = None  # false: drop the reasoning (--reasoning-parser; without one: moot)


def _is(*noops):
    return lambda value: value in noops


def _beam(*noops):
    """A beam search field: a value other than its no-ops is refused, saying why (the verdict is the reason)."""
    return lambda value: value in noops or BEAM_SEARCH


def check_best_of(req: SamplingFields) -> None:
    """best_of: null or n is a no-op; more ranks a group of samples (beam search's), fewer cannot be."""
    n = 1 if req.n is None else req.n
    if req.best_of is None or req.best_of == n:
        return
    if req.best_of < n:
        raise RequestError(400, f"best_of ({req.best_of}) must not be less than n ({n})", "best_of")
    raise RequestError(400, f"best_of is not supported: {BEAM_SEARCH}", "best_of")


def _empty(value) -> bool:
    return not value


_NOT_HONOURED = {
    "functions": _empty,
    "function_call": _is(None, "none", "auto"),
    "use_beam_search": _beam(None, False),
    "length_penalty": _beam(None, 1, 1.0),
    "early_stopping": _beam(None, False),
    "priority": _is(None, 0),
    "prompt_embeds": _empty,
    "audio": _empty,
    "modalities": _is(None, ["text"]),
    "prediction": _empty,
    "reasoning_effort": _is(None),
    "logprobs_mode": _is(None),  # server-wide: sluice serve --logprobs-mode
    "logits_processors": _empty,
    "guided_whitespace_pattern": _empty,
    "structural_tag": _empty,
    # vLLM 0.32's other extras: disaggregation, multimodal, reasoning, sessions and output options Sluice lacks
    "request_id": _is(None),  # Sluice names each request itself (the response's id)
    "session_id": _is(None),
    "stream_interval": _is(None, 1),
    "thinking_token_budget": _is(None),
    "return_token_offsets": _is(None, False),
    "return_prompt_text": _is(None, False),
    "return_mm_kwargs": _is(None, False),
    "routed_experts_prompt_start": _is(None),
    **dict.fromkeys(("logprob_token_ids", "watermarking", "repetition_detection", "vllm_xargs"), _empty),
    **dict.fromkeys(("kv_transfer_params", "ec_transfer_params", "mm_processor_kwargs", "media_io_kwargs"), _empty),
    "mm_payload": _empty,
}
NOT_HONOURED_IN_CHAT = {
    **_NOT_HONOURED,
    "add_special_tokens": _is(None, False),
    "chat_template": _empty,
    "documents": _empty,
}
NOT_HONOURED_IN_COMPLETIONS = {
    **_NOT_HONOURED,
    "add_special_tokens": _is(None, True),
    "tools": _empty,  # chat only
    "tool_choice": _is(None, "none"),
}
NOT_HONOURED_IN_TOKENIZE = {"chat_template": NOT_HONOURED_IN_CHAT["chat_template"]}  # /tokenize

"""The request bodies' fields: what each endpoint reads (msgspec Structs; `null` means "default"
for every optional field, unknown fields are ignored: OpenAI clients send `user`, `metadata`,
`service_tier`), and the fields of
OpenAI's or vLLM's (0.32) API that Sluice does not honour (yet), each
with the values that are its no-op. Any other value of those is refused with a 400 naming it: a
field accepted but ignored would silently change the answer. Beam search's fields are read by `beam_search`.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from frontend.body import RequestError
from messages.sampling_params import BeamSearch


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
    stream_interval: int | None = None  # a stream's event at each choice's first token, then each this many of a
    # choice (null: `sluice serve --stream-interval`'s)


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
    # vLLM's beam search (beam_search): best_of beams (default n), the n best returned
    use_beam_search: bool | None = None
    best_of: int | None = None  # null or n without beam search; with it, the beams kept (>= n)
    length_penalty: float | None = None  # a beam's score: cumulative logprob / length ** length_penalty (1.0)
    early_stopping: bool | Literal["never"] | None = None  # when the search may stop before max_tokens (false)


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


def beam_search(req: SamplingFields) -> BeamSearch | None:
    """The request's beam search (None: it samples). best_of must not be less than n; more than n, or a length
    penalty or early stopping, applies to beam search only (sampling best_of and keeping the n best is not
    implemented)."""
    n = 1 if req.n is None else req.n
    if req.best_of is not None and req.best_of < n:
        raise RequestError(400, f"best_of ({req.best_of}) must not be less than n ({n})", "best_of")
    if req.use_beam_search:
        es = False if req.early_stopping is None else req.early_stopping
        lp = 1.0 if req.length_penalty is None else req.length_penalty
        return BeamSearch(width=req.best_of or n, length_penalty=lp, early_stopping=es)
    for name, off in (("best_of", (None, n)), ("length_penalty", (None, 1.0)), ("early_stopping", (None, False))):
        if getattr(req, name) not in off:
            raise RequestError(400, f"{name} {getattr(req, name)!r} applies to beam search: set use_beam_search", name)
    return None


def _empty(value) -> bool:
    return not value


_NOT_HONOURED = {
    "functions": _empty,
    "function_call": _is(None, "none", "auto"),
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

"""Bounding a call's work before anything expensive (frontend/protocol.py parses, this decides what fits): a
prompt's length in characters against the context before tokenizing it (`Tokenizer.max_token_chars`), max_tokens
against what the context leaves (served up to the context's end, as vLLM), a call's choices and their tokens
(prompt + max_tokens) against `max_choices` and `max_total_tokens`, and vLLM's `truncate_prompt_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from frontend.body import RequestError
from frontend.context import ServingContext
from messages.sampling_params import SamplingParams


@dataclass(frozen=True)
class PromptInput:
    text: str | None  # None for token-id prompts unless echo asked for their text
    token_ids: list[int]
    params: SamplingParams  # per prompt: a defaulted max_tokens depends on the prompt length


def check_chars(chars: int, ctx: ServingContext, prompt_param, room: int = 1) -> None:
    """Refuse a prompt that cannot fit from its length in characters alone, before tokenizing it."""
    if ctx.tokenizer.max_token_chars is not None:
        at_least = -(-chars // ctx.tokenizer.max_token_chars)
        check_fits(at_least, ctx, prompt_param, chars, room)


def check_fits(num_tokens: int, ctx: ServingContext, prompt_param, chars=None, room: int = 1) -> int:
    """The tokens left for the completion; a 400 when the prompt leaves fewer than `room` (0: a prompt to tokenize
    only, which may fill the context). `chars`: the prompt is `chars` characters long and `num_tokens` a lower bound
    of its tokens."""
    budget = ctx.max_model_len - num_tokens
    if budget < room:
        at_least, of = ("at least ", f" of {chars} characters") if chars is not None else ("", "")
        left = "which leaves no room for the completion" if room else "more than it holds"
        raise RequestError(
            400,
            f"This model's maximum context length is {ctx.max_model_len} tokens. However, the {prompt_param} has "
            f"{at_least}{num_tokens} tokens{of}, {left}. Please reduce the length of the {prompt_param}.",
            prompt_param,
        )
    return budget


def fit(text, ids, params: SamplingParams, max_tokens, ctx: ServingContext, prompt_param) -> PromptInput:
    """Resolve max_tokens: the tokens left in the context when it is not given, and at most those when it is (as
    vLLM: the request is served and ends with "length" at the context's end)."""
    budget = check_fits(len(ids), ctx, prompt_param)
    limit = budget if max_tokens is None else min(max_tokens, budget)
    if params.min_tokens > limit:
        raise RequestError(400, f"min_tokens ({params.min_tokens}) exceeds the {limit} tokens left", "min_tokens")
    if params.max_tokens != limit:
        params = msgspec.structs.replace(params, max_tokens=limit)
    return PromptInput(text, ids, params)


def check_total(prompts: list[PromptInput], ctx: ServingContext, param: str) -> None:
    """The engine requests one call starts (prompts x n) and the tokens they may cost (prompt + max_tokens each)."""
    n, limits = prompts[0].params.n, ctx.limits
    if len(prompts) * n > limits.max_choices:
        raise RequestError(
            400,
            f"n: {len(prompts)} prompts x n = {len(prompts) * n} choices, more than the {limits.max_choices} allowed",
            "n",
        )
    total = sum((len(p.token_ids) + p.params.max_tokens) * n for p in prompts)
    if total > limits.max_total_tokens:
        raise RequestError(
            400,
            f"{param}: the call may cost {total} tokens (prompt + max_tokens, for each of prompts x n choices), "
            f"more than the {limits.max_total_tokens} allowed",
            param,
        )


def truncation(req, ctx: ServingContext) -> int | None:
    """vLLM's truncate_prompt_tokens: how many prompt tokens to keep (-1: the context's length; None: all)."""
    k = req.truncate_prompt_tokens
    if k is not None and k < 1 and k != -1:
        raise RequestError(400, f"truncate_prompt_tokens must be -1 or at least 1; got {k}", "truncate_prompt_tokens")
    return ctx.max_model_len if k == -1 else k


def truncate(ids: list[int], keep: int | None, side: str | None) -> list[int]:
    """The prompt's last `keep` tokens (truncation_side "left", the default), or its first ("right")."""
    if keep is None or len(ids) <= keep:
        return ids
    return ids[:keep] if side == "right" else ids[-keep:]

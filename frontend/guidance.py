"""Classifier-free guidance's request fields (vLLM-style extras on both endpoints): `guidance_scale` (0 < s <= 20,
1 = off; SamplingParams validates it) and `negative_prompt`, turned here into the unconditional companion's token
ids. Completions: a string (encoded as prompts are, BOS included) or token ids. Chat: a string, used as the content
of the last user turn of an otherwise identical conversation, rendered exactly as the request's (its tools,
`add_generation_prompt`, `continue_final_message`). Without it the engine guides against the model's BOS token
alone (`ServingContext.bos_token_id`: the model config's, which the engine reads too); for a model without one,
chat renders the conversation with an empty last user turn and completions require the field. At scale 1 (off)
a negative prompt is accepted and has no effect (no companion runs: the guided logits are the conditional ones), so
a client sweeping the scale from 1 upward sends the same request at every point; its shape and its length bound
are checked as at any scale, but it is not tokenized.
"""

from __future__ import annotations

from frontend.body import RequestError, token_ids
from frontend.context import ServingContext
from messages.sampling_params import ParamError

PARAM = "negative_prompt"


def negative_prompt_ids(req, ctx: ServingContext, chat: dict | None = None) -> list[int] | None:
    """The companion's prompt for a request, or None: no companion (guidance off) or the engine's default (BOS).
    `chat`: a chat request's conversation as it is rendered (`Tokenizer.render_chat`'s arguments)."""
    negative, guided = req.negative_prompt, req.guidance_scale not in (None, 1, 1.0)
    if negative is None:
        if not guided or ctx.bos_token_id is not None:
            return None  # the engine's default: BOS alone
        if chat is None:
            raise RequestError(400, f"{PARAM} is required with guidance_scale: the model has no BOS token", PARAM)
        negative = ""  # an empty user turn
    if isinstance(negative, str):
        _check_chars(len(negative), ctx)
        user = _last_user(chat["messages"]) if chat is not None else None
        if not guided:  # checked, and without effect: at scale 1 the companion's logits cancel out
            return None
        ids = _rendered(negative, chat, user, ctx) if chat is not None else ctx.tokenizer.encode(negative)
    elif chat is not None:
        raise RequestError(400, f"{PARAM} must be a string in chat completions", PARAM)
    elif (ids := token_ids(negative)) is None:
        raise RequestError(400, f"{PARAM} must be a string or a list of token ids", PARAM)
    if not ids:  # (an empty chat turn still renders the template's tokens)
        raise RequestError(400, f"{PARAM} must not be empty", PARAM)
    if len(ids) >= ctx.max_model_len:
        raise RequestError(400, f"{PARAM} has {len(ids)} tokens; the context holds {ctx.max_model_len}", PARAM)
    if not all(0 <= t < ctx.vocab_size for t in ids):
        raise RequestError(400, f"{PARAM}: a token id is outside the vocabulary [0, {ctx.vocab_size})", PARAM)
    return ids if guided else None


def _check_chars(chars: int, ctx: ServingContext) -> None:
    """Refuse a negative prompt that cannot fit the context from its length alone, before tokenizing it."""
    most = ctx.tokenizer.max_token_chars
    if most is not None and -(-chars // most) >= ctx.max_model_len:
        raise RequestError(400, f"{PARAM} of {chars} characters cannot fit in {ctx.max_model_len} tokens", PARAM)


def _last_user(messages: list) -> int:
    users = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise RequestError(400, f"{PARAM} replaces the last user message, and there is none", PARAM)
    return users[-1]


def _rendered(text: str, chat: dict, i: int, ctx: ServingContext) -> list[int]:
    """The conversation rendered exactly as the request's (tools, turn), but for user message i, which says `text`."""
    messages = chat["messages"]
    negated = [*messages[:i], {**messages[i], "content": text}, *messages[i + 1 :]]
    try:
        rendered = ctx.tokenizer.render_chat(**{**chat, "messages": negated})
    except ParamError as e:
        raise RequestError(400, str(e), e.param) from e
    return ctx.tokenizer.encode(rendered, add_special_tokens=False)

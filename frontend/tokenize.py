"""vLLM's utility endpoints (issue 18): `POST /tokenize`, `POST /detokenize`, the model card of
`GET /v1/models/{model}` and `GET /version`, as pure functions of a body and the serving context.

/tokenize takes a completion prompt (`prompt`, with `add_special_tokens`, default true) or a chat (`messages`,
with `tools` and `chat_template_kwargs`, rendered with the chat template, `add_generation_prompt` and
`continue_final_message` as a chat request renders them; `add_special_tokens` default false, as the template writes
them) and answers `{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` only with `return_token_strs`).
vLLM's `chat_template` is refused as a chat request refuses it (frontend/fields.py). /detokenize takes `tokens`
and answers `{"prompt"}`. Both are bounded as a completion's prompt is (frontend/budget.py): a prompt or chat that
cannot fit the context is refused (400) from its length in characters before it is tokenized, and from its tokens
after (the message says how many); at most max_model_len tokens are detokenized; so every answer is small. Bodies
over 16 KiB are parsed and tokenized off the event loop, as the completion endpoints' (frontend/server.py `_parse`).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

import msgspec

from frontend.body import RequestError, decode_body
from frontend.budget import check_chars, check_fits
from frontend.fields import NOT_HONOURED_IN_TOKENIZE
from frontend.protocol import rendered_chat
from frontend.tools import validate_tools


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None  # default true, false with continue_final_message (as chat)
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: Any = None  # validated and rendered as a chat request's (frontend/tools.py)
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template, as a chat request's


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


def tokenize(body: bytes, ctx) -> dict:
    req = decode_body(body, TokenizeRequest, NOT_HONOURED_IN_TOKENIZE)
    _model(req.model, ctx)
    tok = ctx.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise RequestError(400, "give exactly one of prompt and messages", "prompt")
    if req.prompt is not None:
        for name in ("tools", "chat_template_kwargs"):
            if getattr(req, name):
                raise RequestError(400, f"{name} apply to messages only", name)
        param, text, special = "prompt", req.prompt, req.add_special_tokens is not False
    else:
        _, text = rendered_chat(req, ctx, validate_tools(req.tools) if req.tools else None)
        param, special = "messages", bool(req.add_special_tokens)
    check_chars(len(text), ctx, param, room=0)  # (a prompt that cannot fit is refused before it is tokenized)
    ids = tok.encode(text, add_special_tokens=special)
    check_fits(len(ids), ctx, param, room=0)
    strs = [tok.token_str(t) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body: bytes, ctx) -> dict:
    req = decode_body(body, DetokenizeRequest)
    _model(req.model, ctx)
    if len(req.tokens) > ctx.max_model_len:
        raise RequestError(400, f"tokens: {len(req.tokens)}, more than max_model_len ({ctx.max_model_len})", "tokens")
    bad = next((t for t in req.tokens if not 0 <= t < ctx.vocab_size), None)
    if bad is not None:
        raise RequestError(400, f"tokens: token id {bad} is outside the vocabulary [0, {ctx.vocab_size})", "tokens")
    return {"prompt": ctx.tokenizer.decode(req.tokens)}


def model_card(name: str, ctx, created: int, root: str) -> dict:
    """One entry of /v1/models (OpenAI's fields, vLLM's max_model_len, root and parent, the runner); 404 for another
    name."""
    _model(name, ctx)
    lora = (ctx.loras or {}).get(name)  # (an adapter's root is its directory, its parent the base: vLLM's)
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "sluice",
        "root": root if lora is None else lora.path,
        "parent": None if lora is None else lora.base_model_name or ctx.model_names[0],
        "max_model_len": ctx.max_model_len,
        "runner": ctx.runner,  # (Sluice's: which endpoints serve it)
    }


def server_version() -> dict:
    try:
        return {"version": version("sluice-llm")}
    except PackageNotFoundError:  # run from a checkout that was never installed
        return {"version": "unknown"}


def _model(name: str | None, ctx) -> None:
    """`None` or "" name the served model (as vLLM); another name is a 404."""
    if name and not ctx.knows(name):
        raise RequestError(404, f"The model `{name}` does not exist.", "model", code="model_not_found")

"""vLLM's utility endpoints (issue 18): `POST /tokenize`, `POST /detokenize`, the model card of
`GET /v1/models/{model}` and `GET /version`, as pure functions of a body and the serving context.

/tokenize takes a completion prompt (`prompt`, with `add_special_tokens`, default true) or a chat (`messages`,
with `tools`, rendered with the chat template, `add_generation_prompt` and `continue_final_message` as a chat
request renders them; `add_special_tokens` default false, as the template writes them) and answers `{"count",
"max_model_len", "tokens", "token_strs"}` (`token_strs` only with `return_token_strs`). vLLM's `chat_template` and
`chat_template_kwargs` are refused as a chat request refuses them (frontend/fields.py). /detokenize takes `tokens`
and answers `{"prompt"}`. A prompt longer than the context is still tokenized (clients ask to learn its length);
its size is bounded by the body limit.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

import msgspec

from frontend.body import RequestError, decode_body
from frontend.fields import NOT_HONOURED_IN_TOKENIZE
from frontend.protocol import chat_turn
from frontend.tools import validate_tools
from messages.sampling_params import ParamError


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None  # default true, false with continue_final_message (as chat)
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: Any = None  # validated and rendered as a chat request's (frontend/tools.py)


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
        if req.tools:
            raise RequestError(400, "tools are rendered with messages only", "tools")
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    else:
        tools = validate_tools(req.tools) if req.tools else None
        try:
            text = tok.render_chat(req.messages, tools=tools, **chat_turn(req))
        except ParamError as e:
            raise RequestError(400, str(e), e.param) from e
        ids = tok.encode(text, add_special_tokens=bool(req.add_special_tokens))
    strs = [tok.token_str(t) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body: bytes, ctx) -> dict:
    req = decode_body(body, DetokenizeRequest)
    _model(req.model, ctx)
    bad = next((t for t in req.tokens if not 0 <= t < ctx.vocab_size), None)
    if bad is not None:
        raise RequestError(400, f"tokens: token id {bad} is outside the vocabulary [0, {ctx.vocab_size})", "tokens")
    return {"prompt": ctx.tokenizer.decode(req.tokens)}


def model_card(name: str, ctx, created: int, root: str) -> dict:
    """One entry of /v1/models (OpenAI's fields, vLLM's max_model_len, root and parent); 404 for another name."""
    _model(name, ctx)
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "sluice",
        "root": root,
        "parent": None,
        "max_model_len": ctx.max_model_len,
    }


def server_version() -> dict:
    try:
        return {"version": version("sluice-llm")}
    except PackageNotFoundError:  # run from a checkout that was never installed
        return {"version": "unknown"}


def _model(name: str | None, ctx) -> None:
    """`None` or "" name the served model (as vLLM); another name is a 404."""
    if name and name not in ctx.model_names:
        raise RequestError(404, f"The model `{name}` does not exist.", "model", code="model_not_found")

"""`POST /v1/embeddings` (OpenAI's shape, vLLM's extras) for a model served for pooling (issue 52).

Body: `input` a string, a list of strings, a list of token ids or a list of lists of them (at most MAX_INPUTS, none
empty), or instead vLLM's `messages`: a chat rendered by the model's chat template as one input (with
`chat_template_kwargs`, `add_generation_prompt` default false and `continue_final_message`, as a chat request renders
them; `add_special_tokens` default false there, as the template writes them); `encoding_format` "float" or "base64" (float32 little-endian, as the openai client decodes it);
`dimensions` (matryoshka models only: the sizes their config.json declares, else a 400 naming it);
`truncate_prompt_tokens` (vLLM's: an input longer than this many tokens is cut to it, its special tokens kept; -1:
max_model_len; without it a longer input than max_model_len is a 400); `normalize` (vLLM's: over the model's
pooling config); `add_special_tokens` (default true); `user` (logged with the request). A text is bounded by its
length in characters before it is tokenized.

Requests go through the front's pooling ledger (frontend/pool_ledger.py), which says what an engine death or a
client gone does to them.
"""

from __future__ import annotations

import base64
import logging
import time
from typing import Any, Literal

import msgspec
import numpy as np
from aiohttp import web

from frontend.body import RequestError, decode_body, token_ids
from frontend.budget import check_chars
from frontend.fields import NOT_HONOURED_IN_TOKENIZE
from frontend.http_base import REQUEST_ID, json_response
from frontend.protocol import new_request_id, rendered_chat
from messages.pooling import PoolRequest

log = logging.getLogger("sluice.http")

MAX_INPUTS = 2048  # inputs per request (OpenAI's limit)
SHAPES = "a string, a list of strings, a list of token ids, or a list of lists of token ids"


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: str | list | None = None
    messages: list[Any] | None = None  # vLLM's chat input (one of input and messages)
    add_generation_prompt: bool = False  # (vLLM's default for an embedding: the assistant's turn not opened)
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    add_special_tokens: bool | None = None


def parse_embeddings(body: bytes, ctx, rid: str, dimensions: tuple[int, ...]) -> tuple[EmbeddingRequest, PoolRequest]:
    """The request and what the engine is sent, or a RequestError (400) naming the field at fault."""
    req = decode_body(body, EmbeddingRequest, NOT_HONOURED_IN_TOKENIZE)
    if (req.input is None) == (req.messages is None):
        raise RequestError(400, "give exactly one of input and messages", "input")
    if req.model and not ctx.knows(req.model):
        raise RequestError(404, f"The model `{req.model}` does not exist.", "model", code="model_not_found")
    if req.dimensions is not None and (not dimensions or req.dimensions not in dimensions):
        why = f"one of {dimensions[0]} .. {dimensions[-1]}" if dimensions else "not served: the model is not matryoshka"
        raise RequestError(400, f"dimensions {req.dimensions}: {why}", "dimensions")
    k = req.truncate_prompt_tokens
    if k is not None and not (k == -1 or 1 <= k <= ctx.max_model_len):
        raise RequestError(
            400, f"truncate_prompt_tokens must be -1 or 1 .. {ctx.max_model_len}", "truncate_prompt_tokens"
        )
    cut = ctx.max_model_len if k == -1 else k
    if req.messages is None:
        inputs = encode_inputs(req.input, ctx, cut, req.add_special_tokens is not False)
    else:
        if not req.messages:
            raise RequestError(400, "messages must not be empty", "messages")
        _, text = rendered_chat(req, ctx, None)
        inputs = encode_inputs(text, ctx, cut, bool(req.add_special_tokens), "messages")
    msg = PoolRequest(request_id=rid, inputs=inputs, normalize=req.normalize, dimensions=req.dimensions)
    return req, msg


def encode_inputs(
    value, ctx, cut: int | None, special: bool, param: str = "input", most: int = MAX_INPUTS
) -> list[list[int]]:
    """The inputs' token ids (at most `most` inputs, each within max_model_len), each cut to `cut` tokens where
    given (a text's content is cut, its special tokens kept, as sentence-transformers' truncation; token ids: the
    first `cut`); errors name `param`."""
    if not value:
        raise RequestError(400, f"{param} must not be empty", param)
    items = [value] if isinstance(value, str) or token_ids(value) is not None else value
    if len(items) > most:
        raise RequestError(400, f"{param}: {len(items)} inputs, more than the {most} allowed", param)
    hf, out, texts = ctx.tokenizer.hf, [], []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise RequestError(400, f"{param}[{i}] must not be empty", param)
            if cut is None:
                check_chars(len(item), ctx, param, room=0)
            texts.append(i)
            out.append(item)
        elif (ids := token_ids(item)) is not None:
            if (bad := next((t for t in ids if not 0 <= t < ctx.vocab_size), None)) is not None:
                raise RequestError(400, f"{param}[{i}]: token id {bad} is outside the vocabulary [0, {ctx.vocab_size})",
                                   param)  # fmt: skip
            out.append(ids[:cut] if cut else ids)
        else:
            raise RequestError(400, f"{param} must be {SHAPES}", param)
    encodings = hf.encode_batch_fast([out[i] for i in texts], add_special_tokens=False) if texts else []
    extra = hf.num_special_tokens_to_add(False) if special else 0
    for i, enc in zip(texts, encodings, strict=True):
        if cut is not None:
            enc = cut_encoding(hf, out[i], enc, max(cut - extra, 0))
        out[i] = hf.post_process(enc, add_special_tokens=special).ids
    for i, ids in enumerate(out):
        if not ids:
            raise RequestError(400, f"{param}[{i}] must not be empty", param)
        if len(ids) > ctx.max_model_len:
            raise RequestError(400, f"{param}[{i}] has {len(ids)} tokens, more than max_model_len "
                               f"{ctx.max_model_len} (truncate_prompt_tokens cuts it)", param)  # fmt: skip
    return out


def cut_encoding(hf, text: str, enc, keep: int):
    """`enc` (of `text`, without special tokens) cut to its first `keep` tokens. Not by its own `truncate` alone: that
    keeps every cut-off piece as an overflow, which post-processing then walks holding the GIL (1.4 s for 12 MB).
    Instead a prefix of the text, grown until it has a few tokens past the cut, is encoded and cut, where its first
    `keep` tokens are enc's (else enc is cut)."""
    if len(enc) > keep + 8:
        n = 4 * (keep + 8)
        while n < len(text):
            short = hf.encode(text[:n], add_special_tokens=False)
            if len(short) > keep + 8:
                if short.ids[:keep] == enc.ids[:keep]:
                    enc = short
                break
            n *= 4
    enc.truncate(keep)
    return enc


def embedding_body(req: EmbeddingRequest, rows: np.ndarray, model: str, tokens: int) -> dict:
    as_base64 = req.encoding_format == "base64"
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(row.tobytes()).decode() if as_base64 else row.tolist()}
            for i, row in enumerate(rows)]  # fmt: skip
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def embeddings(http, request: web.Request) -> web.Response:
    """`http`: the HttpActor (its pooling ledger, readiness, parser)."""
    arrival = time.monotonic()
    http.check_available()
    if http.pooling.facts.labels:
        raise RequestError(400, f"{request.path} is not served: this model is a cross-encoder (/score, /rerank and "
                           "/classify are)", "endpoint")  # fmt: skip
    request[REQUEST_ID] = rid = new_request_id("embd")
    dims = tuple(http.pooling.facts.dimensions)
    req, msg = await http.parse_body(request, lambda body, ctx, _: parse_embeddings(body, ctx, rid, dims), rid)
    http.check_available()  # (the engine may have died while we parsed)
    tokens = sum(map(len, msg.inputs))
    user = f", user {req.user!r}" if req.user else ""
    log.info("[%s] %s: %d inputs, %d tokens%s", rid, request.path, len(msg.inputs), tokens, user)
    rows = await http.pooling.run(msg, arrival)
    body = await http.off_loop(rows.nbytes > 1 << 18, embedding_body, req, rows, req.model or http.names[0], tokens)
    return json_response(body)

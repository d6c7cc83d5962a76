"""`POST /v1/embeddings` (OpenAI's shape, vLLM's extras) for a model served for pooling (issue 52).

Body: `input` a string, a list of strings, a list of token ids or a list of lists of them (at most MAX_INPUTS, none
empty); `encoding_format` "float" or "base64" (float32 little-endian, as the openai client decodes it);
`dimensions` (matryoshka models only: the sizes their config.json declares, else a 400 naming it);
`truncate_prompt_tokens` (vLLM's: an input longer than this many tokens is cut to it, its special tokens kept; -1:
max_model_len; without it a longer input than max_model_len is a 400); `normalize` (vLLM's: over the model's
pooling config); `add_special_tokens` (default true); `user` (logged with the request). A text is bounded by its
length in characters before it is tokenized.

The request ledger (`pending`: id -> the PoolRequest sent and the handler's future). Cases (state x event):
  pending  PoolOutput of its copy      -> answered (an error: a 500 naming it); another copy's: stale, dropped
  pending  handler cancelled (client gone) -> Abort to the engine, forgotten (a later PoolOutput / AbortAck: dropped)
  pending  ActorDown(engine), restarting at once -> kept; ActorUp(engine) -> sent again as the next copy
  pending  ActorDown(engine) with a back-off -> failed now (503)
  pending  Shutdown                    -> Abort(shutdown); AbortAck or PoolOutput -> answered 503 / as it came
"""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import Literal

import msgspec
import numpy as np
from aiohttp import web

from frontend.body import RequestError, decode_body, token_ids
from frontend.budget import check_chars
from frontend.http_base import REQUEST_ID, json_response
from frontend.protocol import new_request_id
from messages.names import SCHEDULER
from messages.pooling import PoolOutput, PoolRequest
from messages.wire import Abort, AbortAck, ActorDown, ActorUp

log = logging.getLogger("sluice.http")

MAX_INPUTS = 2048  # inputs per request (OpenAI's limit)
SHAPES = "a string, a list of strings, a list of token ids, or a list of lists of token ids"


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: str | list
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    add_special_tokens: bool | None = None


class Pending(msgspec.Struct):
    msg: PoolRequest
    answer: asyncio.Future


def parse_embeddings(body: bytes, ctx, rid: str, dimensions: tuple[int, ...]) -> tuple[EmbeddingRequest, PoolRequest]:
    """The request and what the engine is sent, or a RequestError (400) naming the field at fault."""
    req = decode_body(body, EmbeddingRequest)
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
    inputs = encode_inputs(req.input, ctx, cut, req.add_special_tokens is not False)
    for i, ids in enumerate(inputs):
        if len(ids) > ctx.max_model_len:
            raise RequestError(400, f"input[{i}] has {len(ids)} tokens, more than max_model_len {ctx.max_model_len} "
                               "(truncate_prompt_tokens cuts it)", "input")  # fmt: skip
    msg = PoolRequest(request_id=rid, inputs=inputs, normalize=req.normalize, dimensions=req.dimensions)
    return req, msg


def encode_inputs(value, ctx, cut: int | None, special: bool) -> list[list[int]]:
    """The inputs' token ids, each cut to `cut` tokens where given (a text's content is cut, its special tokens
    kept, as sentence-transformers' truncation; token ids: the first `cut`)."""
    if not value:
        raise RequestError(400, "input must not be empty", "input")
    items = [value] if isinstance(value, str) or token_ids(value) is not None else value
    if len(items) > MAX_INPUTS:
        raise RequestError(400, f"input: {len(items)} inputs, more than the {MAX_INPUTS} allowed", "input")
    hf, out, texts = ctx.tokenizer.hf, [], []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise RequestError(400, f"input[{i}] must not be empty", "input")
            if cut is None:
                check_chars(len(item), ctx, "input")
            texts.append(i)
            out.append(item)
        elif (ids := token_ids(item)) is not None:
            if (bad := next((t for t in ids if not 0 <= t < ctx.vocab_size), None)) is not None:
                raise RequestError(400, f"input[{i}]: token id {bad} is outside the vocabulary [0, {ctx.vocab_size})",
                                   "input")  # fmt: skip
            out.append(ids[:cut] if cut else ids)
        else:
            raise RequestError(400, f"input must be {SHAPES}", "input")
    encodings = hf.encode_batch_fast([out[i] for i in texts], add_special_tokens=False) if texts else []
    extra = hf.num_special_tokens_to_add(False) if special else 0
    for i, enc in zip(texts, encodings, strict=True):
        if cut is not None:
            enc.truncate(max(cut - extra, 0))
        out[i] = hf.post_process(enc, add_special_tokens=special).ids
    for i, ids in enumerate(out):
        if not ids:
            raise RequestError(400, f"input[{i}] must not be empty", "input")
    return out


def embedding_body(req: EmbeddingRequest, out: PoolOutput, model: str, tokens: int) -> dict:
    rows = np.frombuffer(out.data, dtype="<f4").reshape(-1, out.dim)
    as_base64 = req.encoding_format == "base64"
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(row.tobytes()).decode() if as_base64 else row.tolist()}
            for i, row in enumerate(rows)]  # fmt: skip
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


class EmbeddingEndpoints:
    def __init__(self, http, dimensions: tuple[int, ...]) -> None:
        """`http`: the HttpActor (its context, readiness, tell); `dimensions`: the model's matryoshka sizes."""
        self.http, self.dimensions = http, dimensions
        self.pending: dict[str, Pending] = {}

    def serve(self, app: web.Application) -> None:
        app.router.add_post("/v1/embeddings", self.embeddings)

    def handlers(self) -> dict:
        return {PoolOutput: self.on_output, AbortAck: self.on_ack}

    def on_output(self, msg: PoolOutput) -> None:
        p = self.pending.get(msg.request_id)
        if p is not None and p.msg.attempt == msg.attempt and not p.answer.done():
            p.answer.set_result(msg)

    def on_ack(self, msg: AbortAck) -> None:
        self.on_output(PoolOutput(request_id=msg.request_id, attempt=msg.attempt, error=f"aborted ({msg.reason})"))

    def on_down(self, msg: ActorDown) -> None:
        if msg.actor == SCHEDULER and msg.retry_in_s > 0:
            for rid in list(self.pending):
                self.on_output(PoolOutput(request_id=rid, attempt=self.pending[rid].msg.attempt,
                                          error=f"the engine keeps failing: restarting in {msg.retry_in_s:.0f} s"))  # fmt: skip

    def on_up(self, msg: ActorUp) -> None:
        if msg.actor == SCHEDULER:
            for p in self.pending.values():  # (what it held is gone: each is sent again, as the next copy)
                p.msg = msgspec.structs.replace(p.msg, attempt=p.msg.attempt + 1)
                self.http.tell(SCHEDULER, p.msg)

    def abort_all(self, reason: str) -> None:
        for p in self.pending.values():
            self.http.tell(SCHEDULER, Abort(request_id=p.msg.request_id, reason=reason))

    async def embeddings(self, request: web.Request) -> web.Response:
        http = self.http
        http.check_available()
        request[REQUEST_ID] = rid = new_request_id("embd")
        req, msg = await http.parse_body(
            request, lambda body, ctx, _: parse_embeddings(body, ctx, rid, self.dimensions), rid
        )
        http.check_available()  # (the engine may have died while we parsed)
        tokens = sum(map(len, msg.inputs))
        user = f", user {req.user!r}" if req.user else ""
        log.info("[%s] %s: %d inputs, %d tokens%s", rid, request.path, len(msg.inputs), tokens, user)
        self.pending[rid] = p = Pending(msg, asyncio.get_running_loop().create_future())
        http.tell(SCHEDULER, msg)
        out: PoolOutput | None = None
        try:
            out = await p.answer
        finally:
            del self.pending[rid]
            if out is None:  # the client went away (the handler was cancelled, and the future with it)
                http.tell(SCHEDULER, Abort(request_id=rid, reason="client"))
            http.moved()
        if out.error is not None:
            status = 503 if out.error.startswith(("aborted", "the engine keeps")) else 500
            raise RequestError(status, f"the embedding failed: {out.error}")
        body = await http.off_loop(
            len(out.data) > 1 << 18, embedding_body, req, out, req.model or http.names[0], tokens
        )
        return json_response(body)

"""Scoring, reranking and classification: vLLM's pooling API for a model served for pooling (issue 52).

| endpoint                         | body                                        | answer                                     |
|----------------------------------|---------------------------------------------|--------------------------------------------|
| /score, /v1/score                | text_1, text_2 (or queries, documents): a   | a score per pair                           |
|                                  | string or a list each: one against each of  |                                            |
|                                  | the other, else pair by pair                |                                            |
| /rerank, /v1/rerank, /v2/rerank  | query, documents, top_n (0: all),           | results by relevance_score, best first,    |
|                                  | return_documents (default true)             | each with its index (Jina's, Cohere's)     |
| /classify                        | input: a string or a list of strings        | each input's label and probabilities       |

A pair's score: a cross-encoder's (BertForSequenceClassification, one label) logit over "[CLS] a [SEP] b [SEP]" with
segments 0 and 1, through a sigmoid where sentence-transformers' CrossEncoder applies one (`use_activation` false:
the logit); an embedder's: the cosine of the two texts' embeddings. /classify needs a cross-encoder: softmax over its
labels (one label: sigmoid; `use_activation` false: the logits). `truncate_prompt_tokens` cuts a pair as
sentence-transformers does (longest first) or a text; without it an input longer than max_model_len is a 400.
"""

from __future__ import annotations

import time

import msgspec
import numpy as np
from aiohttp import web

from frontend.body import RequestError, decode_body
from frontend.budget import check_chars
from frontend.embeddings import MAX_INPUTS, cut_encoding, encode_inputs
from frontend.http_base import REQUEST_ID, json_response
from frontend.protocol import new_request_id
from messages.pooling import PoolRequest

Texts = str | list[str] | None
INLINE_CHARS = 16 << 10  # texts longer in all are tokenized off the event loop


def chars(texts: list) -> int:
    return sum(len(t) if isinstance(t, str) else chars(t) for t in texts)


class Scoring(msgspec.Struct, kw_only=True):
    model: str | None = None
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None


class ScoreRequest(Scoring, kw_only=True):
    text_1: Texts = None
    text_2: Texts = None
    queries: Texts = None
    documents: Texts = None


class RerankRequest(Scoring, kw_only=True):
    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool | None = None


class ClassifyRequest(Scoring, kw_only=True):
    input: str | list[str]


def texts(value: Texts, param: str) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not items:
        raise RequestError(400, f"{param} must be a string or a list of strings, not empty", param)
    if len(items) > MAX_INPUTS:
        raise RequestError(400, f"{param}: {len(items)} texts, more than the {MAX_INPUTS} allowed", param)
    if (i := next((i for i, t in enumerate(items) if not t), None)) is not None:
        raise RequestError(400, f"{param}[{i}] must not be empty", param)
    return items


def pairs(first: list[str], second: list[str], names: tuple[str, str]) -> list[tuple[str, str]]:
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise RequestError(400, f"{names[0]} has {len(first)} texts and {names[1]} {len(second)}: give one, or as "
                           "many as the other", names[1])  # fmt: skip
    return list(zip(first, second, strict=True))


def cut_of(req: Scoring, ctx) -> int | None:
    k = req.truncate_prompt_tokens
    if k is not None and not (k == -1 or 1 <= k <= ctx.max_model_len):
        raise RequestError(
            400, f"truncate_prompt_tokens must be -1 or 1 .. {ctx.max_model_len}", "truncate_prompt_tokens"
        )
    return ctx.max_model_len if k == -1 else k


def longest_first(n1: int, n2: int, room: int) -> tuple[int, int]:
    """The tokens a pair keeps of each text when it has more than `room` (the tokenizers library's LongestFirst,
    which sentence-transformers' CrossEncoder truncates by): the longer cut to what the shorter leaves, or, where the
    shorter takes more than half, the shorter to half the room and the longer to the rest."""
    swap = n1 > n2
    short, long = (n2, n1) if swap else (n1, n2)
    long = short if short > room else max(short, room - short)
    if short + long > room:
        short, long = room // 2, room // 2 + room % 2
    return (long, short) if swap else (short, long)


def pair_inputs(texts: list[tuple[str, str]], ctx, cut: int | None, param: str) -> tuple[list, list]:
    """Each pair's token ids and segments, as the tokenizer's pair template makes them; a pair over `cut` tokens
    loses tokens from its longer text first (`longest_first`)."""
    hf = ctx.tokenizer.hf
    for a, b in texts if cut is None else ():
        check_chars(len(a) + len(b), ctx, param, room=0)
    encodings = hf.encode_batch_fast([t for pair in texts for t in pair], add_special_tokens=False)
    room = None if cut is None else max(cut - hf.num_special_tokens_to_add(True), 0)
    ids, types = [], []
    for i, (a, b) in enumerate(zip(encodings[::2], encodings[1::2], strict=True)):
        if room is not None and len(a) + len(b) > room:
            keep = longest_first(len(a), len(b), room)
            a, b = (cut_encoding(hf, t, e, k) for t, e, k in zip(texts[i], (a, b), keep, strict=True))
        enc = hf.post_process(a, b, add_special_tokens=True)
        if len(enc.ids) > ctx.max_model_len:
            raise RequestError(400, f"{param}[{i}]: the pair has {len(enc.ids)} tokens, more than max_model_len "
                               f"{ctx.max_model_len} (truncate_prompt_tokens cuts it)", param)  # fmt: skip
        ids.append(enc.ids)
        types.append(enc.type_ids)
    return ids, types


async def pair_scores(
    http, rid: str, req: Scoring, both: list[tuple[str, str]], param: str, arrival: float
) -> tuple[np.ndarray, int]:
    """Each pair's score, and the tokens the engine read (`arrival`: the request's, time.monotonic())."""
    facts, ctx = http.pooling.facts, http.ctx
    cut = cut_of(req, ctx)
    if facts.labels:
        if len(facts.labels) != 1:
            raise RequestError(400, f"this model classifies into {len(facts.labels)} labels: a score needs one "
                               "(/classify answers it)", "model")  # fmt: skip
        ids, types = await http.off_loop(chars(both) > INLINE_CHARS, pair_inputs, both, ctx, cut, param)
        logits = (await http.pooling.run(PoolRequest(request_id=rid, inputs=ids, token_type_ids=types), arrival))[:, 0]
        sigmoid = facts.score_sigmoid and req.use_activation is not False
        return (1 / (1 + np.exp(-logits.astype(np.float64))) if sigmoid else logits), sum(map(len, ids))
    unique = list(dict.fromkeys(t for pair in both for t in pair))
    ids = await http.off_loop(
        chars(unique) > INLINE_CHARS, encode_inputs, unique, ctx, cut, True, param, 2 * MAX_INPUTS
    )
    rows = await http.pooling.run(PoolRequest(request_id=rid, inputs=ids, normalize=True), arrival)
    at = {t: rows[i].astype(np.float64) for i, t in enumerate(unique)}
    return np.array([at[a] @ at[b] for a, b in both]), sum(map(len, ids))


async def parsed(http, request: web.Request, kind: type, prefix: str):
    """(its id, the request decoded, its arrival: time.monotonic())"""
    arrival = time.monotonic()
    http.check_available()
    request[REQUEST_ID] = rid = new_request_id(prefix)
    req = await http.parse_body(request, lambda body, ctx, _: decode_body(body, kind), rid)
    if req.model and not http.ctx.knows(req.model):
        raise RequestError(404, f"The model `{req.model}` does not exist.", "model", code="model_not_found")
    return rid, req, arrival


def usage(tokens: int) -> dict:
    return {"prompt_tokens": tokens, "total_tokens": tokens}


async def score(http, request: web.Request) -> web.Response:
    rid, req, arrival = await parsed(http, request, ScoreRequest, "score")
    names = ("text_1", "text_2") if req.queries is None and req.documents is None else ("queries", "documents")
    both = pairs(texts(getattr(req, names[0]), names[0]), texts(getattr(req, names[1]), names[1]), names)
    got, tokens = await pair_scores(http, rid, req, both, names[1], arrival)
    data = [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(got)]
    return json_response({"id": rid, "object": "list", "created": int(time.time()), "model": req.model or http.names[0],
                          "data": data, "usage": usage(tokens)})  # fmt: skip


async def rerank(http, request: web.Request) -> web.Response:
    rid, req, arrival = await parsed(http, request, RerankRequest, "rerank")
    docs = texts(req.documents, "documents")
    if req.top_n is not None and req.top_n < 0:
        raise RequestError(400, "top_n must be 0 (all) or more", "top_n")
    got, tokens = await pair_scores(http, rid, req, pairs(texts(req.query, "query"), docs, ("query", "documents")),
                                    "documents", arrival)  # fmt: skip
    order = sorted(range(len(docs)), key=lambda i: -got[i])[: req.top_n or None]
    keep = req.return_documents is not False
    results = [{"index": i, "relevance_score": float(got[i])} | ({"document": {"text": docs[i]}} if keep else {})
               for i in order]  # fmt: skip
    return json_response({"id": rid, "model": req.model or http.names[0], "usage": usage(tokens), "results": results})


async def classify(http, request: web.Request) -> web.Response:
    rid, req, arrival = await parsed(http, request, ClassifyRequest, "classify")
    labels = http.pooling.facts.labels
    if not labels:
        raise RequestError(
            400, f"{request.path} is not served: this model is an embedder, not a classifier", "endpoint"
        )
    items = texts(req.input, "input")
    cut = cut_of(req, http.ctx)
    ids = await http.off_loop(chars(items) > INLINE_CHARS, encode_inputs, items, http.ctx, cut, True)
    logits = (await http.pooling.run(PoolRequest(request_id=rid, inputs=ids), arrival)).astype(np.float64)
    if req.use_activation is not False:
        logits = 1 / (1 + np.exp(-logits)) if len(labels) == 1 else np.exp(logits - logits.max(1, keepdims=True))
        logits = logits if len(labels) == 1 else logits / logits.sum(1, keepdims=True)
    data = [{"index": i, "label": labels[int(row.argmax())], "probs": row.tolist(), "num_classes": len(labels)}
            for i, row in enumerate(logits)]  # fmt: skip
    return json_response({"id": rid, "object": "list", "created": int(time.time()), "model": req.model or http.names[0],
                          "data": data, "usage": usage(sum(map(len, ids)))})  # fmt: skip

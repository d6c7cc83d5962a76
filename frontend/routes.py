"""The HTTP actor's routes, by the runner its model is served for: generation (completions, chat, the Responses API,
LoRA adapters at runtime) or pooling (embeddings, scores, reranking, classes: frontend/embeddings.py, scoring.py); an endpoint of the other runner answers a
400 naming it. Both: the model list, tokenization, version, OpenAPI, health and metrics."""

from __future__ import annotations

import functools

from aiohttp import web

from frontend import scoring
from frontend.body import RequestError
from frontend.embeddings import embeddings
from frontend.http_base import json_response
from frontend.openapi import openapi
from frontend.responses_api.endpoint import ResponsesEndpoint
from frontend.tokenize import detokenize, model_card, server_version, tokenize

GENERATE = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
POOLING = {
    ("/v1/embeddings",): embeddings,
    ("/score", "/v1/score"): scoring.score,
    ("/rerank", "/v1/rerank", "/v2/rerank"): scoring.rerank,
    ("/classify",): scoring.classify,
}


def not_served(runner: str, other: str):
    async def refuse(request: web.Request) -> web.Response:
        raise RequestError(400, f"{request.path} is not served: this model is served for {runner} (sluice serve "
                           f"--runner {other} serves it for that, where the model can be)", "endpoint")  # fmt: skip

    return refuse


def add_routes(app: web.Application, http) -> None:
    """`http`: the HttpActor (its handlers and endpoints)."""
    r = app.router
    if http.pooling is not None:
        for paths, handler in POOLING.items():
            for path in paths:
                r.add_post(path, functools.partial(handler, http))
        for path in GENERATE:
            r.add_post(path, not_served("pooling", "generate"))
    else:
        r.add_post("/v1/completions", http.completions)
        r.add_post("/v1/chat/completions", http.chat)
        http.responses = ResponsesEndpoint(http)
        http.responses.serve(app)  # (its store opens in the background: one that cannot costs only its routes)
        if http.lora_api:
            http.lora_api.serve(app)
        for path in (p for paths in POOLING for p in paths):
            r.add_post(path, not_served("generation", "pooling"))
    r.add_get("/v1/models", functools.partial(models, http))
    r.add_get("/v1/models/{model}", functools.partial(card, http))
    r.add_post("/tokenize", functools.partial(parsed, http, tokenize))
    r.add_post("/detokenize", functools.partial(parsed, http, detokenize))
    r.add_get("/version", lambda _: json_response(server_version()))
    r.add_get("/openapi.json", lambda _: json_response(openapi(bool(http.config.api_key))))
    r.add_get("/health", http.health)
    r.add_get("/metrics", http.group.metrics)


async def models(http, request: web.Request) -> web.Response:
    cards = [model_card(name, http.ctx, http.created, http.model) for name in [*http.ctx.model_names, *http.loras]]
    return json_response({"object": "list", "data": cards})


async def card(http, request: web.Request) -> web.Response:
    return json_response(model_card(request.match_info["model"], http.ctx, http.created, http.model))


async def parsed(http, parse, request: web.Request) -> web.Response:
    """/tokenize, /detokenize: `parse(body, ctx)`'s answer."""
    return json_response(await http.parse_body(request, lambda body, ctx, _: parse(body, ctx), None))

"""GET /openapi.json: an OpenAPI 3.1 description of every endpoint. The request bodies' schemas are generated from
the msgspec Structs the server decodes them with (frontend/fields.py, frontend/tokenize.py), so the description
cannot drift from what is accepted; fields refused with a 400 (frontend.fields' NOT_HONOURED lists) are absent.
Errors share OpenAI's body: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import functools
import re

import msgspec

from frontend.embeddings import EmbeddingRequest
from frontend.fields import ChatCompletionRequest, CompletionRequest
from frontend.responses_api.fields import ResponsesRequest
from frontend.scoring import ClassifyRequest, RerankRequest, ScoreRequest
from frontend.tokenize import DetokenizeRequest, TokenizeRequest, server_version

REF = "#/components/schemas/{name}"
BODIES = [CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeRequest, DetokenizeRequest,
          EmbeddingRequest, ScoreRequest, RerankRequest, ClassifyRequest]  # fmt: skip
# (method, path, summary, request body, needs the API key)
ENDPOINTS = [
    ("post", "/v1/completions", "Completions: OpenAI's API with vLLM's extras", CompletionRequest, True),
    ("post", "/v1/chat/completions", "Chat completions: OpenAI's API with vLLM's extras", ChatCompletionRequest, True),
    (
        "post",
        "/v1/responses",
        "Responses: OpenAI's API (stream, store, background) with chat's extras",
        ResponsesRequest,
        True,
    ),
    (
        "get",
        "/v1/responses/{id}",
        "A response; ?stream=true&starting_after=N: a background run's events after N",
        None,
        True,
    ),
    ("delete", "/v1/responses/{id}", "Forget a response (a background run still going is cancelled)", None, True),
    ("post", "/v1/responses/{id}/cancel", "Cancel a background response (its output so far is kept)", None, True),
    ("get", "/v1/responses/{id}/input_items", "The items a response was given (limit, order, after)", None, True),
    (
        "post",
        "/v1/embeddings",
        "Embeddings (a model served for pooling): OpenAI's API with vLLM's extras",
        EmbeddingRequest,
        True,
    ),
    ("post", "/score", "vLLM's /score (also /v1/score): a score per text pair", ScoreRequest, True),
    ("post", "/rerank", "Jina's and Cohere's rerank (also /v1/rerank, /v2/rerank)", RerankRequest, True),
    ("post", "/classify", "vLLM's /classify: a cross-encoder's labels", ClassifyRequest, True),
    ("get", "/v1/models", "The served model and its aliases", None, True),
    ("get", "/v1/models/{model}", "One model's card (404 for an unknown id)", None, True),
    ("post", "/tokenize", "vLLM's /tokenize: a prompt or a chat to token ids", TokenizeRequest, False),
    ("post", "/detokenize", "vLLM's /detokenize: token ids to text", DetokenizeRequest, False),
    ("get", "/version", "The server's version", None, False),
    ("get", "/health", "200 once every replica has loaded, while the path is up; else 503", None, False),
    ("get", "/metrics", "Prometheus metrics (vLLM's names, under --metrics-prefix)", None, False),
    ("get", "/openapi.json", "This description", None, False),
]
ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {k: {"type": ["string", "null"]} for k in ("message", "type", "param", "code")},
            "required": ["message", "type"],
        }
    },
}


@functools.cache
def openapi(api_key: bool) -> dict:
    """The description (built once): `api_key`, the /v1 endpoints require a bearer token."""
    refs, schemas = msgspec.json.schema_components(BODIES, ref_template=REF)
    body_ref = dict(zip(BODIES, refs, strict=True))
    paths: dict[str, dict] = {}
    for method, path, summary, body, guarded in ENDPOINTS:
        op: dict = {"summary": summary, "responses": _responses(body is not None or "{" in path)}
        if body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body_ref[body]}}}
        if names := re.findall(r"\{(\w+)\}", path):
            op["parameters"] = [
                {"name": n, "in": "path", "required": True, "schema": {"type": "string"}} for n in names
            ]
        if guarded and api_key:
            op["security"] = [{"bearer": []}]
        paths.setdefault(path, {})[method] = op
    components = {"schemas": {**schemas, "ErrorResponse": ERROR}}
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    info = {"title": "Sluice", "version": server_version()["version"], "description": "An OpenAI-compatible server"}
    return {"openapi": "3.1.0", "info": info, "paths": paths, "components": components}


def _responses(can_fail: bool) -> dict:
    error = {"content": {"application/json": {"schema": {"$ref": REF.format(name="ErrorResponse")}}}}
    out = {"200": {"description": "OK (JSON, or text/event-stream when `stream` is true)"}}
    if can_fail:
        out["400"] = {"description": "A bad request: the error names the field", **error}
        out["404"] = {"description": "An unknown model or response", **error}
    return out

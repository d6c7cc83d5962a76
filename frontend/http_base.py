"""What every HTTP call passes through: the server's configuration, the API key check, a JSON content type on POSTs,
errors turned into OpenAI error bodies (and logged with the request id: 5xx as errors, a 5xx is a bug or a dead actor,
never the client's fault; a 503 the client should retry, or a 429 past a limit, carries Retry-After: `Unavailable`),
and a count of every response by endpoint and status."""

from __future__ import annotations

import hmac
import logging
import re
from pathlib import Path

import msgspec
from aiohttp import web

from actors.routing import Policy
from frontend.metrics import SERVER, Metrics
from frontend.protocol import RequestError
from messages.sampling_params import RequestLimits

log = logging.getLogger("sluice.http")

REQUEST_ID = web.RequestKey("sluice_request_id", str)  # set once the handler has named the request
STREAM_ERROR = web.RequestKey("sluice_stream_error", RequestError)  # an error sent inside a 200 stream

_encode = msgspec.json.Encoder().encode
GUARDED = ("/v1/", "/v2/", "/score", "/rerank", "/classify")  # the paths --api-key guards: the API's, the model's work
MAX_ROW_BYTES = 8 << 20  # a stored response's row at most (the Responses store's bound: responses_api/store.py)
MAX_STORE_BYTES = 1 << 30  # the Responses store's rows at most


class HttpConfig(msgspec.Struct, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 8000  # 0: the launcher picks a free one before spawning (stable across restarts)
    served_model_name: list[str] = []  # default: the model directory's name
    api_key: str | None = None  # required as `Authorization: Bearer <key>` on GUARDED paths (/v1/*, pooling's)
    max_body_bytes: int = 16 << 20
    body_timeout_s: float = 30.0  # a request body must arrive within this
    abort_timeout_s: float = 5.0  # I7: an Abort without a Finished is re-sent after this
    max_abort_tries: int = 3
    drain_timeout_s: float = 5.0  # shutdown waits this long for in-flight requests to finish
    limits: RequestLimits = RequestLimits()  # per-request sizes (stop strings, bad words, ...)
    chat_template: str | None = None  # replaces the model's own (--chat-template FILE)
    tool_call_parser: str | None = None  # set (with --enable-auto-tool-choice): tool_choice "auto" is honoured
    reasoning_parser: str | None = None  # --reasoning-parser: chat outputs' <think> block split out as reasoning
    grammar_timeout_s: float = 10.0  # a structured output's spec must compile within this
    max_resumes: int = 2  # DESIGN I8: a request live at more detokenizer deaths fails (the engine judges its own)
    metrics_prefix: str = "sluice:"  # of /metrics series (--metrics-prefix vllm: for dashboards built for vLLM)
    dp_routing: Policy = "cache_aware"  # which engine replica a request goes to (actors/routing.py)
    log_stats_interval_s: float = 10.0  # a throughput line per replica this often while serving (0: none)
    stream_interval: int = 1  # a stream's writer wakes at each choice's first token, then each this many of a choice
    responses_db: str | None = None  # the Responses API's store, SQLite (default: responses.sqlite3 in the cache)
    responses_max_stored: int = 10_000  # stored responses kept at most (the oldest go first)
    responses_max_age_s: float = 30 * 86400.0  # ... and for at most this long (OpenAI's 30 days)
    responses_max_bytes_per_response: int = MAX_ROW_BYTES  # a stored response's row at most
    responses_max_store_bytes: int = MAX_STORE_BYTES  # the store's rows at most (the oldest go first)
    max_background_responses: int = 128  # background responses live at once (a 429 past it)
    lora_runtime_updates: bool = False  # --enable-lora-runtime-updates: adapters loaded while serving (lora_api.py)
    # HTTP servers (processes) on the port (--api-server-count: frontend/http_servers.py); 0: chosen as the server
    # starts, by the device (frontend/preflight.py, server_count)
    api_server_count: int = 1

    @property
    def responses_path(self) -> Path:
        from gpu.loading.convert import cache_dir

        return Path(self.responses_db) if self.responses_db else cache_dir() / "responses.sqlite3"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


_JSON = re.compile(r"application/(?:[\w.-]+\+)?json|application/octet-stream")


def check_json(request: web.Request) -> None:
    """A POST's body must say it is JSON, or nothing (no type, or application/octet-stream: what HTTP libraries
    send for raw bytes); a form or text body is a 415, as vLLM's."""
    given = request.headers.get("Content-Type")
    if given is not None and not _JSON.fullmatch(given.split(";", 1)[0].strip().lower()):
        raise RequestError(415, f"Content-Type must be application/json, not {given!r}", code="unsupported_media_type")


def json_response(body: dict, status: int = 200) -> web.Response:
    return web.Response(body=_encode(body), status=status, content_type="application/json")


class Unavailable(RequestError):
    """An error the client should retry, with `Retry-After`: a 503 (the server loads its model, an engine replica
    restarts, the Responses store cannot be used) or a 429 (`status`: too many background responses)."""

    def __init__(self, message: str, retry_after_s: int, status: int = 503, **fields):
        super().__init__(status, message, **fields)  # (fields: RequestError's param, type, code)
        self.retry_after_s = retry_after_s


def error_response(e: RequestError) -> web.Response:
    resp = json_response(e.body(), e.status)
    if isinstance(e, Unavailable):
        resp.headers["Retry-After"] = str(e.retry_after_s)
    return resp


PROXIED = "X-Sluice-Proxied"  # a call another HTTP server proxied here: answered here, counted there (http_servers.py)


def proxied(request: web.Request) -> bool:
    """A call another HTTP server proxied here: PROXIED, on the run directory's socket (a client's is ignored); decided
    as the call arrives (the middleware asks first), while its transport is there."""
    if (known := request.get(PROXIED)) is None:
        transport = request.transport
        known = request[PROXIED] = PROXIED in request.headers and (
            transport is not None and isinstance(transport.get_extra_info("sockname"), str)
        )
    return known


def middleware(config: HttpConfig, metrics: Metrics):
    @web.middleware
    async def checked(request: web.Request, handler) -> web.StreamResponse:
        from_server = proxied(request)
        try:
            if config.api_key and request.path.startswith(GUARDED):
                given = request.headers.get("Authorization", "").encode("utf-8", "replace")
                if not hmac.compare_digest(given, f"Bearer {config.api_key}".encode()):
                    raise RequestError(401, "Invalid or missing API key", code="invalid_api_key")
            if request.method == "POST" and request.content_length != 0 and request.match_info.http_exception is None:
                # (every POST endpoint takes JSON, or nothing; an unknown route is a 404 whatever its body)
                check_json(request)
            resp = await handler(request)
            error = request.get(STREAM_ERROR)
        except RequestError as e:
            resp, error = error_response(e), e
        except web.HTTPException as e:  # unknown route (404), wrong method (405), body too large (413)
            if e.status < 400:
                raise
            error = RequestError(e.status, e.text or e.reason)
            resp = error_response(error)
        except Exception:
            log.exception("[%s] %s %s failed", request.get(REQUEST_ID, "-"), request.method, request.path)
            error = RequestError(500, "internal server error")
            resp = error_response(error)
        if error is not None:
            level = logging.ERROR if error.status >= 500 else logging.INFO
            rid = request.get(REQUEST_ID, "-")
            log.log(level, "[%s] %s %s: %d %s", rid, request.method, request.path, error.status, error.message)
        route = request.match_info.route.resource
        endpoint = route.canonical if route is not None else "other"
        if not from_server:
            metrics.http_requests.labels(SERVER, endpoint, str(error.status if error else resp.status)).inc()
        return resp

    return checked

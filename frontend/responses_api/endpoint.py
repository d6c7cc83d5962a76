"""The Responses API's routes, on the HTTP actor (frontend/server.py), over its RequestTable and the store.

  POST   /v1/responses                       create: the Response (foreground), its events (stream), or at once a
                                             queued Response (background; with stream, its events follow)
  GET    /v1/responses/{id}                  the Response now (a run's, else the stored one); ?stream=true
                                             [&starting_after=N]: a background run's events after N, live or stored
  DELETE /v1/responses/{id}                  forget it (a background run still going is cancelled first)
  POST   /v1/responses/{id}/cancel           a background run ends `cancelled` (Abort -> AbortAck), output kept
  GET    /v1/responses/{id}/input_items      the items it was given: previous_response_id's conversation, then its
                                             input (limit 1..100, order asc|desc, after)

A foreground client that goes away aborts its run, as on chat; a background run goes on until it ends or is
cancelled, whoever reads it. Unknown ids are 404s in OpenAI's error shape. At most --max-background-responses
background runs live at once (each HTTP server runs its share, rounded up, of --api-server-count; a 429 with
Retry-After past it; the gauge sluice:num_background_responses). A response's id names the HTTP server running it: a
call about it on another is answered there (frontend/http_servers.py). The store
opens in the background (store.py): while it cannot be used, a call that needs it (a stored create,
previous_response_id, a read of an ended response) is a 503 naming its path and error, with Retry-After; store:
false runs and live runs need none of it.
"""

from __future__ import annotations

import logging
import uuid

from aiohttp import web

from frontend.body import RequestError
from frontend.http_base import REQUEST_ID, Unavailable, error_response, json_response
from frontend.responses_api.request import ResponsesCall, decode_responses, responses_call
from frontend.responses_api.runs import ResponseRun, drive
from frontend.responses_api.store import ResponseStore
from frontend.responses_api.writer import ResponseWriter
from frontend.structured import compile_check

log = logging.getLogger("sluice.http")

MAX_ITEMS_PAGE = 100
BACKGROUND_RETRY_S = 5  # Retry-After of the 429 past --max-background-responses (a run ends in seconds to minutes)


class ResponsesEndpoint:
    def __init__(self, actor):
        self.actor = actor  # the HttpActor: its config, table, context, metrics, body parsing and owned tasks
        c = actor.config
        self.store = ResponseStore(c.responses_path, c.responses_max_stored, c.responses_max_age_s,
                                   c.responses_max_store_bytes, c.responses_max_bytes_per_response,
                                   own_dir=c.responses_db is None)  # fmt: skip
        self.runs: dict[str, ResponseRun] = {}  # runs not yet ended (and stored)
        self.max_background = -(-c.max_background_responses // c.api_server_count)  # (this server's share)
        actor.metrics.num_background_responses = self.num_background

    def num_background(self) -> int:
        return sum(run.call.background for run in self.runs.values())

    def serve(self, app: web.Application) -> None:
        """The routes, and the store opened in the background."""
        self.actor.spawn(self.store.open())
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{id}", self.retrieve)
        app.router.add_delete("/v1/responses/{id}", self.delete)
        app.router.add_post("/v1/responses/{id}/cancel", self.cancel)
        app.router.add_get("/v1/responses/{id}/input_items", self.input_items)

    # ------------------------------------------------------------ create

    async def create(self, request: web.Request) -> web.StreamResponse:
        actor = self.actor
        actor.check_available()
        # (OpenAI's shape of a response id; its first byte names the server that runs it: frontend/http_servers.py)
        request[REQUEST_ID] = rid = f"resp_{actor.group.index:02x}{uuid.uuid4().hex[2:]}"
        body = await actor.parse_body(request, decode_responses, rid)
        if body.store is not False:
            await self.store.ready()
        history = await self._history(body.previous_response_id)
        if history is None:  # (not ended here, nor stored: it may run on the server that made it)
            previous = body.previous_response_id
            if (proxied := await self._elsewhere(request, previous)) is not None:
                return proxied
            raise RequestError(404, f"previous response {previous!r} not found", "previous_response_id")
        large = bool(history) or actor.large(request)  # (a stored conversation may be long: rendered off the loop)
        call = await actor.off_loop(large, self._call, body, rid, history)
        parsed = call.parsed
        if parsed.grammar_param is not None:
            try:
                await compile_check(parsed.prompts[0].params.structured, parsed.grammar_param, actor.ctx)
            except RequestError as e:
                raise call.names.error(e) from e
        actor.check_available()
        if call.background and (n := self.num_background()) >= self.max_background:
            raise Unavailable(f"{n} background responses are running, the most this server runs at once "
                              "(its share of --max-background-responses); retry later", BACKGROUND_RETRY_S, 429, param="background",
                              type="rate_limit_error", code="too_many_background_responses")  # fmt: skip
        req = actor.table.add(parsed, actor.name)
        run = self.runs[rid] = ResponseRun(call, req, ResponseWriter(call, actor.ctx.tokenizer))
        actor.spawn(self._drive(run))
        mode = ", background" if call.background else ""
        log.info("[%s] %s: %d prompt tokens%s%s", rid, request.path, req.num_prompt_tokens, mode,
                 ", stream" if body.stream else "")  # fmt: skip
        if call.background and not body.stream:
            return json_response(run.writer.response())
        try:
            if body.stream:
                return await self._sse(request, run.events(-1))
            await run.ended.wait()
            if req.error is not None:
                return error_response(req.error)
            return json_response(run.writer.response())
        finally:
            if not call.background and not run.ended.is_set():  # the client went away
                run.keep = False
                actor.table.cancel(req, "client")
                actor.moved()

    async def _drive(self, run: ResponseRun) -> None:
        try:
            await drive(run, self.store)
        except Exception:  # a bug: the run fails alone (an exception here would stop the HTTP actor)
            log.exception("[%s] the response failed", run.id)
            if not run.req.done:
                self.actor.table.fail_request(run.req, RequestError(500, "the response failed"))
            run.writer.fail("the response failed")
            run.publish()
            run.ended.set()
        finally:
            del self.runs[run.id]
            self.actor.moved()

    def _call(self, body, rid: str, history: list[dict]) -> ResponsesCall:
        """The call (responses_call), refused when what it would store alone is over a stored row's budget."""
        call = responses_call(body, self.actor.ctx, rid, history)
        if call.store:
            self.store.check_size({**call.echo(), "input": call.input, "previous_response_id": call.history})
        return call

    async def _history(self, previous: str | None) -> list[dict] | None:
        """The conversation previous_response_id continues: its items and its output (within a row's budget); None
        if it is not found."""
        if previous is None:
            return []
        if previous in self.runs:
            raise RequestError(400, f"previous response {previous!r} has not ended", "previous_response_id")
        return await self.store.conversation(previous, with_output=True)

    async def _elsewhere(self, request: web.Request, rid: str) -> web.StreamResponse | None:
        """The call answered by the server running `rid` if that is another one (None: answered here)."""
        k = None if rid in self.runs else self.actor.group.owner(rid)
        return None if k is None else await self.actor.group.answered_by(request, k)

    # ------------------------------------------------------------ retrieve, delete, cancel, input items

    async def retrieve(self, request: web.Request) -> web.StreamResponse:
        rid = request[REQUEST_ID] = request.match_info["id"]
        if (proxied := await self._elsewhere(request, rid)) is not None:
            return proxied
        stream = _flag(request, "stream")
        after = _int(request, "starting_after", -1, -1)
        if (run := self.runs.get(rid)) is not None:
            if not stream:
                return json_response(run.writer.response())
            _background(run.call.background, "streamed")
            return await self._sse(request, run.events(after))
        if not stream:
            return _raw(_found(await self.store.response(rid), rid)[0])
        background, events = _found(await self.store.events(rid), rid)
        _background(background, "streamed")
        if events is None:
            raise RequestError(400, f"the stream events of {rid!r} were not stored (over its row's budget: "
                               "--responses-max-bytes-per-response)", "stream")  # fmt: skip
        return await self._sse(request, _replay(events, after))

    async def delete(self, request: web.Request) -> web.StreamResponse:
        rid = request[REQUEST_ID] = request.match_info["id"]
        if (proxied := await self._elsewhere(request, rid)) is not None:
            return proxied
        if (run := self.runs.get(rid)) is not None:
            run.keep = False
            self._cancel(run)
            await run.ended.wait()  # (its write may have begun before `keep` was cleared: deleted after it)
            await self.store.delete(rid)
        elif not await self.store.delete(rid):
            raise _not_found(rid)
        return json_response({"id": rid, "object": "response", "deleted": True})

    async def cancel(self, request: web.Request) -> web.StreamResponse:
        rid = request[REQUEST_ID] = request.match_info["id"]
        if (proxied := await self._elsewhere(request, rid)) is not None:
            return proxied
        if (run := self.runs.get(rid)) is None:
            response, background = _found(await self.store.response(rid), rid)
            _background(background, "cancelled")
            return _raw(response)  # (it has ended: as it is)
        _background(run.call.background, "cancelled")
        self._cancel(run)
        await run.ended.wait()  # (its choices ended as they were tombstoned: only the store's write is left)
        return json_response(run.writer.response())

    def _cancel(self, run: ResponseRun) -> None:
        if not run.req.done:
            run.cancelled = True
            self.actor.table.cancel(run.req, "client")
            self.actor.moved()

    async def input_items(self, request: web.Request) -> web.StreamResponse:
        rid = request[REQUEST_ID] = request.match_info["id"]
        if (proxied := await self._elsewhere(request, rid)) is not None:
            return proxied
        limit = _int(request, "limit", 20, 1, MAX_ITEMS_PAGE)
        order = request.query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise RequestError(400, "order must be asc or desc", "order")
        if request.query.get("include"):
            raise RequestError(400, "include is not supported", "include")
        run = self.runs.get(rid)
        items = run.conversation if run is not None else _found(await self.store.conversation(rid), rid)
        items = items[::-1] if order == "desc" else items
        if (after := request.query.get("after")) is not None:
            at = next((i for i, item in enumerate(items) if item.get("id") == after), None)
            if at is None:
                raise RequestError(404, f"item {after!r} not found", "after")
            items = items[at + 1 :]
        page = items[:limit]
        return json_response({
            "object": "list", "data": page, "has_more": len(items) > limit,
            "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None,
        })  # fmt: skip

    async def _sse(self, request: web.Request, chunks) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            async for chunk in chunks:
                await resp.write(chunk)
            await resp.write_eof()
        except ConnectionError:
            log.info("[%s] client disconnected", request.get(REQUEST_ID, "-"))
        return resp


async def _replay(events: list[bytes], after: int):
    yield b"".join(events[after + 1 :])


def _background(background: bool, what: str) -> None:
    if not background:
        raise RequestError(400, f"only background responses can be {what}", "background")


def _found(stored, rid: str):
    if stored is None:
        raise _not_found(rid)
    return stored


def _raw(response: bytes) -> web.Response:
    """A stored Response: its JSON as stored."""
    return web.Response(body=response, content_type="application/json")


def _not_found(rid: str) -> RequestError:
    return RequestError(404, f"Response with id {rid!r} not found.", "response_id", code="not_found")


def _flag(request: web.Request, name: str) -> bool:
    return request.query.get(name, "false").lower() in ("true", "1")


def _int(request: web.Request, name: str, default: int, low: int, high: int | None = None) -> int:
    text = request.query.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low or (high is not None and value > high):
        raise RequestError(400, f"{name} must be an integer in [{low}, {high if high is not None else '...'}]", name)
    return value

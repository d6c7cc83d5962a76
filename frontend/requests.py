"""The HTTP actor's request table: one HttpRequest per HTTP call, one Choice per engine request, in the client
party's ledger (actors/client_ledger.py: the state x event table of every output, resume and death).

What the HTTP party adds to it:
  LIVE        output                  -> buffered in its Choice; the request's writer woken (never awaited here) at
                                         the choice's first output, then each stream_interval tokens of it
  LIVE        Finished(error)         -> the HTTP request fails; its other live choices are aborted
  LIVE        a choice fails (a poison request, too many copies) -> the HTTP request fails likewise
  LIVE        client gone             -> every live choice aborted: TOMBSTONED
  LIVE        shutdown                -> Abort(shutdown) for every live choice; they stay LIVE until their Finished
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from actors.client_ledger import ClientLedger
from frontend.metrics import Metrics
from frontend.protocol import ParsedRequest, RequestError
from frontend.request_state import Choice, HttpRequest
from messages.wire import AbortReason, Finished, Msg, TextDelta

log = logging.getLogger("sluice.http")


class RequestTable(ClientLedger[Choice]):
    def __init__(
        self,
        tell: Callable[[str, Msg], None],
        metrics: Metrics,
        abort_timeout_s: float = 5.0,
        max_abort_tries: int = 3,
        max_resumes: int = 2,
        stream_interval: int = 1,
    ):
        super().__init__(tell, log, abort_timeout_s, max_abort_tries, max_resumes, metrics.protocol, metrics.replicas)
        self.metrics = metrics
        # --stream-interval (a request's stream_interval over it): tokens a choice receives before it wakes its writer
        # again (its first output, its end and an error wake it at once): fewer, larger SSE events, less HTTP work a
        # token. Counted as received, not as unwritten: text held back (a stop string's prefix) does not defeat it
        self.stream_interval = stream_interval
        metrics.num_tombstones = lambda: len(self.tombstones)

    def add(self, parsed: ParsedRequest, client: str) -> HttpRequest:
        """Register the request and send its AddRequests (its choices to one replica: they share its prompt's
        blocks); `client` is the actor that gets the text."""
        req = HttpRequest(parsed)
        msgs = req.engine_requests(client)
        replica = self.replicas.route(msgs[0])
        for c, msg in zip(req.choices, msgs, strict=True):
            self.submit(c, msg, replica=replica)
        return req

    def group(self, c: Choice) -> object:
        return c.request

    # ------------------------------------------------------------ the ledger's hooks

    def deliver(self, c: Choice, delta: TextDelta, now: float) -> None:
        first = not c.last_output
        c.append(delta.text, delta.token_ids, delta.logprobs)
        self._observe_output(c, now)
        c.unwoken += len(delta.token_ids)
        if first or c.unwoken >= (c.request.parsed.stream_interval or self.stream_interval):
            c.unwoken = 0
            c.request.wake.set()

    def finish(self, c: Choice, fin: Finished) -> None:
        c.append(fin.text, fin.token_ids, fin.logprobs)
        c.finished = fin
        now = time.monotonic()
        if fin.token_ids:
            self._observe_output(c, now)
        engine = c.record.replica.index
        self.metrics.e2e.labels(engine).observe(now - c.request.arrival)
        self.metrics.finished(fin, c.record.add.params, engine)
        siblings = c.request.siblings(c)
        if all(s.finished is not None for s in siblings):  # (vLLM observes n and the longest once per prompt)
            self.metrics.prompt_finished(len(siblings), max(s.finished.num_output_tokens for s in siblings), engine)
        self._ended(c)
        if fin.finish_reason == "error":
            log.warning("[%s] failed in the engine (%s): %s", c.engine_id, fin.error_kind, fin.error)
            self.fail_request(c.request, engine_error(fin, c.request.parsed.fields))

    def fail(self, c: Choice, status: int, error: str, abort: bool) -> None:
        self.fail_request(c.request, RequestError(status, error), abort)

    def _observe_output(self, c: Choice, now: float) -> None:
        req = c.request
        if req.first_output is None:
            req.first_output = now
            self.metrics.ttft.labels(c.record.replica.index).observe(now - req.arrival)
        elif c.last_output:
            self.metrics.itl.labels(c.record.replica.index).observe(now - c.last_output)
        c.last_output = now

    # ------------------------------------------------------------ ending requests

    def _ended(self, c: Choice) -> None:
        c.request.num_live -= 1
        c.request.wake.set()

    def _tombstone(self, c: Choice, reason: AbortReason, send_abort: bool = True) -> None:
        self.abort(c.engine_id, reason, send_abort)
        self._ended(c)
        engine = c.record.replica.index
        self.metrics.request_success.labels(engine, "abort").inc()
        if send_abort:
            self.metrics.aborts.labels(engine, reason).inc()

    def cancel(self, req: HttpRequest, reason: AbortReason = "client") -> None:
        """The client is gone: tombstone every live choice and abort it in the engine."""
        live = [c for c in req.choices if c.engine_id in self.live]
        if live:
            log.info("[%s] %s: aborting %d choices", req.id, reason, len(live))
        for c in live:
            self._tombstone(c, reason)

    def fail_request(self, req: HttpRequest, error: RequestError, send_abort: bool = True) -> None:
        """End the request with an error; its other live choices are aborted."""
        if req.error is None:
            req.error = error
        for c in req.choices:
            if c.engine_id in self.live:
                self._tombstone(c, "error", send_abort)
        req.wake.set()

    def abort_all(self, reason: AbortReason) -> None:
        """Shutdown: ask the engine to abort everything; choices stay LIVE until their Finished."""
        for rid in self.live:
            self.metrics.aborts.labels(self.live[rid].record.replica.index, reason).inc()
            self._abort(rid, reason)

    def fail_all(self, error: RequestError, send_abort: bool) -> None:
        """Every live request fails now (an actor on the request path died, or the drain timed out)."""
        for req in dict.fromkeys(c.request for c in self.live.values()):
            log.warning("[%s] failed: %s", req.id, error.message)
            self.fail_request(req, error, send_abort)


def engine_error(fin: Finished, fields: dict[str, str]) -> RequestError:
    """The engine's error as the client's answer: a field of the request at fault is a 400 naming it (as the request
    spells it), the server's state a 503, a failure of the engine a 500."""
    message = fin.error or "the engine failed the request"
    if fin.error_kind == "invalid":
        return RequestError(400, message, fields.get(fin.error_param, fin.error_param))
    return RequestError(503 if fin.error_kind == "unavailable" else 500, message)

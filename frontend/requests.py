"""The HTTP actor's request table: one HttpRequest per HTTP call, one Choice per engine request.

Choice states (DESIGN section 3, the HTTP party), state x event -> action:
  LIVE        TextDelta in seq order  -> buffered, the request's writer woken (never awaited here)
  LIVE        TextDelta already seen  -> duplicate: dropped, counted (protocol violation "duplicate")
  LIVE        TextDelta of an older copy of the request -> stale: dropped, counted (a newer copy's is followed)
  LIVE        TextDelta/Finished gap  -> re-submitted from its record (the tokens and text it has) as the next copy
                                         (DESIGN I6: a lost output is repaired); after MAX_ATTEMPTS copies it fails
  LIVE        Finished                -> buffered with its finish reason: CLOSED
  LIVE        client gone, failure    -> Abort to the scheduler: TOMBSTONED
  TOMBSTONED  TextDelta               -> stale: dropped, counted
  TOMBSTONED  Finished                -> CLOSED
  TOMBSTONED  no Finished in time     -> Abort re-sent; after max_abort_tries dropped with an error (I7)
  CLOSED      TextDelta / Finished    -> within the token count its Finished reported: "duplicate"; past it:
                                         protocol violation "after_finished" (I2 broken); logged, counted, dropped
  unknown     TextDelta / Finished    -> protocol violation "unknown_id": logged, counted, dropped (an id CLOSED
                                         long ago, or whose tombstone was dropped, is unknown)
  LIVE        scheduler or detokenizer down -> waits (DESIGN I8: the engine side forgets every request)
  LIVE        both up again           -> re-submitted from its record (prompt, params, the tokens and text it
                                         has) as a resumed request: its stream goes on from there; one live at
                                         more than max_resumes deaths fails (503, a poison request)
  TOMBSTONED  scheduler or detokenizer down -> dropped (nobody will send its Finished)
  LIVE        a TextOutputs lost (a gap in TextOutputs.number, found two messages or a second later) -> repaired
                                         as a gap if it was not heard from since
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from actors.protocol import MAX_ATTEMPTS, RecentIds, RequestRecord, StepNumbers, Tombstones, lost_suspects
from frontend.metrics import Metrics
from frontend.protocol import ParsedRequest, RequestError
from frontend.request_state import Choice, HttpRequest
from messages.names import DETOKENIZER, SCHEDULER
from messages.wire import Abort, AbortReason, Finished, Msg, TextDelta, TextOutputs

log = logging.getLogger("sluice.http")


class RequestTable:
    def __init__(
        self,
        tell: Callable[[str, Msg], None],
        metrics: Metrics,
        abort_timeout_s: float = 5.0,
        max_abort_tries: int = 3,
    ):
        self.tell = tell
        self.metrics = metrics
        self.live: dict[str, Choice] = {}  # engine request id -> choice
        self.link = StepNumbers()  # the numbering of the detokenizer's TextOutputs
        self.tombstones = Tombstones(abort_timeout_s, max_abort_tries, log)
        self.closed = RecentIds()  # engine request id -> the tokens its Finished accounts for
        metrics.num_tombstones = lambda: len(self.tombstones)

    def add(self, parsed: ParsedRequest, client: str) -> HttpRequest:
        """Register the request and send its AddRequests; `client` is the actor that gets the text."""
        req = HttpRequest(parsed)
        self.metrics.params_n.observe(parsed.n)
        for c, msg in zip(req.choices, req.engine_requests(client), strict=True):
            c.record = RequestRecord(msg, self.link.last)
            self.live[c.engine_id] = c
            self.tell(SCHEDULER, msg)
        return req

    def suspend(self, actor: str) -> None:
        """An actor of the request path died, and the engine side forgot every request: live choices wait for
        resume_all; tombstones are dropped (no terminal message will come)."""
        self.tombstones.clear()
        if actor == DETOKENIZER:
            self.link.reset()  # its next incarnation numbers from 0

    def resume_all(self, max_resumes: int) -> None:
        """The request path is whole again: every live choice is re-submitted from its record (DESIGN I8)."""
        for c in list(self.live.values()):
            if not c.live:
                continue  # failed with a sibling below
            c.record.deaths += 1
            if c.record.deaths > max_resumes:
                log.error("[%s] live at %d engine-side deaths: failed", c.engine_id, c.record.deaths)
                error = f"request {c.engine_id}: failed after {max_resumes} restarts of the engine side while it ran"
                self.fail(c.request, RequestError(503, error))
            else:
                self._resume(c, "death")

    def _resume(self, c: Choice, cause: str) -> None:
        """Re-submit the choice from its record; one that had too many copies fails."""
        msg = c.record.resume()
        if msg is None:
            self.fail(c.request, RequestError(500, f"request {c.engine_id}: failed after {MAX_ATTEMPTS} resumptions"))
            return
        self.metrics.resumes[cause] += 1
        log.info("[%s] resumed after %d tokens (%s)", c.engine_id, c.num_tokens, cause)
        self.tell(SCHEDULER, msg)

    # ------------------------------------------------------------ engine outputs

    def on_outputs(self, msg: TextOutputs) -> None:
        if msg.number >= 0 and not self.link.accept(msg.number, msg.recent):
            self._violation("duplicate", "-", f"TextOutputs {msg.number} again")
            return
        now = time.monotonic()
        for delta in msg.deltas:
            self._on_delta(delta, now, msg.number)
        for fin in msg.finished:
            self.on_finished(fin)
        self.find_lost()

    def find_lost(self) -> None:
        """Repair the choices that may have had output in a TextOutputs now known to be lost."""
        if lost := self.link.lost():
            for rid in lost_suspects(self.link, lost, ((rid, c.record) for rid, c in self.live.items())):
                if (c := self.live.get(rid)) is not None:  # (a sibling's failure may have ended it)
                    self._gap(c, "a TextOutputs it may have been in was lost")

    def _on_delta(self, delta: TextDelta, now: float, number: int) -> None:
        c = self.live.get(delta.request_id)
        if c is None:
            end = delta.seq + len(delta.token_ids)
            self._not_live(delta.request_id, f"TextDelta seq {delta.seq}", end, terminal=False)
            return
        match c.record.check(delta.seq, len(delta.token_ids), delta.attempt):
            case "ok":  # (only output taken: a lost message before a stale or duplicate one may hold its next)
                c.record.heard = max(c.record.heard, number)
                c.record.received(delta.text, delta.token_ids)
                c.append(delta.text, delta.token_ids, delta.logprobs)
                self._observe_output(c, now)
                c.request.wake.set()
            case "stale":
                self.metrics.stale_dropped += 1
            case "duplicate":
                self._violation("duplicate", c.engine_id, f"TextDelta seq {delta.seq} (expected {c.num_tokens})")
            case "gap":
                self._gap(c, f"TextDelta seq {delta.seq}, expected {c.num_tokens}")

    def on_finished(self, fin: Finished) -> None:
        rid = fin.request_id
        c = self.live.get(rid)
        if c is None:
            self._not_live(rid, f"Finished({fin.finish_reason})", fin.num_output_tokens, terminal=True)
            return
        if not c.record.follows(fin.attempt):  # an older copy's
            self.metrics.stale_dropped += 1
            return
        seen = c.num_tokens + len(fin.token_ids)
        if fin.finish_reason != "error" and fin.num_output_tokens != seen:  # a lost delta: repair, never corrupt
            self._gap(c, f"Finished after {fin.num_output_tokens} tokens, {seen} received")
            return
        self.closed.remember(rid, max(seen, fin.num_output_tokens))
        c.append(fin.text, fin.token_ids, fin.logprobs)
        c.finished = fin
        now = time.monotonic()
        if fin.token_ids:
            self._observe_output(c, now)
        self.metrics.e2e.observe(now - c.request.arrival)
        self.metrics.finished(fin, c.record.add.params)
        self._close(c)
        if fin.finish_reason == "error":
            log.warning("[%s] failed in the engine: %s", rid, fin.error)
            self.fail(c.request, RequestError(500, fin.error or "the engine failed the request"))

    def _observe_output(self, c: Choice, now: float) -> None:
        req = c.request
        if req.first_output is None:
            req.first_output = now
            self.metrics.ttft.observe(now - req.arrival)
        elif c.last_output:
            self.metrics.itl.observe(now - c.last_output)
        c.last_output = now

    def _not_live(self, rid: str, what: str, end: int, terminal: bool) -> None:
        """Output for a choice not LIVE; `end`: the token count it reaches (a Finished: the count it reports)."""
        final = self.closed.get(rid)
        if rid in self.tombstones:
            if terminal:
                del self.tombstones[rid]
                self.closed.remember(rid, end)
                log.debug("[%s] tombstone closed by %s", rid, what)
            else:
                self.metrics.stale_dropped += 1
        elif final is None:
            self._violation("unknown_id", rid, f"{what} for an id neither live nor tombstoned")
        elif end > final:
            self._violation("after_finished", rid, f"{what} reaches token {end}, past the {final} of its Finished")
        else:
            self._violation("duplicate", rid, f"{what} after its Finished")

    def _violation(self, kind: str, rid: str, what: str) -> None:
        self.metrics.violations[kind] += 1
        log.warning("[%s] protocol violation (%s): %s; dropped", rid, kind, what)

    def _gap(self, c: Choice, what: str) -> None:
        """Some output of the choice was lost: it is re-submitted from what it has (DESIGN I6, I8)."""
        self._violation("gap", c.engine_id, what)
        self._resume(c, "lost_output")

    # ------------------------------------------------------------ ending requests

    def _close(self, c: Choice) -> None:
        del self.live[c.engine_id]
        c.live = False
        c.request.num_live -= 1
        c.request.wake.set()

    def _tombstone(self, c: Choice, reason: AbortReason, send_abort: bool = True) -> None:
        self._close(c)
        self.metrics.request_success.labels("abort").inc()
        self.tombstones.add(c.engine_id, reason, aborted=send_abort)
        if send_abort:
            self.metrics.aborts.labels(reason).inc()
            self._abort(c.engine_id, reason)

    def cancel(self, req: HttpRequest, reason: AbortReason = "client") -> None:
        """The client is gone: tombstone every live choice and abort it in the engine."""
        live = [c for c in req.choices if c.live]
        if live:
            log.info("[%s] %s: aborting %d choices", req.id, reason, len(live))
        for c in live:
            self._tombstone(c, reason)

    def fail(self, req: HttpRequest, error: RequestError, send_abort: bool = True) -> None:
        """End the request with an error; its other live choices are aborted."""
        if req.error is None:
            req.error = error
        for c in req.choices:
            if c.live:
                self._tombstone(c, "error", send_abort)
        req.wake.set()

    def abort_all(self, reason: AbortReason) -> None:
        """Shutdown: ask the engine to abort everything; choices stay LIVE until their Finished."""
        for rid in self.live:
            self.metrics.aborts.labels(reason).inc()
            self._abort(rid, reason)

    def fail_all(self, error: RequestError, send_abort: bool) -> None:
        """Every live request fails now (an actor on the request path died, or the drain timed out)."""
        for req in dict.fromkeys(c.request for c in self.live.values()):
            log.warning("[%s] failed: %s", req.id, error.message)
            self.fail(req, error, send_abort)

    def expire(self, now: float) -> None:
        """I7: re-send an Abort that got no Finished in time; give up after max_abort_tries. And find a TextOutputs
        lost on a quiet link."""
        self.tombstones.expire(now, self._abort)
        self.find_lost()

    def _abort(self, rid: str, reason: AbortReason) -> None:
        self.tell(SCHEDULER, Abort(request_id=rid, reason=reason))

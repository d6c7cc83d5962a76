"""A client's side of the protocol (DESIGN section 3, the client party: the HTTP actor's RequestTable, the offline
API's ClientActor): its ledger of engine requests, the durable record of each (I8), the check of every output (I6)
and the resumes that repair a loss or survive a death. A client subclass says what delivering, finishing and
failing mean for it (`deliver`, `finish`, `fail`).

Request states, state x event -> action:
  LIVE        TextDelta in seq order  -> taken into its record, `deliver`ed
  LIVE        TextDelta already seen  -> dropped: violation "duplicate"
  LIVE        output of an older copy of the request -> stale: dropped, counted (a newer copy's is followed)
  LIVE        TextDelta/Finished gap  -> re-submitted from its record (the tokens and text it has) as the next copy
                                         (I6: a lost output is repaired); after MAX_ATTEMPTS copies it fails
  LIVE        Finished                -> CLOSED, `finish`ed (one reporting fewer tokens than arrived: violation
                                         "after_finished", closed with what arrived: delivered text is never taken back)
  LIVE        a TextOutputs lost (a gap in TextOutputs.number, found two messages or a second later) -> repaired
                                         as a gap if it was not heard from since (or was named by a later message)
  LIVE        the client ends it (`abort`) -> CLOSED, Abort to the scheduler: TOMBSTONED
  TOMBSTONED  TextDelta               -> stale: dropped, counted
  TOMBSTONED  Finished                -> gone (remembered as CLOSED)
  TOMBSTONED  no Finished in time     -> Abort re-sent; after max_abort_tries dropped with an error (I7)
  CLOSED      TextDelta / Finished    -> within the token count its Finished reported: violation "duplicate"; past
                                         it: violation "after_finished" (I2 broken); logged, counted, dropped
  unknown     TextDelta / Finished    -> violation "unknown_id": logged, counted, dropped (an id CLOSED long ago, or
                                         whose tombstone was dropped, is unknown)
  LIVE        scheduler or detokenizer down -> waits (I8: the engine side forgets every request)
  LIVE        both up again           -> re-submitted from its record (prompt, params, the tokens and text it has) as
                                         a resumed request: its stream goes on from there; one live at more than
                                         max_resumes detokenizer deaths fails (503, all of them); the engine judges
                                         its own deaths (actors/engine/flight_record.py); MAX_ATTEMPTS bounds the
                                         rest (deaths outside any step)
  TOMBSTONED  scheduler or detokenizer down -> dropped (nobody will send its Finished)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

import msgspec

from actors.protocol import (
    CLIENT_COPIES,
    MAX_ATTEMPTS,
    Ledger,
    ProtocolCounts,
    StepNumbers,
    lost_suspects,
    next_attempt,
)
from messages.names import DETOKENIZER, REQUEST_PATH, SCHEDULER
from messages.wire import Abort, AbortReason, AddRequest, Finished, Msg, TextDelta, TextOutputs


class RequestRecord:
    """A client's durable record of one engine request (DESIGN I8) and the check of its outputs (I6): what it
    first sent, the tokens and characters of text received so far, and which copy of the request it follows.

    `check(seq, n, attempt)` of an output bringing n tokens: "ok" (the next one: take it, and `received` it),
    "stale" (an older copy's, still in flight), "duplicate" (seen before) or "gap" (something before it was
    lost). A newer copy's output (the detokenizer re-submitted the request) makes that copy the one followed."""

    __slots__ = ("add", "attempt", "deaths", "heard", "num_chars", "token_ids")

    def __init__(self, add: AddRequest, heard: int):
        self.add = add
        self.token_ids: list[int] = []
        self.num_chars = 0
        self.attempt = add.attempt
        self.deaths = 0  # detokenizer deaths it was live at (a poison request's are bounded)
        self.heard = heard  # the number of the last TextOutputs whose output of it was taken (or that came before it)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def follows(self, attempt: int) -> bool:
        """False for an output (or Finished) of an older copy; one of a newer copy makes that copy the one followed
        (a repair goes on above it)."""
        self.attempt = max(self.attempt, attempt)
        return attempt == self.attempt

    def check(self, seq: int, n: int, attempt: int) -> str:
        if not self.follows(attempt):
            return "stale"
        if seq == len(self.token_ids):
            return "ok"
        return "duplicate" if seq + n <= len(self.token_ids) else "gap"

    def received(self, text: str, token_ids: list[int]) -> None:
        self.token_ids += token_ids
        self.num_chars += len(text)

    def resume(self) -> AddRequest | None:
        """The request's next copy, going on after what was received; None once it had MAX_ATTEMPTS copies."""
        if self.attempt >= MAX_ATTEMPTS:
            return None
        self.attempt = next_attempt(self.attempt, CLIENT_COPIES)
        return msgspec.structs.replace(
            self.add, resume_token_ids=list(self.token_ids), resume_chars=self.num_chars, attempt=self.attempt
        )


class Recorded(Protocol):
    record: RequestRecord


R = TypeVar("R", bound=Recorded)


class ClientLedger(Ledger[R]):
    """The client party's ledger: engine request id -> the client's state of it (anything with a `record`)."""

    def __init__(
        self,
        tell: Callable[[str, Msg], None],
        log: logging.Logger,
        abort_timeout_s: float = 5.0,
        max_abort_tries: int = 3,
        max_resumes: int = 2,
        counts: ProtocolCounts | None = None,
    ):
        super().__init__(abort_timeout_s, max_abort_tries, log, counts)
        self.tell = tell
        self.max_resumes = max_resumes
        self.link = StepNumbers()  # the numbering of the detokenizer's TextOutputs
        self.down: set[str] = set()  # engine-side actors that are down
        self.detokenizer_died = False  # since the request path was last whole

    # ------------------------------------------------------------ what a client does (its subclass)

    def deliver(self, state: R, delta: TextDelta, now: float) -> None:
        raise NotImplementedError  # new output of a LIVE request, in order (already in its record)

    def finish(self, state: R, fin: Finished) -> None:
        raise NotImplementedError  # its terminal message (it is CLOSED now)

    def fail(self, state: R, status: int, error: str, abort: bool) -> None:
        raise NotImplementedError  # end a LIVE request with an error (`status`: its HTTP code); `abort` it if `abort`

    # ------------------------------------------------------------ requests in, outputs in

    def submit(self, state: R, msg: AddRequest, send: bool = True) -> R:
        """Register a request, its state given the record of `msg`, and send `msg` (unless not `send`: the system
        is gone, the request is to fail)."""
        state.record = RequestRecord(msg, self.link.last)
        self.open(msg.request_id, state)
        if send:
            self.tell(SCHEDULER, msg)
        return state

    def on_outputs(self, msg: TextOutputs) -> None:
        if msg.number >= 0 and not self.link.accept(msg.number, msg.recent):
            self.violation("duplicate", "-", f"TextOutputs {msg.number} again")
            return
        now = time.monotonic()
        for delta in msg.deltas:
            self._on_delta(delta, now, msg.number)
        for fin in msg.finished:
            self.on_finished(fin)
        self.find_lost()

    def _on_delta(self, delta: TextDelta, now: float, number: int) -> None:
        rid = delta.request_id
        state = self.live.get(rid)
        if state is None:
            self._not_live(rid, f"TextDelta seq {delta.seq}", delta.seq + len(delta.token_ids), terminal=False)
            return
        record = state.record
        match record.check(delta.seq, len(delta.token_ids), delta.attempt):
            case "ok":  # (only output taken: a lost message before a stale or duplicate one may hold its next)
                record.heard = max(record.heard, number)
                record.received(delta.text, delta.token_ids)
                self.deliver(state, delta, now)
            case "stale":
                self.counts.stale += 1
            case "duplicate":
                self.violation("duplicate", rid, f"TextDelta seq {delta.seq} (expected {record.num_tokens})")
            case "gap":
                self._gap(state, f"TextDelta seq {delta.seq}, expected {record.num_tokens}")

    def on_finished(self, fin: Finished) -> None:
        rid = fin.request_id
        state = self.live.get(rid)
        if state is None:
            self._not_live(rid, f"Finished({fin.finish_reason})", fin.num_output_tokens, terminal=True)
            return
        if not state.record.follows(fin.attempt):  # an older copy's
            self.counts.stale += 1
            return
        seen = state.record.num_tokens + len(fin.token_ids)
        if fin.finish_reason != "error" and fin.num_output_tokens > seen:  # a lost delta: repair, never corrupt
            self._gap(state, f"Finished after {fin.num_output_tokens} tokens, {seen} received")
            return
        if fin.finish_reason != "error" and fin.num_output_tokens < seen:
            self.violation(
                "after_finished", rid, f"{seen} tokens received, its Finished reports {fin.num_output_tokens}"
            )
        self.close(rid, max(seen, fin.num_output_tokens))
        self.finish(state, fin)

    def _not_live(self, rid: str, what: str, end: int, terminal: bool) -> None:
        """Output for a request not LIVE; `end`: the token count it reaches (a Finished: the count it reports)."""
        if rid in self.tombstones:
            if terminal:
                del self.tombstones[rid]
                self.fate.remember(rid, end)
                self.log.debug("[%s] tombstone closed by %s", rid, what)
            else:
                self.counts.stale += 1
            return
        final = self.fate.get(rid)
        if final is None:
            self.violation("unknown_id", rid, f"{what} for an id neither live nor tombstoned")
        elif end > final:
            self.violation("after_finished", rid, f"{what} reaches token {end}, past the {final} of its Finished")
        else:
            self.violation("duplicate", rid, f"{what} after its Finished")

    def find_lost(self) -> None:
        """Repair the requests that may have had output in a TextOutputs now known to be lost."""
        if lost := self.link.lost():
            for rid in lost_suspects(self.link, lost, ((rid, s.record) for rid, s in self.live.items())):
                if (state := self.live.get(rid)) is not None:  # (a sibling's failure may have ended it)
                    self._gap(state, "a TextOutputs it may have been in was lost")

    def violation(self, kind: str, rid: str, what: str) -> None:
        self.counts.violations[kind] += 1
        self.log.warning("[%s] protocol violation (%s): %s; dropped", rid, kind, what)

    # ------------------------------------------------------------ repairs and deaths

    def _gap(self, state: R, what: str) -> None:
        """Some output of the request was lost: it is re-submitted from what it has (DESIGN I6, I8)."""
        self.violation("gap", state.record.add.request_id, what)
        self.resume(state, "lost_output", f"lost output ({what})")

    def resume(self, state: R, cause: str, why: str) -> None:
        """Re-submit the request from its record; one that had MAX_ATTEMPTS copies fails, saying `why`."""
        if (msg := (record := state.record).resume()) is None:
            error = f"request {record.add.request_id}: {why}; failed after {MAX_ATTEMPTS} resumptions"
            self.fail(state, 500, error, abort=True)
            return
        self.counts.resumes[cause] += 1
        self.log.info("[%s] resumed after %d tokens (%s)", msg.request_id, record.num_tokens, cause)
        self.tell(SCHEDULER, msg)

    def on_down(self, actor: str) -> bool:
        """An actor died; True if the engine side forgot every request: LIVE ones wait for it to be whole again,
        tombstones are dropped (no terminal message will come)."""
        if actor not in REQUEST_PATH:
            return False
        self.down.add(actor)
        self.tombstones.clear()
        if actor == DETOKENIZER:
            self.link.reset()  # its next incarnation numbers from 0
            self.detokenizer_died = True
        return True

    def on_up(self, actor: str) -> bool:
        """An actor is back; True if the engine side is whole again: every LIVE request is re-submitted from its
        record (DESIGN I8), or fails if it was live at more than max_resumes deaths of the detokenizer."""
        if actor not in self.down:
            return False  # (a worker's restart is the engine's business)
        self.down.discard(actor)
        if self.down:
            return False
        counted, self.detokenizer_died = self.detokenizer_died, False
        for rid, state in list(self.live.items()):
            if rid not in self.live:
                continue  # failed with a sibling
            state.record.deaths += counted
            if state.record.deaths > self.max_resumes:
                self.log.error("[%s] live at %d deaths of the detokenizer: failed", rid, state.record.deaths)
                error = f"request {rid}: failed after {self.max_resumes} restarts of the detokenizer while it ran"
                self.fail(state, 503, error, abort=False)  # (innocent or not: the detokenizer blames nobody)
            else:
                self.resume(state, "death", "an engine-side process died")
        return True

    # ------------------------------------------------------------ ending requests early

    def abort(self, rid: str, reason: AbortReason, send: bool = True) -> R:
        """The client ends a LIVE request: CLOSED, and TOMBSTONED until the engine's terminal message (`send`: an
        Abort is sent; without one, the engine is gone, the tombstone lasts one timeout)."""
        state = self.forget(rid)  # (its fate is written when its terminal message closes the tombstone)
        msg = Abort(request_id=rid, reason=reason)
        self.tombstones.add(msg, sent=send)
        if send:
            self.tell(SCHEDULER, msg)
        return state

    def expire(self, now: float) -> None:
        """I7: re-send an Abort that no Finished answered in time (max_abort_tries); find a lost TextOutputs."""
        self.tombstones.expire(now, lambda msg: self.tell(SCHEDULER, msg))
        self.find_lost()

    def _abort(self, rid: str, reason: AbortReason) -> None:
        self.tell(SCHEDULER, Abort(request_id=rid, reason=reason))

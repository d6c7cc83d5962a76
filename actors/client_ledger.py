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
  LIVE        its replica's scheduler or detokenizer down (I8: the replica forgets every request it held) ->
                                         re-submitted from its record (prompt, params, the tokens and text it has) as
                                         a resumed request, on a replica that serves (actors/routing.py): its stream
                                         goes on from there; none serves: it waits. One live at more than
                                         max_resumes detokenizer deaths fails (503, all of them); the engine judges
                                         its own deaths (actors/engine/flight_record.py); MAX_ATTEMPTS bounds the
                                         rest (deaths outside any step)
  LIVE, waiting   a replica serves again -> re-submitted there likewise
  LIVE        output from another replica than its copy's -> stale: dropped, counted
  TOMBSTONED  its replica's scheduler or detokenizer down -> dropped (nobody will send its Finished)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from actors.client_record import RequestRecord
from actors.protocol import MAX_ATTEMPTS, Ledger, ProtocolCounts, lost_suspects
from actors.routing import ReplicaLink, Replicas
from messages.wire import Abort, AbortReason, AddRequest, Finished, Msg, TextDelta, TextOutputs

__all__ = ["ClientLedger", "RequestRecord"]


class Recorded(Protocol):
    record: RequestRecord


R = TypeVar("R", bound=Recorded)


class ClientLedger(Ledger[R]):
    """The client party's ledger: engine request id -> the client's state of it (anything with a `record`), over
    the engine replicas (`replicas`: one, unless --data-parallel-size)."""

    def __init__(
        self,
        tell: Callable[[str, Msg], None],
        log: logging.Logger,
        abort_timeout_s: float = 5.0,
        max_abort_tries: int = 3,
        max_resumes: int = 2,
        counts: ProtocolCounts | None = None,
        replicas: Replicas | None = None,
    ):
        super().__init__(abort_timeout_s, max_abort_tries, log, counts)
        self.tell = tell
        self.max_resumes = max_resumes
        self.replicas = replicas or Replicas()

    # ------------------------------------------------------------ what a client does (its subclass)

    def deliver(self, state: R, delta: TextDelta, now: float) -> None:
        raise NotImplementedError  # new output of a LIVE request, in order (already in its record)

    def finish(self, state: R, fin: Finished) -> None:
        raise NotImplementedError  # its terminal message (it is CLOSED now)

    def fail(self, state: R, status: int, error: str, abort: bool) -> None:
        raise NotImplementedError  # end a LIVE request with an error (`status`: its HTTP code); `abort` it if `abort`

    def group(self, state: R) -> object:
        """What is routed as one (a request's n choices share its prompt's blocks): by default, each request."""
        return state

    # ------------------------------------------------------------ requests in, outputs in

    def submit(self, state: R, msg: AddRequest, send: bool = True, replica: ReplicaLink | None = None) -> R:
        """Register a request, its state given the record of `msg`, and send `msg` to `replica` (None: where the
        routing says) unless not `send` (the system is gone, the request is to fail). With no replica serving it
        waits for one, as after a death."""
        replica = replica or self.replicas.route(msg)
        state.record = RequestRecord(msg, replica or self.replicas[0])
        if replica is None:
            state.record.generation = -1  # (no replica took it: an orphan from the start)
        self.open(msg.request_id, state)
        if send and replica is not None:
            self.tell(replica.names.scheduler, msg)
        return state

    def on_outputs(self, msg: TextOutputs) -> None:
        if not 0 <= msg.replica < len(self.replicas):
            self.violation("unknown_id", "-", f"TextOutputs from replica {msg.replica}")
            return
        replica = self.replicas[msg.replica]
        if msg.number >= 0 and not replica.link.accept(msg.number, msg.recent):
            self.violation("duplicate", "-", f"TextOutputs {msg.number} again")
            return
        now = time.monotonic()
        for delta in msg.deltas:
            self._on_delta(delta, now, msg.number, replica)
        for fin in msg.finished:
            self.on_finished(fin, replica)
        self.find_lost(replica)

    def _on_delta(self, delta: TextDelta, now: float, number: int, replica: ReplicaLink) -> None:
        rid = delta.request_id
        state = self.live.get(rid)
        if state is None:
            self._not_live(rid, f"TextDelta seq {delta.seq}", delta.seq + len(delta.token_ids), terminal=False)
            return
        record = state.record
        match (
            "stale" if record.replica is not replica else record.check(delta.seq, len(delta.token_ids), delta.attempt)
        ):
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

    def on_finished(self, fin: Finished, replica: ReplicaLink | None = None) -> None:
        rid = fin.request_id
        state = self.live.get(rid)
        if state is None:
            self._not_live(rid, f"Finished({fin.finish_reason})", fin.num_output_tokens, terminal=True)
            return
        if replica not in (None, state.record.replica) or not state.record.follows(fin.attempt):  # an older copy's
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

    def find_lost(self, replica: ReplicaLink) -> None:
        """Repair the requests that may have had output in a TextOutputs of `replica` now known to be lost."""
        if lost := replica.link.lost():
            records = ((rid, s.record) for rid, s in self.live.items() if s.record.replica is replica)
            for rid in lost_suspects(replica.link, lost, records):
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

    def resume(self, state: R, cause: str, why: str, to: ReplicaLink | None = None) -> None:
        """Re-submit the request from its record (to replica `to`; None: its own); one that had MAX_ATTEMPTS copies
        fails, saying `why`."""
        if to is None and state.record.orphaned:
            return  # (its replica forgot it: `_failover` re-submits it where one takes it)
        if (msg := (record := state.record).resume()) is None:
            error = f"request {record.add.request_id}: {why}; failed after {MAX_ATTEMPTS} resumptions"
            self.fail(state, 500, error, abort=True)
            return
        if to is not None:
            record.move(to)
        self.counts.resumes[cause] += 1
        self.log.info("[%s] resumed after %d tokens on engine %d (%s)", msg.request_id, record.num_tokens,
                      record.replica.index, cause)  # fmt: skip
        self.tell(record.replica.names.scheduler, msg)

    def on_down(self, actor: str) -> bool:
        """An actor died; True if it held requests (a replica's scheduler or detokenizer: that replica forgot every
        one): its LIVE ones are re-submitted on a replica that serves (or wait for one), its tombstones dropped (no
        terminal message will come); one live at more than max_resumes deaths of a detokenizer fails."""
        replica = self.replicas.of(actor)
        if replica is None or actor not in replica.names.actors or actor in replica.down:
            return False  # (a report again, of a death already known: nothing more is lost)
        replica.down.add(actor)  # (its worker: not routed to; its requests wait in its engine)
        if actor not in replica.names.request_path:
            return False
        replica.forget()
        self.tombstones.drop(replica.names.scheduler)
        died = actor == replica.names.detokenizer
        if died:
            replica.link.reset()  # its next incarnation numbers from 0
        for rid, state in list(self.live.items()):
            if rid in self.live and state.record.replica is replica:  # (not failed with a sibling)
                state.record.deaths += died
                if state.record.deaths > self.max_resumes:
                    self.log.error("[%s] live at %d deaths of the detokenizer: failed", rid, state.record.deaths)
                    error = f"request {rid}: failed after {self.max_resumes} restarts of the detokenizer while it ran"
                    self.fail(state, 503, error, abort=False)  # (innocent or not: the detokenizer blames nobody)
        self._failover()
        return True

    def on_up(self, actor: str) -> bool:
        """An actor is back; True if its replica serves again: the LIVE requests waiting for a replica are
        re-submitted (DESIGN I8) where the routing says."""
        replica = self.replicas.of(actor)
        if replica is None or actor not in replica.down:
            return False
        replica.down.discard(actor)
        if replica.down:
            return False
        self._failover()
        return True

    def _failover(self) -> None:
        """Re-submit every LIVE request whose replica does not serve on one that does (a group together)."""
        placed: dict[int, ReplicaLink | None] = {}
        for rid, state in list(self.live.items()):
            if rid not in self.live or not state.record.orphaned:
                continue  # (failed with a sibling)
            key = id(self.group(state))
            if key not in placed:
                placed[key] = self.replicas.route(state.record.add)
            if placed[key] is not None:
                self.resume(state, "death", "an engine-side process died", placed[key])

    # ------------------------------------------------------------ ending requests early

    def abort(self, rid: str, reason: AbortReason, send: bool = True) -> R:
        """The client ends a LIVE request: CLOSED, and TOMBSTONED until the engine's terminal message (`send`: an
        Abort is sent; without one, or with its replica down, the tombstone lasts one timeout)."""
        state = self.forget(rid)  # (its fate is written when its terminal message closes the tombstone)
        msg, replica = Abort(request_id=rid, reason=reason), state.record.replica
        send = send and not state.record.orphaned
        self.tombstones.add(msg, replica.names.scheduler, sent=send)
        if send:
            self.tell(replica.names.scheduler, msg)
        return state

    def expire(self, now: float) -> None:
        """I7: re-send an Abort that no Finished answered in time (max_abort_tries); find a lost TextOutputs."""
        self.tombstones.expire(now, self.tell)
        for replica in self.replicas.all:
            self.find_lost(replica)

    def _abort(self, rid: str, reason: AbortReason) -> None:
        replica = self.live[rid].record.replica
        self.tell(replica.names.scheduler, Abort(request_id=rid, reason=reason))

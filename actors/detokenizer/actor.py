"""DetokenizerActor: StepOutputs in, one TextOutputs per step out, exactly one Finished per request.

Request states here: LIVE (registered by the scheduler's forwarded AddRequest) -> CLOSED on its
terminal message, or LIVE -> TOMBSTONED when this actor ends it early (stop string, seq gap, bad
token, lost output) and sends Abort to the scheduler -> CLOSED on the terminal message (AbortAck or
a final entry). Outputs for a tombstoned id are stale: dropped and counted. Outputs for an id that is
neither live nor tombstoned are protocol violations: logged, counted, dropped.

Cases (state x event -> action):
  LIVE       entry                -> TextDelta (+ Finished when terminal: CLOSED)
  LIVE       entry with stop str  -> Finished(stop) to the client now, Abort(stop) to the scheduler: TOMBSTONED
  LIVE       entry with a seq gap -> Finished(error) now, without its tokens; Abort(error): TOMBSTONED
  LIVE       entry seen before    -> dropped (its seq is behind: a duplicate)
  LIVE       AbortAck             -> Finished(abort) to the client: CLOSED
  LIVE       a step it may have been in is lost -> Finished(error), Abort(error): TOMBSTONED (see Steps)
  TOMBSTONED entry                -> stale (dropped); a terminal entry closes the tombstone
  TOMBSTONED AbortAck             -> CLOSED
  TOMBSTONED no terminal in time  -> Abort re-sent (idempotent); after max tries dropped with an error (I7)
  unknown    entry / AbortAck     -> protocol violation (a duplicate after close lands here too); the id is
                                     remembered: if its AddRequest comes after all (reordered), it fails at once
  CLOSED     AddRequest           -> a duplicate registration: protocol violation, dropped
  any        AddRequest(resumed)  -> (re)built from its delivered tokens and text (DESIGN I8): LIVE
  any        ActorDown(scheduler) -> every request forgotten silently (their client re-submits the live ones as
                                     resumed requests, or fails them); tombstones cleared
  any        ActorDown(client)    -> its LIVE requests are tombstoned and aborted in the engine
  any        Shutdown             -> handles messages on until every request is closed (the scheduler aborts them
                                     all), at most SHUTDOWN_DRAIN_S; what is left ends as abort

Steps. The scheduler sends one StepOutputs per engine step, and one as it goes idle, numbered
(actors.protocol.StepNumbers; step 0 starts a new engine incarnation). A number seen before is a
duplicate message, dropped whole. A skipped number is missing: if it arrives late it was reordered,
and its entries are handled as usual (the per-request seq checks already failed the requests it
displaced). Still missing two steps later or after a second, it is lost: it may have held the tokens
or the terminal entry of any live request not heard from since, so those fail (conservatively: a
request waiting in the engine's queue fails too); the engine acks the ones it still runs, and the
tombstones of the ones it had finished expire by I7. Reorders are not repaired by buffering: a link
is one FIFO ZMQ pipe, so a reorder means a fault or a bug, and failing cleanly (DESIGN I6) keeps the
hot path free of a reorder buffer and its timer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from tokenizers import Tokenizer

from actors.detokenizer.incremental import token_table
from actors.detokenizer.request_state import DetokRequestState
from actors.protocol import RecentIds, StepNumbers, Tombstones
from actors.runtime import Actor
from messages.wire import (
    Abort,
    AbortAck,
    ActorDown,
    AddRequest,
    CheckIdle,
    DetokStats,
    IdleReport,
    Shutdown,
    StepOutputs,
    TextOutputs,
)

log = logging.getLogger("sluice.detokenizer")

SCHEDULER = "scheduler"
SHUTDOWN_DRAIN_S = 5.0
CLOSED, ORPHAN, ORPHAN_ENDED = "closed", "orphan", "orphan-ended"  # `recent`: what became of an id not live


class DetokenizerActor(Actor):
    name = "detokenizer"

    def __init__(
        self,
        model: str,
        client: str = "http",
        abort_timeout_s: float = 5.0,
        max_abort_tries: int = 3,
        stats_interval_s: float = 0.5,
    ):
        super().__init__()
        self.tokenizer = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
        self.stats_to = client
        self.stats_interval_s = stats_interval_s
        self.live: dict[str, DetokRequestState] = {}
        self.clients: dict[str, str] = {}  # request id -> the actor that receives its text
        self.heard: dict[str, int] = {}  # request id -> the last step it was registered by or had an entry in
        self.tombstones = Tombstones(abort_timeout_s, max_abort_tries, log)
        self.recent = RecentIds()  # ids not live: CLOSED | ORPHAN | ORPHAN_ENDED
        self.steps = StepNumbers()
        self.stale_dropped = 0
        self.violations = 0
        self.duplicate_steps = 0
        self.lost_steps = 0
        self._draining = False

    def handlers(self):
        return {
            AddRequest: self.on_add,
            StepOutputs: self.on_step,
            AbortAck: self.on_ack,
            ActorDown: self.on_actor_down,
            CheckIdle: self.on_check,
            Shutdown: self.on_shutdown_msg,
        }

    async def on_start(self) -> None:
        token_table(self.tokenizer)  # build the byte tables now, not on the first request
        self.spawn(self._housekeeping())

    def on_add(self, msg: AddRequest) -> None:
        rid = msg.request_id
        before = self.recent.get(rid)
        if msg.resume_token_ids is not None:  # a copy here is replaced; outputs seen before it belong to an old copy
            self.tombstones.pop(rid, None)
            before = None
        elif rid in self.live or rid in self.tombstones or before == CLOSED:
            self._violation(rid, "AddRequest for an id already in use")
            return
        self.recent.pop(rid, None)
        self.live[rid] = DetokRequestState(msg, self.tokenizer)
        self.clients[rid] = msg.client
        self.heard[rid] = self.steps.last
        if before is not None:  # outputs overtook the registration: they are gone
            self._fail(rid, "engine output arrived before the request was registered", abort=before == ORPHAN)

    def on_step(self, msg: StepOutputs) -> None:
        if msg.step >= 0 and not self.steps.accept(msg.step):
            self.duplicate_steps += 1
            return
        batches: dict[str, TextOutputs] = {}
        for out in msg.outputs:
            rid = out.request_id
            state = self.live.get(rid)
            if state is None:
                if rid in self.tombstones:
                    self.stale_dropped += 1
                    if out.finish_reason is not None:
                        self._close_tombstone(rid)
                else:
                    self._violation(rid, f"StepOutputs entry seq {out.seq}", ended=out.finish_reason is not None)
                continue
            self.heard[rid] = max(self.heard[rid], msg.step)
            deltas, finished = state.process_run(out)
            client = self.clients[rid]
            batch = batches.get(client) or batches.setdefault(client, TextOutputs(step=msg.step, deltas=[]))
            batch.deltas += deltas
            if finished is not None:
                batch.finished.append(finished)
                self._close(rid)
                if out.finish_reason is None:  # we ended it; the engine still runs it
                    self._tombstone(rid, state.abort_reason or "stop")
        for client, batch in batches.items():
            if batch.deltas or batch.finished:
                self.tell(client, batch)
        self._find_lost()

    def on_ack(self, msg: AbortAck) -> None:
        rid = msg.request_id
        if rid in self.tombstones:
            self._close_tombstone(rid)
        elif rid in self.live:
            client = self.clients[rid]
            finished = self.live[rid].abort("abort")
            finished.stop_reason = msg.reason  # why it was aborted: client | stop | shutdown | ...
            self._close(rid)
            self.tell(client, finished)
        else:
            self._violation(rid, "AbortAck", ended=True)

    def on_actor_down(self, msg: ActorDown) -> None:
        if msg.actor == SCHEDULER:
            log.warning("engine down: forgetting %d requests and %d tombstones", len(self.live), len(self.tombstones))
            for rid in list(self.live):
                self._close(rid)
                self.recent.pop(rid)  # not CLOSED: it may come back resumed
            self.tombstones.clear()
            self.steps.reset()
        else:
            for rid in [r for r, c in self.clients.items() if c == msg.actor and r in self.live]:
                self._close(rid)
                self._tombstone(rid, "client")

    def on_check(self, msg: CheckIdle) -> IdleReport:
        details = {
            "live": len(self.live),
            "tombstones": len(self.tombstones),
            "heard": len(self.heard),
            "pending_asks": self.pending_asks,
        }
        return IdleReport(actor=self.name, idle=not any(details.values()), details=details)

    def on_shutdown_msg(self, msg: Shutdown) -> None:
        if not self._draining:
            self._draining = True
            self.spawn(self._drain_and_stop(msg.reason))

    async def _drain_and_stop(self, reason: str) -> None:
        await self.on_shutdown(reason)
        self.stop()

    async def on_shutdown(self, reason: str) -> None:
        deadline = time.monotonic() + SHUTDOWN_DRAIN_S
        while (self.live or self.tombstones) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for rid in list(self.live):  # the scheduler did not end it (it is not shutting down, or too slow)
            client, finished = self.clients[rid], self.live[rid].abort("abort")
            finished.stop_reason = reason
            self._close(rid)
            self.tell(client, finished)
            self._abort(rid, reason)

    # ------------------------------------------------------------ bookkeeping

    def _close(self, rid: str) -> None:
        self.live.pop(rid, None)
        self.clients.pop(rid, None)
        self.heard.pop(rid, None)
        self.recent.remember(rid, CLOSED)

    def _fail(self, rid: str, error: str, abort: bool) -> None:
        """End a LIVE request with an error; with `abort`, the engine still runs it: TOMBSTONED."""
        client, finished = self.clients[rid], self.live[rid].abort("error")
        finished.error = f"request {rid}: {error}"
        self._close(rid)
        self.tell(client, finished)
        if abort:
            self._tombstone(rid, "error")

    def _tombstone(self, rid: str, reason: str) -> None:
        self.tombstones.add(rid, reason)
        self._abort(rid, reason)

    def _abort(self, rid: str, reason: str) -> None:
        self.tell(SCHEDULER, Abort(request_id=rid, reason=reason))

    def _close_tombstone(self, rid: str) -> None:
        self.tombstones.pop(rid, None)

    def _violation(self, rid: str, what: str, ended: bool = False) -> None:
        self.violations += 1
        log.info("[%s] protocol violation: %s for an id neither live nor tombstoned; dropped", rid, what)
        before = self.recent.get(rid)
        if before is None or before == ORPHAN:
            self.recent.remember(rid, ORPHAN_ENDED if ended else ORPHAN)

    def _find_lost(self) -> None:
        lost = self.steps.lost()
        if not lost:
            return
        self.lost_steps += len(lost)
        suspects = [rid for rid, step in self.heard.items() if step < max(lost)]
        log.error("engine steps %s lost: failing %d requests that may have been in them", lost, len(suspects))
        for rid in suspects:
            self._fail(rid, f"engine output lost (steps {lost})", abort=True)

    async def _housekeeping(self) -> None:
        """Find lost steps on a quiet link, re-send Aborts that got no terminal message (I7), publish counters."""
        while True:
            await asyncio.sleep(self.stats_interval_s)
            self._find_lost()
            self.tombstones.expire(time.monotonic(), self._abort)
            stats = DetokStats(
                stale_outputs_dropped_total=self.stale_dropped,
                protocol_violations_total=self.violations,
                num_tombstones=len(self.tombstones),
            )
            self.tell(self.stats_to, stats)

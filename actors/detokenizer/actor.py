"""DetokenizerActor: StepOutputs in, one TextOutputs per step out, exactly one Finished per request.

Request states: LIVE (registered by the scheduler's forwarded AddRequest) -> CLOSED on its terminal
message, or -> TOMBSTONED when this actor ends it early and sends Abort -> CLOSED on the terminal message.

Cases (state x event -> action):
  LIVE       entry                -> TextDelta (+ Finished when terminal: CLOSED)
  LIVE       entry with stop str  -> Finished(stop) to the client now, Abort(stop) to the scheduler: TOMBSTONED
  LIVE       entry with a seq gap -> repaired: a new copy (AddRequest with a higher attempt, DESIGN I6/I8) goes on
                                     from what its client has; after MAX_ATTEMPTS: Finished(error), Abort: TOMBSTONED
  LIVE       entry of another copy -> stale (a replaced copy's outputs in flight): dropped, counted
  LIVE       entry seen before    -> dropped (its seq is behind: a duplicate)
  LIVE       AbortAck             -> Finished(abort) to the client: CLOSED (a replaced copy's ack: stale, dropped)
  LIVE       a step it may have been in is lost -> repaired likewise (see Steps)
  TOMBSTONED entry                -> stale (dropped); a terminal entry closes the tombstone
  TOMBSTONED AbortAck             -> CLOSED       (TOMBSTONED AddRequest(resumed): ignored, the Abort ends it too,
                                     unless the Abort named an older copy (its own, for that copy's output): the copy replaces it: LIVE)
  TOMBSTONED no terminal in time  -> Abort re-sent (idempotent); after max tries dropped with an error (I7)
  unknown    entry / AbortAck     -> protocol violation (a duplicate after close lands here too); the id and copy are
                                     remembered: if that copy's AddRequest comes after all (reordered), it is repaired
  CLOSED     AddRequest           -> a duplicate registration: protocol violation, dropped
  any        AddRequest(resumed) no newer than a copy made or seen here -> ignored (its own repair: its state went on
                                     from there; or a copy a newer one replaced)
  aborted    AddRequest(resumed)  -> its client is told the Finished(abort) (or error) again, no state is kept
  other      AddRequest(resumed)  -> (re)built from the tokens and text its client has (DESIGN I8): LIVE
  any        ActorDown(scheduler) -> every request forgotten silently (clients re-submit the live ones)
  any        ActorDown(client)    -> its LIVE requests are tombstoned and aborted in the engine
  any        Shutdown             -> drains (the scheduler aborts all) for SHUTDOWN_DRAIN_S at most; the rest: abort

Steps. The scheduler numbers its StepOutputs (one per step, and one as it goes idle; step 0 starts an incarnation:
actors.protocol.StepNumbers), each naming the requests of the two before it. A number seen before is a duplicate,
dropped whole; a skipped one is missing until it arrives (reordered) or is lost (two steps later, or after a
second): the requests it held are repaired (unnamed: every live one not heard from since; one the engine had
finished runs again). Messages to a client are numbered and named alike, and markers follow output for a while.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from tokenizers import Tokenizer

from actors.detokenizer.incremental import token_table
from actors.detokenizer.request_state import DetokRequestState, abort_finished
from actors.detokenizer.token_counts import TokenCounts
from actors.protocol import MAX_ATTEMPTS, Ledger, RecentIds, SentNames, StepNumbers, lost_suspects
from actors.runtime import Actor
from messages import names
from messages.wire import (
    Abort,
    AbortAck,
    AbortReason,
    ActorDown,
    AddRequest,
    CheckIdle,
    DetokStats,
    Finished,
    IdleReport,
    StepOutputs,
    TextOutputs,
)

log = logging.getLogger("sluice.detokenizer")

SHUTDOWN_DRAIN_S = 5.0
MARKERS_FOR_S = 5.0  # a client gets a marker at each housekeeping tick this long after its last output
CLOSED, ABORTED, ORPHAN = "closed", "aborted", "orphan"  # fate: CLOSED | (ABORTED, reason) | ORPHAN (unregistered)


class DetokenizerActor(Actor):
    name = names.DETOKENIZER

    def __init__(
        self,
        model: str,
        stats_to: tuple[str, ...] | list[str] = (names.HTTP,),
        abort_timeout_s: float = 5.0,
        max_abort_tries: int = 3,
        stats_interval_s: float = 0.5,
        replica: int = 0,
    ):
        super().__init__()
        self.replica = replica  # of the engine (--data-parallel-size)
        self.scheduler = names.replica(replica).scheduler
        self.tokenizer = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
        self.stats_to = stats_to  # the actors its DetokStats go to (the HTTP servers, or the offline client)
        self.stats_interval_s = stats_interval_s
        self.requests: Ledger[DetokRequestState] = Ledger(abort_timeout_s, max_abort_tries, log)
        self.live, self.tombstones, self.fate = self.requests.live, self.requests.tombstones, self.requests.fate
        self.counts = self.requests.counts  # violations: one kind, "any"; resumes: "lost_output" (repairs)
        self.numbers: dict[str, int] = {}  # client -> the number of its next TextOutputs
        self.names: dict[str, SentNames] = {}  # client -> the requests of its last TextOutputs (named in the next)
        self.last_sent: dict[str, float] = {}  # client -> when it was last sent output
        self.copies = RecentIds()  # id -> the highest AddRequest.attempt made or registered (resumed ids only)
        self.overtaken = RecentIds()  # id -> the highest copy whose output or ack came while it was unknown here
        self.steps = StepNumbers()
        self.tokens = TokenCounts()  # /metrics' prompt, generation and per-step tokens
        self.duplicate_steps = self.lost_steps = 0

    def handlers(self):
        return {AddRequest: self.on_add, StepOutputs: self.on_step, AbortAck: self.on_ack, ActorDown: self.on_actor_down,
                CheckIdle: self.on_check}  # fmt: skip

    async def on_start(self) -> None:
        token_table(self.tokenizer)  # build the byte tables now, not on the first request
        self.spawn(self._housekeeping())

    def on_add(self, msg: AddRequest) -> None:
        rid = msg.request_id
        before = self.fate.get(rid)
        resumed, aborted = msg.resume_token_ids is not None, isinstance(before, tuple)  # (ABORTED, reason)
        if resumed:
            if msg.attempt <= self.copies.get(rid, 0):  # its own repair (its state went on from there), or a copy
                return  # a newer one replaced (the scheduler numbers a copy it runs after a newer one as the newest)
            self.copies.remember(rid, msg.attempt)
        if resumed and aborted:  # its client lost the Finished(abort): it is told again (the engine acks the copy)
            fin = Finished(request_id=rid, finish_reason="abort", attempt=msg.attempt,
                           num_prompt_tokens=len(msg.prompt_token_ids), num_output_tokens=len(msg.resume_token_ids))  # fmt: skip
            self._send(msg.client, TextOutputs(step=-1, deltas=[], finished=[abort_finished(fin, before[1])]))
            return
        tomb = self.tombstones.get(rid)
        if resumed and tomb is not None and tomb.abort.attempt is not None and msg.attempt > tomb.abort.attempt:
            del self.tombstones[rid]  # its Abort ends only an older copy, which the scheduler replaces silently
        elif tomb is not None or (not resumed and (rid in self.live or before == CLOSED or aborted)):
            if not resumed:  # (a copy of one ended here: the Abort sent ends the copy too)
                self._violation(rid, "AddRequest for an id already in use")
            return
        # outputs overtook the registration (they are gone): a new request's made it an ORPHAN; a copy's, newer ones
        overtaken = self.overtaken.get(rid, -1) >= msg.attempt if resumed else before is not None
        state = self.requests.open(rid, DetokRequestState(msg, self.tokenizer))
        state.heard = self.steps.last
        if overtaken:
            self._repair(rid, "engine output arrived before the request was registered")

    def on_step(self, msg: StepOutputs) -> None:
        if msg.step >= 0 and not self.steps.accept(msg.step, msg.recent):
            self.duplicate_steps += 1
            return
        batches: dict[str, TextOutputs] = {}
        for out in msg.outputs:
            rid = out.request_id
            state = self.live.get(rid)
            if state is None:
                if rid in self.tombstones:
                    self.counts.stale += 1
                    if out.finish_reason is not None:
                        self.tombstones.pop(rid, None)
                else:
                    self._violation(rid, f"StepOutputs entry seq {out.seq}", out.attempt)
                continue
            if out.attempt != state.attempt:  # a replaced copy's (or a reordered one's): stale
                self.counts.stale += 1
                continue
            state.heard = max(state.heard, msg.step)
            if out.seq > state.num_output_tokens and state.attempt < MAX_ATTEMPTS:  # some output of it was lost
                self._repair(rid, f"output seq {out.seq}, expected {state.num_output_tokens}")
                continue
            first = state.num_prompt_tokens if state.num_output_tokens == 0 else None
            deltas, finished = state.process_run(out)
            self.tokens.output(first, deltas, finished)
            client = state.client
            batch = batches.get(client) or batches.setdefault(client, TextOutputs(step=msg.step, deltas=[]))
            batch.deltas += deltas
            if finished is not None:
                batch.finished.append(finished)
                self._close(rid)
                if out.finish_reason is None:  # we ended it; the engine still runs it
                    self._tombstone(rid, state.abort_reason or "stop", state.attempt)  # (this copy only)
        self.tokens.end_step()
        for client, batch in batches.items():
            if batch.deltas or batch.finished:
                self._send(client, batch)
        self._find_lost()

    def on_ack(self, msg: AbortAck) -> None:
        rid = msg.request_id
        if rid in self.tombstones:
            self.tombstones.pop(rid, None)
        elif rid in self.live and msg.attempt < self.live[rid].attempt:  # a replaced copy's
            self.counts.stale += 1
        elif rid in self.live:
            self._end_aborted(rid, msg.reason)
        else:
            self._violation(rid, "AbortAck", msg.attempt)

    def on_actor_down(self, msg: ActorDown) -> None:
        if msg.actor == self.scheduler:
            log.warning("engine down: forgetting %d requests and %d tombstones", len(self.live), len(self.tombstones))
            for rid in list(self.live):
                self.requests.forget(rid)  # not CLOSED: it may come back resumed
            self.tombstones.clear()
            self.copies.clear()  # the new scheduler numbers from what the clients have
            self.overtaken.clear()
            self.steps.reset()
        else:
            for rid in [r for r, state in self.live.items() if state.client == msg.actor]:
                self._close(rid)
                self._tombstone(rid, "client")

    def on_check(self, msg: CheckIdle) -> IdleReport:
        details = {**self.requests.idle_details, "pending_asks": self.pending_asks}
        return IdleReport(actor=self.name, idle=not any(details.values()), details=details)

    async def on_shutdown(self, reason: str) -> None:
        await self.until(lambda: not (self.live or self.tombstones), SHUTDOWN_DRAIN_S)
        for rid in list(self.live):  # the scheduler did not end it (it is not shutting down, or too slow)
            self._end_aborted(rid, reason)
            self.tell(self.scheduler, Abort(request_id=rid, reason=reason))

    # ------------------------------------------------------------ bookkeeping

    def _send(self, client: str, batch: TextOutputs, marker: bool = False) -> None:
        """Every message to a client is numbered; after output, markers follow for MARKERS_FOR_S."""
        batch.number, batch.replica = self.numbers.get(client, 0), self.replica
        self.numbers[client] = batch.number + 1
        names = [d.request_id for d in batch.deltas] + [f.request_id for f in batch.finished]
        batch.recent = self.names.setdefault(client, SentNames()).stamp(batch.number, names)
        if not marker:
            self.last_sent[client] = time.monotonic()
        self.tell(client, batch)

    def _end_aborted(self, rid: str, reason: AbortReason) -> None:
        self._end(rid, self.live[rid].abort(reason), aborted=reason)

    def _end(self, rid: str, finished: Finished, aborted: str | None = None) -> None:
        """Send a LIVE request's Finished on its own, and close it."""
        client = self.live[rid].client
        self._close(rid, aborted)
        self._send(client, TextOutputs(step=-1, deltas=[], finished=[finished]))

    def _close(self, rid: str, aborted: str | None = None) -> None:
        self.requests.close(rid, CLOSED if aborted is None else (ABORTED, aborted))

    def _fail(self, rid: str, error: str, abort: bool) -> None:
        """End a LIVE request with an error; with `abort`, the engine still runs it: TOMBSTONED."""
        finished = self.live[rid].abort("error")
        finished.error = f"request {rid}: {error}"
        self._end(rid, finished)
        if abort:
            self._tombstone(rid, "error")

    def _tombstone(self, rid: str, reason: AbortReason, attempt: int | None = None) -> None:
        """Abort the request in the engine (`attempt`: only that copy, and any older; its output ended it here)."""
        msg = Abort(request_id=rid, reason=reason, attempt=attempt)
        self.tombstones.add(msg, self.scheduler)
        self.tell(self.scheduler, msg)

    def _violation(self, rid: str, what: str, attempt: int = -1) -> None:
        self.counts.violations["any"] += 1
        log.info("[%s] protocol violation: %s for an id neither live nor tombstoned; dropped", rid, what)
        if rid not in self.fate:
            self.fate.remember(rid, ORPHAN)
        self.overtaken.remember(rid, max(attempt, self.overtaken.get(rid, -1)))  # (a copy's may come after them)

    def _find_lost(self) -> None:
        lost = self.steps.lost()
        if not lost:
            return
        self.lost_steps += len(lost)
        suspects = lost_suspects(self.steps, lost, self.live.items())
        log.error("engine steps %s lost: repairing %d requests that may have been in them", lost, len(suspects))
        for rid in suspects:
            self._repair(rid, f"engine output lost (steps {lost})")

    def _repair(self, rid: str, why: str) -> None:
        """Some output of a LIVE request may be lost: re-submit it from what its client has (DESIGN I6, I8). The
        scheduler replaces its copy and registers the new one here; until then its outputs are stale. A request
        re-submitted MAX_ATTEMPTS times already fails instead."""
        state = self.live[rid]
        if state.attempt >= MAX_ATTEMPTS:
            self._fail(rid, why, abort=True)
            return
        resumed = state.resume_request()
        log.warning("[%s] %s: resumed after %d tokens", rid, why, len(resumed.resume_token_ids))
        state.attempt = resumed.attempt
        self.copies.remember(rid, resumed.attempt)
        self.counts.resumes["lost_output"] += 1
        self.tell(self.scheduler, resumed)

    async def _housekeeping(self) -> None:
        """Find lost steps on a quiet link, re-send Aborts that got no terminal message (I7), publish counters."""
        while True:
            await asyncio.sleep(self.stats_interval_s)
            self._find_lost()
            for client, sent in self.last_sent.items():
                if time.monotonic() - sent < MARKERS_FOR_S:
                    self._send(client, TextOutputs(step=-1, deltas=[]), marker=True)
            self.tombstones.expire(time.monotonic(), self.tell)
            stats = DetokStats(
                stale_outputs_dropped_total=self.counts.stale, protocol_violations_total=self.counts.violations.total(),
                num_tombstones=len(self.tombstones), repairs_total=self.counts.resumes.total(), replica=self.replica,
                **self.tokens.report(),
            )  # fmt: skip
            for actor in self.stats_to:
                self.tell(actor, stats)
            self.moved()  # (a drain waits for the requests to end)

"""DetokenizerActor: StepOutputs in, one TextOutputs per step out, exactly one Finished per request.

Request states here: LIVE (registered by the scheduler's forwarded AddRequest) -> CLOSED on its
terminal message, or LIVE -> TOMBSTONED when this actor ends it early (stop string, seq gap, bad
token) and sends Abort to the scheduler -> CLOSED on the terminal message (AbortAck or a final
entry). Outputs for a tombstoned id are stale: dropped and counted. Outputs for an id that is
neither live nor tombstoned are protocol violations: logged, counted, dropped.

Cases (state x event -> action):
  LIVE       entry                -> TextDelta (+ Finished when terminal: CLOSED)
  LIVE       entry with stop str  -> Finished(stop) to the client now, Abort(stop) to the scheduler: TOMBSTONED
  LIVE       AbortAck             -> Finished(abort) to the client: CLOSED
  TOMBSTONED entry                -> stale (dropped); a terminal entry closes the tombstone
  TOMBSTONED AbortAck             -> CLOSED
  TOMBSTONED no terminal in time  -> Abort re-sent (idempotent); after max tries dropped with an error (I7)
  unknown    entry / AbortAck     -> protocol violation (a duplicate after close lands here too)
  any        ActorDown(scheduler) -> every LIVE request fails (Finished(error)); tombstones cleared
  any        ActorDown(client)    -> its LIVE requests are tombstoned and aborted in the engine
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from actors.detokenizer.incremental import token_table
from actors.detokenizer.request_state import DetokRequestState
from actors.runtime import Actor
from messages.wire import (
    Abort,
    AbortAck,
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

SCHEDULER = "scheduler"


@dataclass
class Tombstone:
    reason: str
    client: str
    since: float
    tries: int = 1


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
        self.abort_timeout_s = abort_timeout_s
        self.max_abort_tries = max_abort_tries
        self.stats_interval_s = stats_interval_s
        self.live: dict[str, DetokRequestState] = {}
        self.clients: dict[str, str] = {}  # request id -> the actor that receives its text
        self.tombstones: dict[str, Tombstone] = {}
        self.stale_dropped = 0
        self.violations = 0

    def handlers(self):
        return {
            AddRequest: self.on_add,
            StepOutputs: self.on_step,
            AbortAck: self.on_ack,
            ActorDown: self.on_actor_down,
            CheckIdle: self.on_check,
        }

    async def on_start(self) -> None:
        token_table(self.tokenizer)  # build the byte tables now, not on the first request
        self.spawn(self._housekeeping())

    def on_add(self, msg: AddRequest) -> None:
        rid = msg.request_id
        if rid in self.live or rid in self.tombstones:
            self._violation(rid, "AddRequest for an id already in use")
            return
        self.live[rid] = DetokRequestState(msg, self.tokenizer)
        self.clients[rid] = msg.client

    def on_step(self, msg: StepOutputs) -> None:
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
                    self._violation(rid, f"StepOutputs entry seq {out.seq}")
                continue
            delta, finished = state.process(out)
            client = self.clients[rid]
            batch = batches.get(client) or batches.setdefault(client, TextOutputs(step=msg.step, deltas=[]))
            if delta is not None:
                batch.deltas.append(delta)
            if finished is not None:
                batch.finished.append(finished)
                self._close(rid)
                if out.finish_reason is None:  # we ended it; the engine still runs it
                    self._tombstone(rid, state.abort_reason or "stop", client)
        for client, batch in batches.items():
            if batch.deltas or batch.finished:
                self.tell(client, batch)

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
            self._violation(rid, "AbortAck")

    def on_actor_down(self, msg: ActorDown) -> None:
        if msg.actor == SCHEDULER:
            log.warning(
                "engine down: failing %d live requests, clearing %d tombstones", len(self.live), len(self.tombstones)
            )
            for rid in list(self.live):
                client, state = self.clients[rid], self.live[rid]
                self._close(rid)
                self.tell(
                    client,
                    Finished(
                        request_id=rid,
                        finish_reason="error",
                        error="the engine died",
                        num_prompt_tokens=state.num_prompt_tokens,
                    ),
                )
            self.tombstones.clear()
        else:
            for rid in [r for r, c in self.clients.items() if c == msg.actor and r in self.live]:
                self._close(rid)
                self._tombstone(rid, "client", msg.actor)

    def on_check(self, msg: CheckIdle) -> IdleReport:
        details = {"live": len(self.live), "tombstones": len(self.tombstones)}
        return IdleReport(actor=self.name, idle=not any(details.values()), details=details)

    # ------------------------------------------------------------ bookkeeping

    def _close(self, rid: str) -> None:
        self.live.pop(rid, None)
        self.clients.pop(rid, None)

    def _tombstone(self, rid: str, reason: str, client: str) -> None:
        self.tombstones[rid] = Tombstone(reason, client, time.monotonic())
        self.tell(SCHEDULER, Abort(request_id=rid, reason=reason))

    def _close_tombstone(self, rid: str) -> None:
        self.tombstones.pop(rid, None)

    def _violation(self, rid: str, what: str) -> None:
        self.violations += 1
        log.info("[%s] protocol violation: %s for an id neither live nor tombstoned; dropped", rid, what)

    async def _housekeeping(self) -> None:
        """Re-send Aborts that got no terminal message (I7) and publish the protocol counters."""
        while True:
            await asyncio.sleep(self.stats_interval_s)
            now = time.monotonic()
            for rid, t in list(self.tombstones.items()):
                if now - t.since < self.abort_timeout_s:
                    continue
                if t.tries >= self.max_abort_tries:
                    log.error("[%s] no terminal message after %d aborts; tombstone dropped", rid, t.tries)
                    del self.tombstones[rid]
                else:
                    t.tries, t.since = t.tries + 1, now
                    self.tell(SCHEDULER, Abort(request_id=rid, reason=t.reason))
            stats = DetokStats(
                stale_outputs_dropped_total=self.stale_dropped,
                protocol_violations_total=self.violations,
                num_tombstones=len(self.tombstones),
            )
            self.tell(self.stats_to, stats)

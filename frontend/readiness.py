"""The HTTP front's readiness: whether it takes requests now, and when a client should come back if not.

The front listens as soon as its process has started, while the engine replicas still load their models. It serves
once the system has started (the supervisor's ActorUp(SUPERVISOR): every process Ready once, so every local engine
replica has loaded its model and said ready, as vLLM's readiness means; and this incarnation has heard of every actor
down), and from then on while an engine replica takes requests (actors/routing.py) that is not waiting out a restart
back-off (a replica past its restart intensity: actors/runtime/backoff.py). Otherwise the request paths answer 503
with Retry-After (`Unavailable`): the back-off left, else RESTART_RETRY_S while a process restarts, LOADING_RETRY_S
while the models load; `/health` is that 503 until the start ends, then whenever no replica serves (every actor up).

A replica that enters a back-off while no replica can take requests fails the requests waiting for one (503): nothing
waits out a crash loop. From the supervisor's ActorDown, per replica: `sluice:engine_restarts_total` (the
supervisor's count of restarts of its processes) and `sluice:engine_restart_backoff_seconds` (the back-off its next
restart waits; 0 while it serves or restarts at once).
"""

from __future__ import annotations

import logging
import math
import time

from actors.routing import ReplicaLink
from frontend.http_base import Unavailable
from frontend.requests import RequestTable
from messages.names import SUPERVISOR
from messages.wire import ActorDown

log = logging.getLogger("sluice.http")

LOADING_RETRY_S = 5  # Retry-After while the engine replicas load their models (seconds to minutes)
RESTART_RETRY_S = 1  # ... while a process restarts at once, or a replica's node has not joined


class Readiness:
    def __init__(self, table: RequestTable, url: str, names: list[str], clock=time.monotonic):
        self.table, self.replicas, self.clock = table, table.replicas, clock
        self.url, self.names = url, names
        self.started = False  # the supervisor said the system has started
        self.announced = False  # "serving at" was logged
        self.retry_at: dict[str, float] = {}  # a down actor -> when the supervisor restarts it (clock)
        self.backoff: dict[str, float] = {}  # ... and how long its restart waits (0: at once)
        self.restarts: dict[int, int] = {}  # replica -> the supervisor's count of restarts of its processes
        table.metrics.restarts = self.rows

    def on_down(self, msg: ActorDown) -> None:
        r = self.replicas.of(msg.actor)
        if r is None or msg.actor not in r.names.actors:
            return
        self.retry_at[msg.actor], self.backoff[msg.actor] = self.clock() + msg.retry_in_s, msg.retry_in_s
        self.restarts[r.index] = max(self.restarts.get(r.index, 0), msg.restarts)
        if msg.retry_in_s > 0 and (refusal := self.refusal()) is not None:
            for req in dict.fromkeys(c.request for c in self.table.live.values() if c.record.orphaned):
                log.warning("[%s] failed: %s", req.id, refusal.message)  # (none takes it before the back-off ends)
                self.table.fail_request(req, refusal, False)

    def on_up(self, actor: str) -> None:
        self.started |= actor == SUPERVISOR
        self.retry_at.pop(actor, None)
        self.backoff.pop(actor, None)
        if self.started and not self.announced and self.replicas.serving():
            self.announced = True
            log.info("serving %s at %s", ", ".join(self.names), self.url)

    def wait_s(self, r: ReplicaLink) -> float:
        """Seconds before the dead processes of replica r are restarted (0: it serves, or they restart now)."""
        now = self.clock()
        return max((self.retry_at.get(a, now) - now for a in r.down), default=0.0)

    def taking(self) -> list[ReplicaLink]:
        """The replicas a request may go to now: none before the start has ended, nor one waiting out a back-off."""
        return [r for r in self.replicas.taking() if self.wait_s(r) <= 0] if self.started else []

    def refusal(self, health: bool = False) -> Unavailable | None:
        """Why a request cannot be taken now (`health`: why /health is not 200: no replica serves), or None."""
        if not self.started:
            return Unavailable("the server is starting: the engine is loading the model; retry later", LOADING_RETRY_S)
        if self.replicas.serving() if health else self.taking():
            return None
        wait, down = min(map(self.wait_s, self.replicas.all)), " and ".join(self.replicas.down())
        why = f"keeps failing: restarting in {math.ceil(wait)} s" if wait > 0 else "is down (restarting)"
        return Unavailable(f"the {down} {why}; retry later", max(RESTART_RETRY_S, math.ceil(wait)))

    def rows(self) -> list[tuple[int, int, float]]:
        """Per replica: (its index, the restarts of its processes, the back-off its next restart waits)."""
        return [(r.index, self.restarts.get(r.index, 0), max((self.backoff.get(a, 0.0) for a in r.down), default=0.0))
                for r in self.replicas.all]  # fmt: skip

"""The HTTP front's readiness: the supervisor's ActorDown / ActorUp as the front hears them, whether it takes
requests now, and when a client should come back if not.

The front listens as soon as its process has started, while the engine replicas still load their models. It serves
once the system has started (the supervisor's ActorUp(SUPERVISOR): every process Ready once, so every local engine
replica has loaded its model and said ready, as vLLM's readiness means; and this incarnation has heard of every actor
down), and from then on while an engine replica takes requests (actors/routing.py) that is not waiting out a restart
back-off (a replica past its restart intensity: actors/runtime/backoff.py; the router skips it too). A replica on
another node is down until the door says its node has joined (actors/replica_link.py: it tells a restarted front
again). Otherwise the request paths answer 503 with Retry-After (`Unavailable`): the back-off left; once it has ended,
LOADING_RETRY_S while the restarted process loads; RESTART_RETRY_S while a process restarts at once; LOADING_RETRY_S
while the models load. `/health` is that 503 until the start ends, then whenever no replica serves (every actor up).

A replica that enters a back-off while no replica can take requests fails (503) the requests waiting for one and
those its engine holds (its worker in back-off): nothing waits out a crash loop. From the supervisor's ActorDown, per
replica: `sluice:engine_restarts_total` (the supervisor's count of restarts of its processes) and
`sluice:engine_restart_backoff_seconds` (the seconds left before its next restart; 0 while it serves, restarts at
once, or loads after its back-off).
"""

from __future__ import annotations

import logging
import math

from actors.routing import ReplicaLink
from frontend.http_base import Unavailable
from frontend.requests import RequestTable
from messages.names import SUPERVISOR
from messages.wire import ActorDown, ActorUp

log = logging.getLogger("sluice.http")

LOADING_RETRY_S = 5  # Retry-After while an engine replica loads its model (seconds to minutes)
RESTART_RETRY_S = 1  # ... while a process restarts at once, or a replica's node has not joined


class Readiness:
    def __init__(self, table: RequestTable, url: str, names: list[str], local: int | None = None):
        """`local`: the replicas 0 .. local-1 run on this node (None: all); the others are down until joined."""
        self.table, self.replicas = table, table.replicas
        self.url, self.names = url, names
        self.started = False  # the supervisor said the system has started
        self.announced = False  # "serving at" was logged
        self.restarts: dict[int, int] = {}  # replica -> the supervisor's count of restarts of its processes
        for r in self.replicas.all[local:] if local is not None else ():  # (no request yet: nothing to resume)
            r.down.update(r.names.actors)
        table.metrics.restarts = self.rows

    def on_down(self, msg: ActorDown) -> None:
        """A replica's scheduler or detokenizer: its requests go on elsewhere (or wait); its worker: they wait in its
        engine. Either way it is out of rotation until it serves again, and past its restart intensity with no
        replica to go to, they fail."""
        r = self.replicas.of(msg.actor)
        ours = r is not None and msg.actor in r.names.actors
        if ours:  # (first: where its requests are re-submitted skips a back-off)
            if msg.retry_in_s > 0:
                r.restart_at[msg.actor] = self.replicas.clock() + msg.retry_in_s
            else:
                r.restart_at.pop(msg.actor, None)
            self.restarts[r.index] = max(self.restarts.get(r.index, 0), msg.restarts)
        if self.table.on_down(msg.actor):
            self.table.metrics.forget(msg.actor)
            log.error("%s is down (%s): its requests go on on the replicas that serve (%d live)", msg.actor,
                      msg.reason, len(self.table.live))  # fmt: skip
        if ours and msg.retry_in_s > 0 and (refusal := self.refusal()) is not None:
            stuck = (c.request for c in self.table.live.values() if c.record.orphaned or c.record.replica is r)
            for req in dict.fromkeys(stuck):  # (none takes them before the back-off ends)
                log.warning("[%s] failed: %s", req.id, refusal.message)
                self.table.fail_request(req, refusal)  # (aborted in the engine that holds it, if one does)

    def on_up(self, msg: ActorUp) -> None:
        if (r := self.replicas.of(msg.actor)) is not None:
            r.restart_at.pop(msg.actor, None)
        if self.table.on_up(msg.actor):
            log.info("%s is back: its engine replica serves", msg.actor)
        self.started |= msg.actor == SUPERVISOR
        if self.started and not self.announced and self.replicas.serving():
            self.announced = True
            log.info("serving %s at %s", ", ".join(self.names), self.url)

    def taking(self) -> list[ReplicaLink]:
        """The replicas a request may go to now (none before the start has ended): Replicas.taking."""
        return self.replicas.taking() if self.started else []

    def refusal(self, health: bool = False) -> Unavailable | None:
        """Why a request cannot be taken now (`health`: why /health is not 200: no replica serves), or None."""
        if not self.started:
            return Unavailable("the server is starting: the engine is loading the model; retry later", LOADING_RETRY_S)
        if self.replicas.serving() if health else self.taking():
            return None
        now = self.replicas.clock()
        retry, why = min(self._retry(r, now) for r in self.replicas.all)
        return Unavailable(f"the {' and '.join(self.replicas.down())} {why}; retry later", retry)

    @staticmethod
    def _retry(r: ReplicaLink, now: float) -> tuple[int, str]:
        """When replica r may take requests again (Retry-After), and why not now."""
        if (wait := r.wait_s(now)) > 0:
            return math.ceil(wait), f"keeps failing: restarting in {math.ceil(wait)} s"
        if r.down & r.restart_at.keys():  # (its back-off has ended: the restarted process loads)
            return LOADING_RETRY_S, "keeps failing: restarted after a back-off, loading"
        return RESTART_RETRY_S, "is down (restarting)"

    def rows(self) -> list[tuple[int, int, float]]:
        """Per replica: (its index, the restarts of its processes, the seconds left before its next restart)."""
        now = self.replicas.clock()
        return [(r.index, self.restarts.get(r.index, 0), round(r.wait_s(now), 3)) for r in self.replicas.all]

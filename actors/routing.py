"""A client's view of the engine replicas (--data-parallel-size) and which one a request goes to (--dp-routing).
Pure Python: the HTTP process imports it.

A replica serves while its actors are up (its request path: it holds requests; its worker: it runs them;
messages/names.py); the client numbers its
detokenizer's TextOutputs on a link of its own. Its load is 4 x waiting + running (vLLM's data-parallel balance), from
its last EngineStats, plus the requests routed to it since. Its cache's prefixes are the anchors it reports
(actors/prefix_hash.py) and those of the prompts routed to it over its last two reports (a prompt sent is cached
there by the time the report after next is made; a burst of one system prompt stays on one replica meanwhile).

Policies, and the reason each choice is counted under (sluice:dp_routed_total{policy,reason}):
  round_robin    the next replica that serves                                    round_robin
  least_loaded   the least loaded replica (the lowest index of equals)          least_loaded
  cache_aware    the replica holding the prompt's deepest anchor (the least loaded of those that hold it)
                                                                                cache_hit
                 ... unless its load passes the least one's by more than load_gap: the least loaded
                                                                                imbalance
                 no replica holds any anchor of it: the least loaded            no_hit
A request's n choices (and its CFG companions, which the engine makes) are routed once, together: they share the
prompt's blocks. A request resumed after its replica died is routed again, among the replicas that serve. With
none serving, a replica whose only down actor is its worker still takes requests (they wait in its engine), unless
the worker waits out a restart back-off (`restart_at`, told by the supervisor's ActorDown: frontend/readiness.py).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Literal

from actors.prefix_hash import anchors
from actors.protocol import StepNumbers
from messages.names import Replica, replica, replica_of
from messages.wire import AddRequest, EngineStats

Policy = Literal["cache_aware", "least_loaded", "round_robin"]
POLICIES: tuple[Policy, ...] = ("cache_aware", "least_loaded", "round_robin")
LOAD_GAP = 16  # cache_aware: the load a replica may carry above the least loaded one and still take its hits


class ReplicaLink:
    """What the client knows of one replica."""

    def __init__(self, index: int):
        self.names: Replica = replica(index)
        self.link = StepNumbers()  # the numbering of its detokenizer's TextOutputs
        self.down: set[str] = set()  # its actors that are down
        self.restart_at: dict[str, float] = {}  # ... past their restart intensity: when the supervisor restarts them
        self.generation = 0  # how many times it forgot its requests (a record sent before then is an orphan)
        self.stats: EngineStats | None = None  # its last report
        self.routed = 0  # requests routed to it since that report
        self.anchors: set[bytes] = set()  # reported ...
        self.sent: list[set[bytes]] = [set(), set()]  # ... and of the prompts routed to it over its last two reports

    @property
    def index(self) -> int:
        return self.names.index

    @property
    def serves(self) -> bool:
        return not self.down

    @property
    def forgot(self) -> bool:
        """An actor of its request path is down: it holds no request (those it held are re-submitted)."""
        return not self.down.isdisjoint(self.names.request_path)

    def wait_s(self, now: float) -> float:
        """Seconds left of the back-off its down actors wait out (0: none does, or it has ended)."""
        return max([0.0, *(self.restart_at[a] - now for a in self.down if a in self.restart_at)])

    @property
    def load(self) -> int:
        s = self.stats
        return self.routed + (0 if s is None else 4 * s.num_waiting + s.num_running)

    def holds(self, anchor: bytes) -> bool:
        return anchor in self.anchors or anchor in self.sent[0] or anchor in self.sent[1]

    def on_stats(self, msg: EngineStats) -> None:
        self.stats, self.routed = msg, 0
        self.anchors = set(msg.prefix_anchors)
        self.sent = [set(), self.sent[0]]

    def forget(self) -> None:
        """Its request path died: its requests, cache and load are gone (reported afresh once it is back)."""
        self.generation += 1
        self.stats, self.routed, self.anchors, self.sent = None, 0, set(), [set(), set()]


class Replicas:
    def __init__(self, size: int = 1, policy: Policy = "cache_aware", block_size: int = 16, load_gap: int = LOAD_GAP,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        """`clock`: the time of ReplicaLink.restart_at."""
        self.all = [ReplicaLink(k) for k in range(size)]
        self.policy, self.block_size, self.load_gap, self.clock = policy, block_size, load_gap, clock
        self.routed: collections.Counter[tuple[str, str]] = collections.Counter()  # (policy, reason) -> requests
        self._next = 0  # round_robin's

    def __getitem__(self, k: int) -> ReplicaLink:
        return self.all[k]

    def __len__(self) -> int:
        return len(self.all)

    def of(self, actor: str) -> ReplicaLink | None:
        """The replica an actor name belongs to (None: none of these)."""
        k = replica_of(actor)
        return self.all[k] if k is not None and k < len(self.all) else None

    def serving(self) -> list[ReplicaLink]:
        return [r for r in self.all if r.serves]

    def taking(self) -> list[ReplicaLink]:
        """Those a request may go to: the replicas that serve, or else those whose only down actor is the worker
        (their requests wait in their engine until it is back), unless it waits out a back-off."""
        now = self.clock()
        return self.serving() or [r for r in self.all if not r.forgot and r.wait_s(now) <= 0]

    def down(self) -> list[str]:
        """The actors that are down, of every replica."""
        return sorted(a for r in self.all for a in r.down)

    def on_stats(self, msg: EngineStats) -> None:
        if 0 <= msg.replica < len(self.all):
            self.all[msg.replica].on_stats(msg)

    def route(self, msg: AddRequest) -> ReplicaLink | None:
        """The replica for a request (and its siblings); None when none takes requests."""
        serving = self.taking()
        if not serving:
            return None
        if len(self.all) == 1:
            return serving[0]
        cache_aware = self.policy == "cache_aware"
        prompt = (
            anchors(msg.prompt_token_ids, self.block_size, msg.params.cache_salt, msg.params.lora)
            if cache_aware
            else []
        )
        chosen, reason = self._choose(prompt, serving)
        self.routed[self.policy, reason] += 1
        chosen.routed += 1
        chosen.sent[0].update(prompt)
        return chosen

    def _choose(self, prompt: list[bytes], serving: list[ReplicaLink]) -> tuple[ReplicaLink, str]:
        if self.policy == "round_robin":  # (the next index from the last one taken that serves)
            chosen = min(serving, key=lambda r: (r.index - self._next) % len(self.all))
            self._next = chosen.index + 1
            return chosen, "round_robin"
        least = min(serving, key=lambda r: r.load)
        if self.policy == "least_loaded":
            return least, "least_loaded"
        for anchor in reversed(prompt):
            holders = [r for r in serving if r.holds(anchor)]
            if holders:
                best = min(holders, key=lambda r: r.load)
                return (best, "cache_hit") if best.load <= least.load + self.load_gap else (least, "imbalance")
        return least, "no_hit"

"""Seeded fault injection in the mailbox send path (DESIGN section 8).

A FaultPlan is JSON: {"seed": 7, "rules": [{"link": "scheduler->detokenizer",
"msg_type": "StepOutputs", "action": "drop", "probability": 0.1}]}. `link` and `msg_type` are
fnmatch patterns. Each link draws from its own RNG seeded by (seed, link name), so a link's
faults depend only on the seed and that link's own traffic: the same seed replays the same faults.

Actions: `drop`; `duplicate` (sent twice); `delay` (the link stalls for delay_ms, later messages
queue behind it: FIFO is kept); `reorder` (the message is held and sent right after the next one
on the link, or after delay_ms (default 50) if none comes; while the link is stalled it queues like the rest).

`raise` applies at a code site instead of a link: {"action": "raise", "site": "scheduler.update", "request":
"poison-*", "skip": 3} raises InjectedFault there for the requests whose id matches `request` (fnmatch: the
server suffixes the ids it is given), once `skip` of its matches have passed; each site draws from its own RNG.
Sites: "scheduler.schedule" (each step a request's rows are planned into: a running request's once it has room, a
waiting one's as it is admitted, never a blocked attempt) and "scheduler.update" (a sampling row's tokens applied to a
request still running): the engine fails that request alone (actors/engine/isolation.py). Links never apply raise
rules.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import pathlib
import random
import zlib
from typing import Literal

import msgspec

log = logging.getLogger("sluice.faults")

FAULT_PLAN_ENV = "SLUICE_FAULT_PLAN"
Action = Literal["delay", "drop", "duplicate", "reorder", "raise"]


class InjectedFault(RuntimeError):
    """What a raise rule raises at its site."""


class FaultRule(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    action: Action
    link: str = "*"
    msg_type: str = "*"
    probability: float = 1.0
    delay_ms: float = 0.0
    site: str = "*"  # raise: the code site (fnmatch)
    request: str = "*"  # raise: the request ids it hits (fnmatch)
    skip: int = 0  # raise: how many of its matches pass before it may fire

    def matches(self, link: str, msg_type: str) -> bool:
        return (
            self.action != "raise"
            and fnmatch.fnmatchcase(link, self.link)
            and fnmatch.fnmatchcase(msg_type, self.msg_type)
        )

    def hits(self, site: str, request_id: str) -> bool:
        return (
            self.action == "raise"
            and fnmatch.fnmatchcase(site, self.site)
            and fnmatch.fnmatchcase(request_id, self.request)
        )


class FaultPlan(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    seed: int = 0
    rules: list[FaultRule] = []

    @classmethod
    def parse(cls, source: str) -> FaultPlan:
        """`source` is JSON text or the path of a JSON file."""
        text = source if source.lstrip().startswith("{") else pathlib.Path(source).read_text()
        return msgspec.json.decode(text, type=cls)

    @classmethod
    def from_env(cls) -> FaultPlan | None:
        source = os.environ.get(FAULT_PLAN_ENV)
        return cls.parse(source) if source else None

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()


class FaultInjector:
    """Decides, per message, which rule (if any) fires on a link."""

    def __init__(self, plan: FaultPlan):
        self.plan = plan
        self._rngs: dict[str, random.Random] = {}
        self._passed = [0] * len(plan.rules)  # each raise rule's matches so far
        self.fired: dict[str, int] = {}

    def decide(self, link: str, msg_type: str) -> FaultRule | None:
        return self._draw(link, [r for r in self.plan.rules if r.matches(link, msg_type)], msg_type)

    def check(self, site: str, request_id: str) -> None:
        """Raise InjectedFault if a raise rule fires at `site` for the request."""
        rules = []
        for i, rule in enumerate(self.plan.rules):
            if rule.hits(site, request_id):
                self._passed[i] += 1
                if self._passed[i] > rule.skip:
                    rules.append(rule)
        if self._draw(site, rules, request_id) is not None:
            raise InjectedFault(f"a fault plan's raise rule fired at {site}")

    def _draw(self, name: str, rules: list[FaultRule], what: str) -> FaultRule | None:
        """The first of `rules` that fires on `name` (a link or a site), drawing from its RNG for every one: its
        stream does not depend on outcomes."""
        if not rules:
            return None
        rng = self._rngs.get(name)
        if rng is None:
            rng = self._rngs[name] = random.Random(self.plan.seed * 1_000_003 + zlib.crc32(name.encode()))
        fired = None
        for rule in rules:
            if rng.random() < rule.probability and fired is None:
                fired = rule
        if fired is not None:
            self.fired[fired.action] = self.fired.get(fired.action, 0) + 1
            log.debug("fault %s on %s %s (rule %s)", fired.action, name, what, fired)
        return fired

"""Seeded fault injection in the mailbox send path (DESIGN section 8).

A FaultPlan is JSON: {"seed": 7, "rules": [{"link": "scheduler->detokenizer",
"msg_type": "StepOutputs", "action": "drop", "probability": 0.1}]}. `link` and `msg_type` are
fnmatch patterns. Each link draws from its own RNG seeded by (seed, link name), so a link's
faults depend only on the seed and that link's own traffic: the same seed replays the same faults.

Actions: `drop`; `duplicate` (sent twice); `delay` (the link stalls for delay_ms, later messages
queue behind it: FIFO is kept); `reorder` (the message is held and sent right after the next one
on the link, or after delay_ms (default 50) if none comes; while the link is stalled it queues like the rest).
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
Action = Literal["delay", "drop", "duplicate", "reorder"]


class FaultRule(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    action: Action
    link: str = "*"
    msg_type: str = "*"
    probability: float = 1.0
    delay_ms: float = 0.0

    def matches(self, link: str, msg_type: str) -> bool:
        return fnmatch.fnmatchcase(link, self.link) and fnmatch.fnmatchcase(msg_type, self.msg_type)


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
        self.fired: dict[str, int] = {}

    def decide(self, link: str, msg_type: str) -> FaultRule | None:
        rules = [r for r in self.plan.rules if r.matches(link, msg_type)]
        if not rules:
            return None
        rng = self._rngs.get(link)
        if rng is None:
            rng = self._rngs[link] = random.Random(self.plan.seed * 1_000_003 + zlib.crc32(link.encode()))
        fired = None
        for rule in rules:  # draw for every matching rule: the RNG stream does not depend on outcomes
            if rng.random() < rule.probability and fired is None:
                fired = rule
        if fired is not None:
            self.fired[fired.action] = self.fired.get(fired.action, 0) + 1
            log.debug("fault %s on %s %s (rule %s)", fired.action, link, msg_type, fired)
        return fired

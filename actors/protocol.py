"""Bookkeeping for the cancellation protocol (DESIGN section 3): a bounded memory of request ids
(duplicates and overtaken messages), the tombstones of aborted requests (I4, I7), the request ledger every party
keeps (live -> tombstoned -> closed), the numbering of StepOutputs and TextOutputs (duplicates, reorders, losses),
and the step gate tests use to hold an engine step in flight. A client's side (its records of requests, resumes)
is actors/client_ledger.py.
Pure Python: the HTTP process imports it."""

from __future__ import annotations

import asyncio
import collections
import logging
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from messages.wire import Abort

LOST_AFTER_STEPS = 2  # a reorder displaces a message by one
LOST_AFTER_S = 1.0
RECENT = 2  # numbered messages name the requests of this many before them (a reorder displaces one by one)
KEPT = LOST_AFTER_STEPS + RECENT  # the numbers of a gap StepNumbers tracks one by one (the rest: one for all)
MAX_ATTEMPTS = 32  # a request whose copy is numbered this high (AddRequest.attempt) fails at its next loss (a loss
# repairs every request that may have been in the lost message: a long request under steady loss collects many)
CLIENT_COPIES, DETOK_COPIES = 1, 0  # the parity of the attempt numbers each party gives the copies it makes


def next_attempt(attempt: int, parity: int) -> int:
    """The number of a new copy of a request whose newest known copy is `attempt`: the next one of the party's
    parity. A client and the detokenizer may re-submit the same request at once, from different tokens; distinct
    numbers let every party agree which copy is current: the highest (actors/engine/intake.py)."""
    return attempt + 1 if (attempt + 1) % 2 == parity else attempt + 2


class Heard(Protocol):
    heard: int  # the number of the last message on the link that had output of the request (or came before it)


class RecentIds(dict):
    """The last `capacity` request ids, each with a note, oldest forgotten first. Ids are unique for
    the life of the server (I1), so this tells a duplicate or an overtaken message from a new request."""

    def __init__(self, capacity: int = 1 << 16):
        super().__init__()
        self.capacity = capacity

    def remember(self, rid: str, note) -> None:
        self[rid] = note
        if len(self) > self.capacity:
            del self[next(iter(self))]


@dataclass(slots=True)
class Tombstone:
    abort: Abort  # the Abort sent, re-sent as it is
    to: str  # the actor it was sent to (a replica's scheduler)
    since: float  # when the last Abort was sent
    tries: int


class Tombstones(dict):
    """Requests this party aborted, awaiting their terminal message (I4): request id -> Tombstone."""

    def __init__(self, abort_timeout_s: float, max_abort_tries: int, log: logging.Logger):
        super().__init__()
        self.abort_timeout_s = abort_timeout_s
        self.max_abort_tries = max_abort_tries
        self.log = log

    def add(self, abort: Abort, to: str, sent: bool = True) -> None:
        """`sent`: the Abort was sent (to `to`). If not (the engine is gone) one timeout passes, then the tombstone
        is dropped."""
        self[abort.request_id] = Tombstone(abort, to, time.monotonic(), 1 if sent else self.max_abort_tries)

    def drop(self, to: str) -> None:
        """`to` died: no terminal message will come for the Aborts sent to it."""
        for rid in [rid for rid, t in self.items() if t.to == to]:
            del self[rid]

    def expire(self, now: float, resend: Callable[[str, Abort], None]) -> None:
        """I7: `resend` (to, abort) the Abort of a tombstone that got no terminal message within the timeout; after
        max_abort_tries the tombstone is dropped with an error log."""
        for rid, t in list(self.items()):
            if now - t.since < self.abort_timeout_s:
                continue
            if t.tries >= self.max_abort_tries:
                self.log.error("[%s] no terminal message in time (%s); tombstone dropped", rid, t.abort.reason)
                del self[rid]
            else:
                t.tries, t.since = t.tries + 1, now
                resend(t.to, t.abort)


@dataclass
class ProtocolCounts:
    """What a party's ledger dropped or repaired (exported as metrics)."""

    stale: int = 0  # outputs of a tombstoned request or of a replaced copy: dropped
    # by kind: unknown_id, duplicate, gap, after_finished (output past the count a Finished reported)
    violations: collections.Counter = field(default_factory=collections.Counter)
    # requests re-submitted from their record (DESIGN I8), by cause: death (of an engine-side process), lost_output
    # (a gap in a request's outputs, DESIGN I6)
    resumes: collections.Counter = field(default_factory=collections.Counter)


S = TypeVar("S")


class Ledger(Generic[S]):
    """One party's requests (DESIGN section 3): LIVE (its state S) -> CLOSED on its terminal message, or CLOSED here
    early and TOMBSTONED (an Abort sent: awaiting the engine's terminal message, I4, I7). `fate` remembers, for the
    last RecentIds.capacity ids no longer live, the party's note of what became of each (the tokens its Finished
    accounted for, an abort reason), which tells a duplicate or an overtaken message from an unknown id."""

    def __init__(
        self, abort_timeout_s: float, max_abort_tries: int, log: logging.Logger, counts: ProtocolCounts | None = None
    ):
        self.live: dict[str, S] = {}
        self.tombstones = Tombstones(abort_timeout_s, max_abort_tries, log)
        self.fate = RecentIds()
        self.counts = counts or ProtocolCounts()
        self.log = log

    def open(self, rid: str, state: S) -> S:
        self.live[rid] = state
        self.fate.pop(rid, None)
        return state

    def close(self, rid: str, note) -> S:
        self.fate.remember(rid, note)
        return self.live.pop(rid)

    def forget(self, rid: str) -> S:
        """Drop a LIVE request without a trace (the engine side forgot it: it may come back resumed)."""
        return self.live.pop(rid)

    @property
    def idle_details(self) -> dict[str, int]:
        return {"live": len(self.live), "tombstones": len(self.tombstones)}


def lost_suspects(link: StepNumbers, lost: Lost, records: Iterable[tuple[str, Heard]]) -> list[str]:
    """The requests that may have had output in the messages `link.lost()` just declared `lost`: those a later
    message named (its `recent`), or, when one was not named (more than RECENT lost in a row, or none came after
    it), every request not heard from since. `records` is read only then (nothing is built per message)."""
    named = [link.named.pop(run.start, None) for run in lost.runs]
    if any(ids is None for ids in named):
        return [rid for rid, r in records if r.heard < lost.runs[-1].stop - 1]
    names = {rid for ids in named for rid in ids}
    return [rid for rid, _ in records if rid in names]


@dataclass(frozen=True)
class Lost:
    """The numbers `StepNumbers.lost` declared lost, as runs of consecutive numbers (ascending): len() is how many
    numbers (a gap of 10**6 counts 10**6; at most sys.maxsize, len()'s bound, which only a sender numbering falsely
    passes), str() the runs ("1..999996, 999998")."""

    runs: tuple[range, ...] = ()

    def __len__(self) -> int:
        return min(sum(run.stop - run.start for run in self.runs), sys.maxsize)

    def __str__(self) -> str:
        merged: list[list[int]] = []  # (adjacent runs shown as one)
        for run in self.runs:
            if merged and merged[-1][1] == run.start:
                merged[-1][1] = run.stop
            else:
                merged.append([run.start, run.stop])
        return ", ".join(f"{a}..{b - 1}" if b - a > 1 else f"{a}" for a, b in merged)


class SentNames:
    """A sender's side of `recent` (StepOutputs, TextOutputs): the request ids of its last RECENT numbered messages
    on one link, stamped on the next, so a receiver that loses one repairs only the requests it held. An id the
    stamped message holds too is left out: its output there shows the loss as a seq gap (repaired as such), so
    while a batch decodes steadily the names are only of the requests that ended or paused."""

    def __init__(self):
        self.entries: collections.deque[tuple[int, list[str]]] = collections.deque(maxlen=RECENT)

    def stamp(self, number: int, request_ids: list[str]) -> list[tuple[int, list[str]]]:
        """The `recent` of message `number`, which holds `request_ids`."""
        here = set(request_ids)
        recent = [(n, [rid for rid in ids if rid not in here]) for n, ids in self.entries]
        self.entries.appendleft((number, request_ids))
        return recent


class StepNumbers:
    """The message-level seq check on one link's numbered StepOutputs (step 0 starts an engine incarnation).

    `accept` is False for a duplicate. A skipped number is missing until it arrives late (reordered:
    accepted) or `lost` declares it lost: LOST_AFTER_STEPS later steps came, or LOST_AFTER_S passed. One arriving
    after that is taken as a duplicate (its requests were repaired: their next outputs show any seq gap, DESIGN I6).

    A gap costs O(KEPT) whatever its size (a sender numbers its messages freely: one numbered 2**62 after 0 must not
    make a receiver list 2**62 numbers). Only the last KEPT numbers of a gap can still be named by a later message's
    `recent`: each is an entry of its own; the run before them is one entry (its first number, its end), lost at the
    next `lost()` (LOST_AFTER_STEPS later numbers came) and never named, which makes `lost_suspects` repair every
    request not heard from since, as the whole run of them would. `lost()` reports the runs: their true count and
    ranges."""

    def __init__(self):
        self.next: int | None = None
        self.missing: dict[int, tuple[float, int]] = {}  # first number of a missing run -> (when found, its end)
        self.named: dict[int, list[str]] = {}  # missing step -> the request ids a later message says it held

    @property
    def last(self) -> int:
        """The highest step accepted (-1: none yet)."""
        return -1 if self.next is None else self.next - 1

    def reset(self) -> None:
        self.next = None
        self.missing.clear()
        self.named.clear()

    def accept(self, step: int, recent: list[tuple[int, list[str]]] = ()) -> bool:
        """`recent`: the message's names of the messages before it (SentNames), kept for those found missing."""
        if self.next is None or (step == 0 and self.next > 1):
            self.missing.clear()
            self.named.clear()
            self.next = step + 1
        elif step >= self.next:
            now, tracked = time.monotonic(), max(self.next, step - KEPT)
            if self.next < tracked:  # (the run of the gap's numbers before those tracked: one entry)
                self.missing[self.next] = (now, tracked)
            for s in range(tracked, step):
                self.missing[s] = (now, s + 1)
            self.next = step + 1
        elif (first := self._run_of(step)) is None:
            return False  # a duplicate
        else:  # a late (reordered) message: out of its run
            self.named.pop(step, None)
            when, end = self.missing.pop(first)
            for a, b in ((first, step), (step + 1, end)):
                if a < b:
                    self.missing[a] = (when, b)
        for number, ids in recent:
            if self.missing.get(number, (0, None))[1] == number + 1:  # (a run of one: a run longer is never named)
                self.named[number] = ids
        return True

    def _run_of(self, step: int) -> int | None:
        """The first number of the missing run that holds `step` (None: none does)."""
        if step in self.missing:
            return step
        return next((first for first, (_, end) in self.missing.items() if first < step < end), None)

    def lost(self) -> Lost:
        now = time.monotonic()
        gone = [s for s, (t, _) in self.missing.items() if self.last - s >= LOST_AFTER_STEPS or now - t >= LOST_AFTER_S]
        return Lost(tuple(range(s, self.missing.pop(s)[1]) for s in sorted(gone)))


class StepGate:
    """A test hook that makes protocol races deterministic (EngineConfig.step_gate): `set(k)` lets k more
    steps through `wait()` (None: all). A step held there is executed and still in flight: what goes in its
    StepOutputs waits with it, the terminal outputs of requests the engine refuses or fails meanwhile among them
    (actors/engine/step_outputs.py)."""

    def __init__(self):
        self.permits: int | None = None
        self.holding = False
        self._moved = asyncio.Event()

    def set(self, permits: int | None) -> None:
        self.permits = permits
        self._moved.set()

    async def wait(self) -> None:
        self.holding = self.permits == 0
        while self.permits == 0:
            self._moved.clear()
            await self._moved.wait()
        self.holding = False
        if self.permits is not None:
            self.permits -= 1

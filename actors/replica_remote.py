"""What the front's door (actors/replica_link.py) knows of one engine replica on another node: its node's launcher,
the epoch it is offered or serves in, the relays sent to it, and how its detokenizer numbers the TextOutputs it sends.

A node's detokenizer numbers its TextOutputs to the client consecutively (from 0 per incarnation), and the client lists
the numbers skipped as missing until found or lost (actors/protocol.py's StepNumbers). While the replica is up,
honest numbers skip only what was lost on the way: what one reconnection of its link drops (the node's queue: at
most ZMQ's high-water mark, 1000 messages), or what the node sent while it missed the door's Welcome (at most the
HELLO_S after its STALE_S without one, 6 s: then it leaves the epoch, the door takes it down, and the client numbers
its link afresh). A number further than NUMBER_WINDOW ahead of the highest one before is no loss but a node that
numbers falsely (one numbered 2**62 made the client list every number up to it), a protocol violation: the door
takes the replica out of rotation (its requests go on elsewhere), counts it, and offers its node no new epoch for
QUARANTINE_S, doubling with each violation of that replica up to 64 times that (a node that keeps numbering falsely
does not flap in and out of rotation). A gap costs the client O(KEPT) whatever its size (StepNumbers), so the window
need not be tight: 2**20 is a thousand times the high-water mark, and 6 s of messages at 170,000 a second (one per
engine step: a fast GPU's decode steps a few thousand a second), so no honest outage trips it.
"""

from __future__ import annotations

import secrets

from messages.names import replica

NUMBER_WINDOW = 2**20
QUARANTINE_S = 5.0


class Remote:
    """What the door knows of one remote replica."""

    def __init__(self, index: int) -> None:
        self.names = replica(index)
        self.peer: bytes | None = None  # its node's launcher
        self.heard = 0.0
        self.epoch = secrets.randbits(48)
        self.sent = 0  # relays sent in this epoch
        self.offered = False  # a Welcome of this epoch was sent since it was last down (a lost one is sent again)
        self.up = False
        self.number: int | None = None  # the highest TextOutputs.number it relayed since it came up
        self.violations = 0  # its protocol violations (each took it down)
        self.barred_until = 0.0  # (time.monotonic) no new epoch is offered it before: a violation's quarantine

    def numbered(self, number: int) -> bool:
        """Whether its next TextOutputs may be numbered `number`: not more than NUMBER_WINDOW past the highest one
        before (0: a new detokenizer numbers again; below 0: unnumbered)."""
        if number < 0:
            return True
        if self.number is not None and number and number - self.number > NUMBER_WINDOW:
            return False
        self.number = number if self.number is None or not number else max(self.number, number)
        return True

    def violated(self, now: float) -> float:
        """A protocol violation at `now`: counted, and no new epoch for QUARANTINE_S doubling with each, at most 64
        times that. Returns how long."""
        self.violations += 1
        barred = QUARANTINE_S * 2 ** min(self.violations - 1, 6)
        self.barred_until = now + barred
        return barred

"""What the front's door (actors/replica_link.py) knows of one engine replica on another node: its node's launcher,
the epoch it is offered or serves in, the relays sent to it, and how its detokenizer numbers the TextOutputs it sends.

A node's detokenizer numbers its TextOutputs to the client consecutively (from 0 per incarnation), and the client lists
the numbers skipped as missing until found or lost (actors/protocol.py's StepNumbers). While the replica is up,
honest numbers skip only what was lost on the way: what one reconnection of its link drops (the node's queue: at
most ZMQ's high-water mark, 1000 messages), or what the node did not send while it missed the door's Welcome (at most
the HELLO_S after its STALE_S without one: then it leaves the epoch, the door takes it down, and the client numbers
its link afresh). NUMBER_WINDOW is twice both at a thousand steps a second: a number further ahead of the highest one
before is no loss but a node that numbers falsely (one numbered 2**62 made the client list every number up to it), a
protocol violation: the door takes the replica out of rotation (its requests go on elsewhere) until its node adopts a
new epoch, and counts it.
"""

from __future__ import annotations

import secrets

from messages.names import replica

NUMBER_WINDOW = 4096


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

    def numbered(self, number: int) -> bool:
        """Whether its next TextOutputs may be numbered `number`: not more than NUMBER_WINDOW past the highest one
        before (0: a new detokenizer numbers again; below 0: unnumbered)."""
        if number < 0:
            return True
        if self.number is not None and number and number - self.number > NUMBER_WINDOW:
            return False
        self.number = number if self.number is None or not number else max(self.number, number)
        return True

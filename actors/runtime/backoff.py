"""A restart group's budget (an engine replica's processes, or a process alone): Erlang's restart intensity, then an
exponential back-off.

Within the intensity (fewer than `max_restarts` restarts in the last `window_s`) a dead process is restarted at once.
Past it the group backs off: its next restart waits `backoff_s`, each one after waits twice the last, up to
`max_backoff_s`, until the group has gone a whole window without a restart (then its budget is whole again). What the
supervisor does past the intensity (back off, park a replica while another serves, or stop the system) is
actors/runtime/system.py's.
"""

from __future__ import annotations

import collections

import msgspec

from messages.names import replica_of


class RestartPolicy(msgspec.Struct, kw_only=True):
    max_restarts: int = 3
    window_s: float = 60.0
    heartbeat_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    max_missed: int = 3
    ready_timeout_s: float = 180.0
    stop_timeout_s: float = 10.0
    park_s: float = 30.0  # an engine replica past the restart intensity sits out this long (another one serving)
    backoff_s: float = 1.0  # past the restart intensity (no other replica serving): the first restart's wait ...
    max_backoff_s: float = 60.0  # ... doubled at each restart after, up to this
    exit_past_intensity: bool = False  # stop the system (exit code 1) instead of backing off (--exit-on-engine-failure)


class RestartBudget:
    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.times: collections.deque[float] = collections.deque()  # restarts within the window (when each is due)
        self.backoff = 0.0  # the wait of the last restart (0: within the intensity)
        self.total = 0  # every restart counted, since the system started

    def __len__(self) -> int:
        """Restarts within the window."""
        return len(self.times)

    def next_wait(self, now: float) -> float:
        """Count a restart wanted at `now`; the seconds it waits (0: within the intensity, at once)."""
        p = self.policy
        while self.times and now - self.times[0] > p.window_s:
            self.times.popleft()
        if self.backoff and not self.times:  # up a whole window since its last restart
            self.backoff = 0.0
        if self.backoff or len(self.times) >= p.max_restarts:
            self.backoff = min(max(2 * self.backoff, p.backoff_s), p.max_backoff_s)
        self.times.append(now + self.backoff)
        self.total += 1
        return self.backoff

    def clear(self) -> None:
        """A whole budget again (a parked replica's, once it is back in rotation)."""
        self.times.clear()
        self.backoff = 0.0


def group_of(proc: str) -> object:
    """The restart group of a process: its engine replica's index, or its own name."""
    k = replica_of(proc)
    return proc if k is None else k

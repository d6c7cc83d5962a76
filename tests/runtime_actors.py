"""Small actors for the runtime tests and the mailbox benchmark (spawned by name), and what the runtime's tests share:
the echo process, a supervision policy fast enough for them, `alive`."""

from __future__ import annotations

import asyncio
import gc
import os
import time

from actors.runtime import Actor, ActorSpec, ProcessSpec, RestartPolicy
from messages.wire import ActorDown, ActorUp, CheckIdle, IdleReport, Probe

ECHO = ProcessSpec(name="echoproc", actors=[ActorSpec(name="echo", factory="tests.runtime_actors:Echo")])
FAST = RestartPolicy(heartbeat_s=0.2, heartbeat_timeout_s=0.5, max_missed=2, max_restarts=2, window_s=60)


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie, dead but not reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


class Echo(Actor):
    """Forwards every Probe to `target`; a Probe with payload b"hang" blocks its event loop."""

    def __init__(self, target: str = "recorder"):
        super().__init__()
        self.target = target

    def handlers(self):
        return {Probe: self.on_probe, CheckIdle: self.on_check}

    def on_probe(self, msg: Probe) -> None:
        if msg.payload == b"hang":
            time.sleep(3600)
        self.tell(self.target, msg)

    def on_check(self, msg: CheckIdle) -> IdleReport:
        details = {"bad_frames": self.inbox.bad_frames, "handled": self.handled, "unexpected": self.unexpected,
                   "gc_young": gc.get_threshold()[0]}  # fmt: skip
        return IdleReport(actor=self.name, details=details)


class FailsOnceAtStart(Echo):
    """An Echo that exits during its startup once, when the file `marker` exists (consumed): a death mid-restart."""

    def __init__(self, marker: str):
        super().__init__()
        self.marker = marker

    async def on_start(self) -> None:
        if os.path.exists(self.marker):
            os.unlink(self.marker)
            os._exit(1)


class LastWords(Echo):
    """Its drain sends `count` Probes of `size` bytes to `target`, then it ends: its process exits at once."""

    def __init__(self, count: int, size: int, target: str = "recorder"):
        super().__init__(target)
        self.count, self.size = count, size

    async def on_shutdown(self, reason: str) -> None:
        for seq in range(self.count):
            self.tell(self.target, Probe(seq=seq, payload=bytes(self.size)))


class Watcher(Echo):
    """Tells the recorder each ActorDown / ActorUp it hears (a Probe "watcher heard ActorDown:echo"). When the file
    `marker` exists (consumed), its start waits until a byte arrives on the FIFO `gate` (the test holds it open and
    writes when the start may end): another process may die and come back meanwhile."""

    def __init__(self, marker: str, gate: str):
        super().__init__()
        self.marker, self.gate = marker, gate

    def handlers(self):
        return {ActorDown: self.on_event, ActorUp: self.on_event, Probe: self.on_probe}

    def on_event(self, msg) -> None:
        self.tell(self.target, Probe(seq=0, payload=f"{self.name} heard {type(msg).__name__}:{msg.actor}".encode()))

    async def on_start(self) -> None:
        if os.path.exists(self.marker):
            os.unlink(self.marker)
            await wait_gate(self.gate)


async def wait_gate(path: str) -> None:
    """Until a byte arrives on the FIFO `path` (30 s at most)."""

    def read() -> None:
        with open(path, "rb") as gate:
            gate.read(1)

    await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, read), 30)


class Publisher(Echo):
    """Its start tells the recorder it began, waits at the FIFO `gate`, then writes the file `path`."""

    def __init__(self, gate: str, path: str):
        super().__init__()
        self.gate, self.path = gate, path

    async def on_start(self) -> None:
        self.tell(self.target, Probe(seq=0, payload=b"starting"))
        await wait_gate(self.gate)
        with open(self.path, "w") as f:
            f.write("published")


class Reader(Echo):
    """Its start fails (the process exits) unless the file `path` exists."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    async def on_start(self) -> None:
        if not os.path.exists(self.path):
            os._exit(1)


class Recorder(Actor):
    """Runs in the test process: records what it receives, wakes waiters."""

    def __init__(self, name: str = "recorder"):
        super().__init__(name)
        self.probes: list[Probe] = []
        self.events: list[tuple[str, str]] = []
        self.times: list[float] = []

    def handlers(self):
        return {Probe: self.on_probe, ActorDown: self.on_event, ActorUp: self.on_event}

    def on_probe(self, msg: Probe) -> None:
        self.probes.append(msg)
        self.times.append(time.monotonic())

    def on_event(self, msg) -> None:
        self.events.append((type(msg).__name__, msg.actor))


class Drainer(Recorder):
    """A Recorder whose drain waits (2 s at most) for a Probe: `drained` says whether one came, `done` is set after."""

    def __init__(self, name: str = "drainer"):
        super().__init__(name)
        self.drained: bool | None = None
        self.done = asyncio.Event()

    async def on_shutdown(self, reason: str) -> None:
        self.drained = await self.until(lambda: self.probes, timeout_s=2)
        self.done.set()


class Sender(Actor):
    """Runs in the test process: a named source for links like `tester->echo`."""

    def __init__(self, name: str = "tester"):
        super().__init__(name)

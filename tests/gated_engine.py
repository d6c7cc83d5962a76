"""An engine whose start can be held (tests/test_readiness.py): its scheduler, once the file `marker` exists
(consumed by the start it holds), waits in on_start for a byte on the FIFO `gate` before its own start (the model's
load), so a test sees the server while the engine loads, or kills the engine then."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import msgspec

from actors.engine.scheduler_actor import SchedulerActor
from actors.runtime import ProcessSpec
from messages.names import ENGINE


class GatedScheduler(SchedulerActor):
    def __init__(self, config: dict, marker: str, gate: str):
        super().__init__(config)
        self.start_marker, self.start_gate = marker, gate  # (`gate` is the scheduler's step gate)

    async def on_start(self) -> None:
        if os.path.exists(self.start_marker):
            os.unlink(self.start_marker)
            await asyncio.get_running_loop().run_in_executor(None, self._wait_gate)
        await super().on_start()

    def _wait_gate(self) -> None:
        with open(self.start_gate, "rb") as gate:
            gate.read(1)


class Gate:
    """The marker and the FIFO of a gated engine; `hold()` holds its next start, `open()` lets it go on."""

    def __init__(self, tmp: Path):
        self.marker, self.path = tmp / "hold-next-start", tmp / "gate"
        os.mkfifo(self.path)
        self.fd = os.open(self.path, os.O_RDWR)  # (held open: a byte written waits there for the reader)

    def hold(self) -> None:
        self.marker.touch()

    def open(self) -> None:
        os.write(self.fd, b"x")

    def close(self) -> None:
        os.close(self.fd)

    def gated(self, processes: list[ProcessSpec]) -> list[ProcessSpec]:
        """`processes` with replica 0's scheduler gated."""
        for p in processes:
            if p.name == ENGINE:
                a = p.actors[0]
                kwargs = {**a.kwargs, "marker": str(self.marker), "gate": str(self.path)}
                p.actors[0] = msgspec.structs.replace(a, factory="tests.gated_engine:GatedScheduler", kwargs=kwargs)
        return processes

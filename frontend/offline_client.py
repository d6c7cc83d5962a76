"""The offline API's client actor: hosted in the caller's process, it routes each request's TextOutputs and Finished
to one queue per stream, checks them (DESIGN I6) and resumes its streams after a loss or a death (I8): the client
party's ledger (actors/client_ledger.py) does the checking; a stream is its queue."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from actors.client_ledger import ClientLedger, RequestRecord
from actors.routing import Replicas
from actors.runtime import Actor
from messages.names import CLIENT
from messages.wire import (
    ActorDown,
    ActorUp,
    AddRequest,
    DetokStats,
    EngineStats,
    Finished,
    TextDelta,
    TextOutputs,
)

log = logging.getLogger("sluice.offline")


@dataclass
class Stream:
    record: RequestRecord | None = None  # what was sent, what arrived (DESIGN I6, I8): set by ClientLedger.submit
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # TextDeltas, then one Finished


class Streams(ClientLedger[Stream]):
    """The offline client's ledger: each stream's output goes to its queue; a failure ends it with
    Finished(error)."""

    def deliver(self, stream: Stream, delta: TextDelta, now: float) -> None:
        stream.queue.put_nowait(delta)

    def finish(self, stream: Stream, fin: Finished) -> None:
        stream.queue.put_nowait(fin)

    def fail(self, stream: Stream, status: int, error: str, abort: bool) -> None:
        rid = stream.record.add.request_id
        if abort:  # the engine may still run it
            self.abort(rid, "error")
        else:
            self.close(rid, stream.record.num_tokens)
        received = stream.record.num_tokens
        stream.queue.put_nowait(
            Finished(request_id=rid, finish_reason="error", error=error, num_output_tokens=received)
        )


class ClientActor(Actor):
    """Hosts the offline API's streams (their ledger: actors/client_ledger.py, whose state x event table says how
    every output, loss and death is handled) in the caller's process, and keeps the engine side's counters."""

    name = CLIENT

    def __init__(self, max_resumes: int = 2, replicas: Replicas | None = None, abort_timeout_s: float = 5.0,
                 max_abort_tries: int = 3):  # fmt: skip
        """`abort_timeout_s`, `max_abort_tries`: I7 for its Aborts, as the engine's config says for the detokenizer's."""
        super().__init__()
        self.streams = Streams(self.tell, log, abort_timeout_s, max_abort_tries, max_resumes=max_resumes,
                               replicas=replicas)  # fmt: skip
        self.period_s = min(0.5, abort_timeout_s / 2)
        self.engine_stats: EngineStats | None = None  # the latest report of any replica
        self.detok_stats: DetokStats | None = None

    def handlers(self):
        return {
            TextOutputs: self.streams.on_outputs,
            Finished: self.streams.on_finished,
            EngineStats: self.on_engine_stats,
            DetokStats: lambda m: setattr(self, "detok_stats", m),
            ActorDown: lambda m: self.streams.on_down(m.actor),
            ActorUp: lambda m: self.streams.on_up(m.actor),
        }

    def on_engine_stats(self, msg: EngineStats) -> None:
        self.engine_stats = msg
        self.streams.replicas.on_stats(msg)

    async def on_start(self) -> None:
        self.spawn(self._housekeeping())

    def add(self, msg: AddRequest) -> Stream:
        stream = self.streams.submit(Stream(), msg, send=not self.stopped)
        if self.stopped:  # the system is gone: the stream ends at once
            self.streams.fail(stream, 503, "the system stopped", abort=False)
        return stream

    async def _housekeeping(self) -> None:
        """Find a TextOutputs lost on a quiet link; re-send Aborts that got no Finished (I7)."""
        while True:
            await asyncio.sleep(self.period_s)
            self.streams.expire(time.monotonic())

    def fail_all(self, error: str) -> None:
        for stream in list(self.streams.live.values()):
            self.streams.fail(stream, 503, error, abort=False)

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    async def on_processes_exited(self, timeout_s: float) -> None:
        """The Finished(abort, "shutdown") of each stream may still be in this inbox: handled before `stop`."""
        await self.until(lambda: not self.streams.live, timeout_s)

    def stop(self) -> None:
        """The system stopped (also when it gave up restarting a process): no stream waits on."""
        self.fail_all("the system stopped")
        super().stop()

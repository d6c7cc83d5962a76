"""FlightRecord: which requests were in the engine's steps when its process died, kept where that death cannot
reach them (issue 28; docs/ARCHITECTURE.md, "Recovery").

With the inline worker (the default on CPU) a step that crashes the device thread kills the engine process, and with it
the scheduler's memory of who was in that step. So the scheduler writes the requests of the steps in flight (as it
hands each step to the worker; again once they are all done, and after a worker is lost) with the blame of every
request blamed (EngineRequest.failed_steps, which actors/engine/recovery.py counts for a worker's deaths), to two
small files in the system's private runtime directory (0700, the ipc sockets'), taking turns: one `pwrite` each,
its length and CRC-32 in a header. The page cache outlives the process: nothing is synced (a machine that goes
down takes the whole system with it). A write, two steps in flight (2-core EPYC, medians): 7 µs at 8 requests a
step, 14 at 64, 25 at 256 (at most 0.25 % of a 10 ms CPU step); sqlite3 (WAL, synchronous off) took 17, 35, 63.

The blame is a worker death's (recovery.py): every request of every step in flight, the one the device may have
finished but the loop not yet postprocessed included. A poison's neighbours are blamed with it until suspects (at
isolate_after) run in steps of their own; from then on a death blames the poison and at most the requests of the
step before its own, none of them suspected: one poison never brings an innocent request to a third blame.

Cases, state x event -> action:
  no valid record           the engine starts     -> nobody blamed (its first start; both slots torn)
  a slot torn or short      the engine starts     -> ignored: the other slot, one write older, is read (a write
                                                     tears only when the process dies in it; the step in flight
                                                     then was already named by the write before)
  a record                  the engine starts     -> each request of its steps in flight blamed once more, and
                                                     the record rewritten at once with none in flight (a death
                                                     before the first step blames nobody twice)
  blamed, not yet here      its copy arrives      -> it starts with that blame (`admit`): from isolate_after it
                                                     runs in steps of its own; at max_step_failures it is
                                                     refused, an error (a server bug it triggers: it fails alone)
  blamed, not yet here      PENDING_TTL_S pass    -> forgotten (its client gave up on it); a later copy starts clean
                            (counted from the engine's readiness, `arm`: a slow model load is not the client's delay)
  blamed, running           it samples, or ends   -> dropped from the record at its next write
  blamed by a worker's death (recovery.py)        -> kept in the record (`watch`) like a copy's blame
A beam search's rows carry its group's id: the record names its members (`names`), whose copies take the blame (the
group they start takes their greatest).
"""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from collections.abc import Callable, Iterable

import msgspec

from actors.engine.request import EngineRequest
from gpu.batch import BatchSpec

log = logging.getLogger("sluice.engine")

MAGIC = b"SLFR"
HEAD = struct.Struct("<4sII")  # magic, body length, CRC-32 of the body
PENDING_TTL_S = 60.0  # a blamed request's copy comes once the request path is whole again (the supervisor's window)
# after the engine is ready: however long its model took to load


class Flight(msgspec.Struct, array_like=True):
    number: int  # of the write: the higher valid slot is the newer
    inflight: list[list[str]]  # the requests of each step in flight
    blamed: dict[str, int]  # request id -> failed steps


ENCODER, DECODER = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Flight)


class FlightRecord:
    def __init__(
        self,
        path: str,
        max_failures: int,
        ttl_s: float = PENDING_TTL_S,
        names: Callable[[list[str]], list[str]] | None = None,
    ):
        self.max_failures = max_failures
        # rows' request ids -> the ids their requests' copies arrive under, each once
        self.names = names or (lambda rids: list(dict.fromkeys(rids)))
        self.fds = [os.open(f"{path}.{i}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600) for i in (0, 1)]
        self.pending: dict[str, int] = {}  # blamed requests whose copy has not come (yet)
        self.watched: dict[str, EngineRequest] = {}  # blamed requests here
        self.ttl_s, self.pending_until = ttl_s, 0.0
        self.number = 0
        self.named: dict[int, list[str]] = {}  # step number -> its requests (of the steps last written)

    def recover(self) -> dict[str, int]:
        """Read the last record (the engine starts): blame its steps' requests, keep every blame; the new blames."""
        last = max(filter(None, map(self._read, self.fds)), key=lambda f: f.number, default=None)
        hit = {}
        if last is not None:
            self.number, self.pending = last.number + 1, last.blamed
            hit = {rid: self.pending.get(rid, 0) + 1 for step in last.inflight for rid in step}
            self.pending |= hit
        self.write(())
        return hit

    def arm(self) -> None:
        """The engine is ready (its copies can come now): the blames whose copies have not come in PENDING_TTL_S
        from now are forgotten."""
        self.pending_until = time.monotonic() + self.ttl_s

    def write(self, steps: Iterable[BatchSpec]) -> None:
        """The record of `steps` (those in flight) and of every blame, in the older slot."""
        named, self.named = self.named, {}
        for batch in steps:  # (each step's names listed once: a step stays in flight for two writes)
            ids = named.get(batch.step)
            if ids is None:
                ids = self.names([row.request_id for row in batch.rows])
            self.named[batch.step] = ids
        body = ENCODER.encode(Flight(self.number, list(self.named.values()), self._blames()))
        os.pwrite(self.fds[self.number & 1], HEAD.pack(MAGIC, len(body), zlib.crc32(body)) + body, 0)
        self.number += 1

    def admit(self, req: EngineRequest) -> str | None:
        """A request arriving takes its blame; why it is refused (it crashed the engine too often), if it is."""
        n = self._pending().pop(req.request_id, 0)
        if n >= self.max_failures:
            log.error("[%s] refused: in the steps of %d engine deaths (a poison request)", req.request_id, n)
            return f"request {req.request_id} crashed the engine {n} times: it fails alone"
        req.failed_steps = n
        self.watch([req])
        return None

    def watch(self, reqs: Iterable[EngineRequest]) -> None:
        """Keep the blame of these requests (those blamed) in the record while it lasts."""
        self.watched.update((req.request_id, req) for req in reqs if req.failed_steps)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)

    def _pending(self) -> dict[str, int]:
        """The blames whose copies have not come, until PENDING_TTL_S after the engine is ready (`arm`)."""
        if self.pending and self.pending_until and time.monotonic() > self.pending_until:
            self.pending = {}
        return self.pending

    def _blames(self) -> dict[str, int]:
        if self.watched:
            self.watched = {rid: r for rid, r in self.watched.items() if r.failed_steps and not r.is_finished}
        return self._pending() | {n: req.failed_steps for rid, req in self.watched.items() for n in self.names([rid])}

    @staticmethod
    def _read(fd: int) -> Flight | None:
        """A slot's record; None if it is absent, torn or not one."""
        data = os.pread(fd, os.fstat(fd).st_size, 0)
        if len(data) < HEAD.size:
            return None
        magic, size, crc = HEAD.unpack_from(data)
        body = data[HEAD.size : HEAD.size + size]
        if magic != MAGIC or len(body) != size or zlib.crc32(body) != crc:
            log.warning("flight record slot torn: ignored")
            return None
        return DECODER.decode(body)

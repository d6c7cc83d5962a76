"""Mailboxes and links.

An actor's Inbox receives decoded messages from in-process senders (no serialization) and from
its ZMQ PULL socket (remote senders). A Link is one sender actor -> one receiver actor: per-link
FIFO, a PUSH socket (unlimited HWM, non-blocking: a send never blocks the event loop) or a direct
put into a local inbox, with the fault injector on the send path.

An inbox re-arms its socket's reader every REARM_S: the loop's registration is keyed by fd number, and any code
sharing the loop that closes a transport after its socket was already closed (an un-closed openai client that the
cyclic GC finalizes and its own __del__ resurrects: its deferred aclose() aborts the transports whose sockets the GC
closed) removes the reader of whatever took that fd number since. Such an inbox would never hear its socket again;
re-armed, it loses at most REARM_S (counted in `rearmed` and logged where the loop tells: asyncio's does, uvloop's
`remove_reader` answers None either way).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

import zmq

from actors.runtime.faults import FaultInjector
from messages.codec import BadFrame, Codec, LocalOnlyError
from messages.wire import Msg

log = logging.getLogger("sluice.mailbox")

REARM_S = 1.0
LINGER_MS = 1000  # how long a closed socket may hold what was sent on it, for a peer that does not take it


class Inbox:
    """FIFO of decoded messages for one actor, fed locally and by its PULL socket."""

    def __init__(self, name: str, codec: Codec):
        self.name = name
        self.codec = codec
        self._queue: collections.deque[Msg] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._sock: zmq.Socket | None = None
        self._fd = -1
        self._rearm: asyncio.TimerHandle | None = None
        self.bad_frames = 0
        self.rearmed = 0  # times its reader was found removed by someone else

    def put(self, msg: Msg | bytes) -> None:
        self._queue.append(msg)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> Msg:
        while True:
            while not self._queue:
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            item = self._queue.popleft()
            if type(item) is not bytes:
                return item
            try:  # decoded when taken: a backlog stays bytes, not live objects for the GC to walk
                return self.codec.decode(item)
            except BadFrame as e:
                self.bad_frames += 1
                log.warning("%s: dropped a bad frame: %s", self.name, e)

    def __len__(self) -> int:
        return len(self._queue)

    def bind(self, ctx: zmq.Context, address: str) -> None:
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)
        self._sock, self._fd = sock, sock.getsockopt(zmq.FD)
        loop = asyncio.get_running_loop()
        loop.add_reader(self._fd, self._drain)
        loop.call_soon(self._drain)  # the FD is edge-triggered: drain anything already queued
        self._rearm = loop.call_later(REARM_S, self.rearm)

    def rearm(self) -> None:
        """Register the reader again (removed or not: a stale registration is renewed too) and drain what it missed."""
        if self._sock is None:
            return
        loop = asyncio.get_running_loop()
        if loop.remove_reader(self._fd) is False:  # (asyncio's loop says; uvloop's answers None: renewed unseen)
            self.rearmed += 1
            log.warning(
                "%s: the reader of its socket (fd %d) was removed by someone else: re-armed", self.name, self._fd
            )
        loop.add_reader(self._fd, self._drain)
        self._drain()
        self._rearm = loop.call_later(REARM_S, self.rearm)

    def _drain(self) -> None:
        sock = self._sock
        while sock is not None:  # the FD is edge-triggered: read until EAGAIN
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.put(frame)

    def close(self) -> None:
        if self._rearm is not None:
            self._rearm.cancel()
            self._rearm = None
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._fd)
            self._sock.close(linger=0)
            self._sock = None


class Link:
    """One sender -> one receiver. `deliver` does the transport; faults are applied first."""

    def __init__(self, name: str, deliver: Callable[[Msg], None], remote: bool, faults: FaultInjector | None):
        self.name = name
        self.remote = remote
        self._deliver = deliver
        self._faults = faults
        self._stalled: list[Msg] | None = None  # messages queued behind a delay
        self._held: Msg | None = None  # a message waiting to be reordered
        self._held_timer: asyncio.TimerHandle | None = None

    def send(self, msg: Msg) -> None:
        if self.remote and msg.local_only:
            raise LocalOnlyError(
                f"{type(msg).__name__} is local-only (it carries device tensors) and cannot cross the process link {self.name}"
            )
        rule = self._faults.decide(self.name, type(msg).__name__) if self._faults else None
        if rule is None:
            self._forward(msg)
        elif rule.action == "drop":
            pass
        elif rule.action == "duplicate":
            self._forward(msg)
            self._forward(msg)
        elif rule.action == "delay":
            if self._stalled is None:
                self._stalled = []
                asyncio.get_running_loop().call_later(rule.delay_ms / 1000, self._unstall)
            self._stalled.append(msg)
        elif self._held is None and self._stalled is None:  # reorder (in a stall it would overtake what is queued)
            self._held = msg
            self._held_timer = asyncio.get_running_loop().call_later((rule.delay_ms or 50) / 1000, self._release)
        else:
            self._forward(msg)

    def _forward(self, msg: Msg) -> None:
        if self._stalled is not None:
            self._stalled.append(msg)
            return
        self._deliver(msg)
        if self._held is not None:
            self._release()

    def _release(self) -> None:
        held, self._held = self._held, None
        if self._held_timer is not None:
            self._held_timer.cancel()
            self._held_timer = None
        if held is not None:
            self._forward(held)

    def _unstall(self) -> None:
        stalled, self._stalled = self._stalled or [], None
        for msg in stalled:
            self._forward(msg)


def push_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)  # never drop, never block (DESIGN: sends never block the loop)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.connect(address)
    return sock

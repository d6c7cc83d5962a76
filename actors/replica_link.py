"""Engine replicas on other nodes: `sluice serve --data-parallel-size N --data-parallel-size-local L` serves replicas
0 .. L-1 itself; each other replica K runs on a node of its own, `sluice serve --headless --data-parallel-rank K`,
under that node's launcher and supervisor.

The front's launcher hosts a Door (a CurveZMQ ROUTER at --data-parallel-address:--data-parallel-rpc-port, keys from
the cluster secret: actors/runtime/curve.py) and, for each remote replica, proxies named as its actors (scheduler.K,
worker.K, detokenizer.K): what the front's actors send them is relayed to the node. The node's launcher hosts a
NodeLink named as the front's client (http): what the replica sends its client (outputs, stats, and its supervisor's
ActorDown / ActorUp of its actors) is relayed to the front, where the door delivers it. Each side checks what it
delivers: a node may only speak to the client, and only of its own replica's actors.

Door, per remote replica (messages/step.py's ReplicaHello, Welcome, Relay):
| state                 | event                                       | action                                        |
|-----------------------|---------------------------------------------|-----------------------------------------------|
| any                   | hello from a second launcher of the replica | ignored while the first is heard (logged)     |
| down, barred          | hello                                       | ignored (no Welcome) until its quarantine ends|
| down, none offered    | hello                                       | epoch + 1 (offered); Welcome(epoch)           |
| down, offered         | hello in another epoch                      | Welcome(epoch) again                          |
| down, offered         | hello in the offered epoch                  | up: ActorUp of its actors to the client       |
| up                    | hello in the epoch                          | Welcome(epoch) (the node knows it is heard)   |
| up                    | hello in another (the node restarted, or    | down: ActorDown of its actors to the client   |
|                       | left the epoch), no hello for STALE_S, or a | (its requests go on elsewhere)                |
|                       | relay its node's connection cannot take     |                                               |
| up                    | Relay to the client                         | delivered if it is output, stats or a report  |
|                       |                                             | of this replica's (its index, its actors);    |
|                       |                                             | anything else dropped, logged                 |
| up                    | Relay of a TextOutputs numbered more than   | down, logged, counted, barred: a protocol     |
|                       | NUMBER_WINDOW past the highest one before   | violation (actors/replica_remote.py: why, and |
|                       |                                             | the quarantine, growing with each)            |
| down                  | Relay                                       | dropped (an old epoch's)                      |
| any                   | ActorUp of the client (it restarted)        | ActorDown of every replica down, ActorUp of   |
|                       |                                             | every one up, again (it starts them down)     |
Epochs start at a random number, so a restarted front's are new to every node. The node adopts a Welcome's epoch; a
new one first ends every request the front sent before: its replica is told the client died (ActorDown(http): the
detokenizer aborts them) and came back. It leaves the epoch (back to 0) when a relay is missing (the door numbers
them), and stops relaying with no Welcome for STALE_S.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from actors.replica_remote import NUMBER_WINDOW, Remote
from actors.runtime import curve
from actors.runtime.actor import Actor
from messages.codec import BadFrame, Codec
from messages.names import replica
from messages.step import REPLICA_TYPES, Relay, ReplicaHello, Welcome
from messages.wire import ActorDown, ActorUp, DetokStats, EngineStats, Msg, Ping, Reply, Shutdown, TextOutputs

log = logging.getLogger("sluice.replicas")
HELLO_S = 1.0
STALE_S = 5 * HELLO_S
LOCAL = (Ping, Shutdown, Reply)  # what a proxy's own runtime handles (never relayed)
FROM_NODE = (TextOutputs, EngineStats, DetokStats)  # what a node may tell the client, of its replica (and reports)


class Door(Actor):
    """The front's side of its remote replicas (module docstring's table)."""

    def __init__(self, remote: list[int], client: str, address: str) -> None:
        super().__init__("door")
        self.remote = {k: Remote(k) for k in remote}
        self.client, self.address = client, address
        self.link, self.wire = Codec(REPLICA_TYPES), Codec()
        self.ctx: zmq.asyncio.Context | None = None  # (made at on_start)

    @property
    def violations(self) -> int:
        """Relays that broke the protocol (each took its replica down). Not on /metrics: no message of the door's
        reaches the HTTP actor's; logged with each violation."""
        return sum(r.violations for r in self.remote.values())

    def handlers(self):
        return {ActorUp: self.on_actor_up}

    def on_actor_up(self, msg: ActorUp) -> None:
        """The client restarted: it is told again which remote replicas are down and which are up (a new incarnation
        holds them down until it hears)."""
        if msg.actor == self.client:
            for r in self.remote.values():
                self._tell_client(r, ActorUp if r.up else ActorDown, "its node has not joined")

    async def on_start(self) -> None:
        ctx = zmq.asyncio.Context()
        sock, auth = curve.server(ctx, curve.cluster_secret(), self.address)
        self.ctx, self.sock, self.auth, self.monitor = ctx, sock, auth, curve.server_monitor(sock)
        self.sock.router_mandatory = True  # (a relay its node's connection cannot take fails: the replica is down)
        for r in self.remote.values():  # (down until their node joins)
            self._tell_client(r, ActorDown, "its node has not joined")
        log.info("waiting for the nodes of engine replicas %s at %s", sorted(self.remote), self.address)
        self.spawn(curve.log_refusals(self.monitor))
        self.spawn(self._listen())
        self.spawn(self._watch())

    def on_stop(self) -> None:
        """Every socket closed, then the context ended (a context the collector finalizes may run its term() before
        its sockets' close, and wait for them for ever: the test process hung so at its end)."""
        if self.ctx is not None:
            self.monitor.close(0)
            self.sock.close(0)
            self.auth.stop()
            self.ctx.term()

    def forward(self, k: int, dst: str, msg: Msg) -> None:
        """A proxy's message for replica k's actor `dst` (dropped while k is down: its requests go on elsewhere)."""
        r = self.remote[k]
        if not r.up:
            return
        r.sent += 1
        relay = Relay(dst=dst, frame=self.wire.encode(msg), seq=r.sent)
        sent = self.sock.send_multipart([r.peer, self.link.encode(relay)])
        sent.add_done_callback(lambda f: f.cancelled() or f.exception() is None or self._lost(r, f"{f.exception()}"))

    async def _listen(self) -> None:
        while True:
            peer, msg = await curve.receive(self.sock, self.link, "a replica's node")
            if isinstance(msg, ReplicaHello):
                self._on_hello(msg, peer)
            elif isinstance(msg, Relay):
                self._on_relay(msg, peer)

    def _on_hello(self, hello: ReplicaHello, peer: bytes) -> None:
        r, now = self.remote.get(hello.replica), time.monotonic()
        if r is None:
            log.warning("a node says it serves engine replica %d, not one of %s: ignored", hello.replica,
                        sorted(self.remote))  # fmt: skip
            return
        if r.peer not in (None, peer) and now - r.heard < STALE_S:
            log.warning(
                "a second node says it serves engine replica %d: ignored while the first is heard", r.names.index
            )
            return
        r.peer, r.heard = peer, now
        if r.up and hello.epoch != r.epoch:
            self._lost(r, "its node left the epoch (a missing relay, or a restart)")
        if not r.up and not r.offered and now < r.barred_until:
            return  # (a violation's quarantine)
        if not r.up and r.offered and hello.epoch == r.epoch:
            r.up, r.number = True, None
            log.info("engine replica %d joined from its node (epoch %d)", r.names.index, r.epoch)
            self._tell_client(r, ActorUp)
        elif not r.up and not r.offered:  # (a node that was up before must adopt a new epoch: it forgets first)
            r.epoch, r.offered, r.sent = r.epoch + 1, True, 0
        welcome = Welcome(replica=r.names.index, epoch=r.epoch, sent=r.sent)
        self.sock.send_multipart([peer, self.link.encode(welcome)]).add_done_callback(_quiet)

    def _on_relay(self, relay: Relay, peer: bytes) -> None:
        r = next((r for r in self.remote.values() if r.up and r.peer == peer), None)
        try:
            msg = self.wire.decode(relay.frame)
        except BadFrame as e:
            log.warning("dropped a bad relayed message: %s", e)
            return
        if r is None or relay.dst != self.client or not self._its_own(r, msg):
            log.warning("dropped a %s for %s from a node, not its replica's to send", type(msg).__name__, relay.dst)
            return
        if isinstance(msg, TextOutputs) and not r.numbered(msg.number):
            barred = r.violated(time.monotonic())
            self._lost(r, f"a protocol violation (TextOutputs number {msg.number}, more than {NUMBER_WINDOW} past "
                          f"{r.number}; {r.violations} so far: no new epoch for {barred:.0f} s)")  # fmt: skip
            return
        self.router.send(self.name, relay.dst, msg)

    @staticmethod
    def _its_own(r: Remote, msg: Msg) -> bool:
        """Whether a node may tell the client `msg`: output or stats of its replica, or a report of its actors."""
        if isinstance(msg, ActorDown | ActorUp):
            return msg.actor in r.names.actors
        return isinstance(msg, FROM_NODE) and msg.replica == r.names.index

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(HELLO_S)
            for r in self.remote.values():
                if r.up and time.monotonic() - r.heard > STALE_S:
                    self._lost(r, f"its node is not heard ({STALE_S:.0f} s)")

    def _lost(self, r: Remote, why: str) -> None:
        """Replica r is down until its node adopts a new epoch: its requests go on elsewhere."""
        if r.up:
            r.up = r.offered = False
            log.error("engine replica %d: %s: its requests go on elsewhere", r.names.index, why)
            self._tell_client(r, ActorDown, why)

    def _tell_client(self, r: Remote, kind: type[ActorDown] | type[ActorUp], reason: str = "") -> None:
        for actor in r.names.actors:
            self.tell(self.client, ActorDown(actor=actor, reason=reason) if kind is ActorDown else ActorUp(actor=actor))


class Proxy(Actor):
    """Named as one of a remote replica's actors on the front: relays what it receives through the door."""

    def __init__(self, name: str, k: int, door: Door) -> None:
        super().__init__(name)
        self.k, self.door = k, door

    def dispatch(self, msg: Msg):
        if isinstance(msg, LOCAL):
            return super().dispatch(msg)
        self.door.forward(self.k, self.name, msg)
        return None


class NodeLink(Actor):
    """Named as the front's client on a replica's node: relays what the replica sends it to the front, and delivers
    what the front relays (module docstring)."""

    def __init__(self, client: str, k: int, address: str) -> None:
        super().__init__(client)
        self.names, self.address = replica(k), address
        self.link, self.wire = Codec(REPLICA_TYPES), Codec()
        self.epoch, self.heard, self.received = 0, 0.0, 0  # (relays received in the epoch)
        self.left = 0  # the epoch it last left (a Welcome of it still in flight is not adopted again)
        self.serving = asyncio.Event()  # set by the node's launcher once its replica is ready
        self.ctx = zmq.asyncio.Context()  # (connecting now: a refusal shows while the replica loads)
        identity = f"replica{k}-{time.time_ns()}".encode()
        self.sock, self.monitor = curve.client(self.ctx, curve.cluster_secret(), address, identity)

    @property
    def welcomed(self) -> bool:
        return self.epoch > 0 and time.monotonic() - self.heard < STALE_S

    async def on_start(self) -> None:
        self.spawn(self._hello())
        self.spawn(self._listen())

    def on_stop(self) -> None:
        self.monitor.close(0)  # (as the door's)
        self.sock.close(0)
        self.ctx.term()

    def dispatch(self, msg: Msg):
        if isinstance(msg, LOCAL):
            return super().dispatch(msg)
        if isinstance(msg, ActorDown):  # (what its router queued for the dead actor is not delivered to the next)
            self.router.forget(msg.actor)
        if self.welcomed:
            self.sock.send(self.link.encode(Relay(dst=self.name, frame=self.wire.encode(msg))))
        return None

    async def _hello(self) -> None:
        await self.serving.wait()
        while True:
            if self.epoch and not self.welcomed:  # (what it sent meanwhile was dropped: the door must down it)
                self._leave(f"no Welcome for {STALE_S:.0f} s")
            await self.sock.send(self.link.encode(ReplicaHello(replica=self.names.index, epoch=self.epoch)))
            await asyncio.sleep(HELLO_S)

    async def _listen(self) -> None:
        while True:
            try:
                msg = self.link.decode(await self.sock.recv())
                inner = self.wire.decode(msg.frame) if isinstance(msg, Relay) else None
            except BadFrame as e:
                log.warning("dropped a bad message from the front: %s", e)
                continue
            if isinstance(msg, Welcome) and msg.replica == self.names.index and msg.epoch != self.left:
                self.heard = time.monotonic()
                if msg.epoch != self.epoch:
                    self._forget(msg.epoch)
                elif msg.sent != self.received:  # (a relay before this Welcome, on the same ordered link, is missing)
                    self._leave(f"relays {self.received + 1}..{msg.sent} lost")
            elif isinstance(msg, Relay) and self.welcomed and msg.dst in self.names.actors:
                if msg.seq != self.received + 1:
                    self._leave(f"relay {self.received + 1} lost")
                    continue
                self.received = msg.seq
                self.router.send(self.name, msg.dst, inner)

    def _leave(self, why: str) -> None:
        log.error("%s: leaving the front's epoch %d", why, self.epoch)
        self.left = self.epoch
        self._forget(0)

    def _forget(self, epoch: int) -> None:
        """A new epoch (0: none): the requests the front sent before are ended (its client, to the replica, died and
        is back)."""
        if self.epoch:
            log.warning("left the front's epoch %d: ending its requests", self.epoch)
            for actor in self.names.request_path:
                self.tell(actor, ActorDown(actor=self.name, reason="the front's link was lost"))
                self.tell(actor, ActorUp(actor=self.name))
        self.epoch, self.received = epoch, 0


def _quiet(sent: asyncio.Future) -> None:
    """A Welcome its node's connection could not take: the node's next hello is answered again."""
    if not sent.cancelled():
        sent.exception()

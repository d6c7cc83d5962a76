"""A gang across nodes (`--nnodes N`): node 0 runs the whole actor graph and the gang's leader; every other node runs
`sluice serve --headless --node-rank K`, a launcher of that node's ranks only (ranks K * R .. K * R + R - 1, where
R = tensor_parallel_size / nnodes, on the node's devices 0 .. R - 1).

The leader's door, a ZMQ ROUTER at --master-addr:--master-port, speaks with each headless launcher over CurveZMQ
with keys derived from the cluster secret (actors/runtime/curve.py: an unauthenticated peer is refused). Each gang
incarnation has an id; the messages are messages/step.py's NodeHello, SpawnRanks, RankExited:

| node's launcher                         | door (the leader's process)                                           |
|-----------------------------------------|-----------------------------------------------------------------------|
| NodeHello(its rank, its ranks' gang)    | a node whose ranks are not in this gang: SpawnRanks(this gang, the    |
| every second                            | group's store, the leader's EngineConfig, KV blocks)                  |
| SpawnRanks of a new gang: kills its     |                                                                       |
| ranks, spawns the new ones              |                                                                       |
| one of its ranks exits: RankExited,     | RankExited of this gang: the gang is over (the leader exits, and the  |
| kills the others                        | supervisor restarts it: a new gang, whose SpawnRanks follow the hello)|
| refused handshake: exits with code 2    |                                                                       |

The collectives themselves run over torch.distributed (gloo or NCCL): its store listens on --master-addr only, its
values sealed with a key from the cluster secret (the store's URL travels in SpawnRanks, over this link), but gloo's
and NCCL's connections are neither authenticated nor encrypted: docs/OPERATIONS.md says what that means for the
network between nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
from typing import Literal

import msgspec
import zmq
import zmq.asyncio

from actors.engine.config import EngineConfig
from actors.engine.gang_ranks import FollowerConfig, first_exit, spawn_rank
from actors.runtime import curve
from messages.codec import BadFrame, Codec
from messages.step import NODE_TYPES, NodeHello, RankExited, SpawnRanks

log = logging.getLogger("sluice.gang")
HELLO_S = 1.0
STALE_S = 5 * HELLO_S  # a launcher not heard for this long is gone (another may take its node rank)
EXIT_REFUSED = 2


Action = Literal["spawn", "ignore", "over"]


class Nodes:
    """The door's ledger of the other nodes for one gang: what a NodeHello from node K (peer P) saying gang g means.

    | hello                                                   | action                                        |
    |---------------------------------------------------------|-----------------------------------------------|
    | K is another peer's, heard within STALE_S               | ignore (a second launcher for K), logged      |
    | g is this gang                                          | ignore: K's ranks run in it (remembered)      |
    | g is not, and K's ranks were seen in this gang          | over: K lost its ranks (a restarted launcher) |
    | g is not (K not yet started, or the SpawnRanks in       | spawn: SpawnRanks (again: a node ignores one  |
    | flight)                                                 | for the gang it runs)                         |
    """

    def __init__(self, gang: str) -> None:
        self.gang = gang
        self.heard: dict[int, tuple[bytes, float]] = {}  # node rank -> (its launcher's peer id, when last heard)
        self.running: set[int] = set()  # nodes whose hellos said this gang
        self.told: set[int] = set()  # nodes sent this gang's SpawnRanks (for the log)

    def on_hello(self, hello: NodeHello, peer: bytes, now: float) -> Action:
        k = hello.node_rank
        claimed = self.heard.get(k)
        if claimed is not None and claimed[0] != peer and now - claimed[1] < STALE_S:
            log.warning("a second launcher says it is node %d: ignored while the first is heard", k)
            return "ignore"
        self.heard[k] = (peer, now)
        if hello.gang == self.gang:
            self.running.add(k)
            return "ignore"
        if k in self.running:
            return "over"
        if k not in self.told:
            log.info("node %d: starting its ranks in gang %s", k, self.gang)
            self.told.add(k)
        return "spawn"


class Door:
    """The leader's side of the other nodes (its loop): `serve()` answers their hellos (Nodes) until the gang is over
    (a RankExited of this gang, or a node that lost its ranks)."""

    def __init__(self, config: EngineConfig, spawn: SpawnRanks) -> None:
        self.spawn, self.codec, self.nodes = spawn, Codec(NODE_TYPES), Nodes(spawn.gang)
        self.ctx = zmq.asyncio.Context()
        address = f"tcp://{config.master_addr}:{config.master_port}"
        self.sock, self.auth = curve.server(self.ctx, curve.cluster_secret(), address)
        self.monitor = curve.server_monitor(self.sock)
        log.info("gang %s: waiting for %d other node(s) at %s", spawn.gang, config.nnodes - 1, address)

    async def serve(self) -> str:
        """Until the gang is over: why."""
        refusals = asyncio.ensure_future(curve.log_refusals(self.monitor))
        loop = asyncio.get_running_loop()
        try:
            while True:
                peer, msg = await curve.receive(self.sock, self.codec, "a node")
                if isinstance(msg, RankExited) and msg.gang == self.spawn.gang:
                    return f"rank {msg.rank} exited with code {msg.code} on another node"
                if not isinstance(msg, NodeHello):
                    continue
                action = self.nodes.on_hello(msg, peer, loop.time())
                if action == "over":
                    return f"node {msg.node_rank} lost its ranks (its launcher restarted)"
                if action == "spawn":
                    await self.sock.send_multipart([peer, self.codec.encode(self.spawn)])
        finally:
            refusals.cancel()
            self.monitor.close(0)
            self.sock.close(0)
            self.auth.stop()
            self.ctx.term()


class HeadlessNode:
    """A node's launcher of its ranks (`sluice serve --headless`)."""

    def __init__(self, config: EngineConfig, node_rank: int) -> None:
        if config.nnodes < 2:
            raise ValueError("a headless node is one of several: give --nnodes (2 or more) and --node-rank")
        if not 0 < node_rank < config.nnodes:
            raise ValueError(f"--node-rank of a headless node must be in [1, {config.nnodes - 1}], got {node_rank}")
        self.config, self.node_rank, self.codec = config, node_rank, Codec(NODE_TYPES)
        self.gang = ""  # the gang its ranks run in
        self.mismatched = ""  # the last gang refused for a layout other than this node's flags (logged once)
        self.ranks: dict[int, subprocess.Popen] = {}
        self.address = f"tcp://{config.master_addr}:{config.master_port}"

    async def run(self) -> int:
        """Serve the leader's gangs until SIGTERM/SIGINT (0), or until refused (EXIT_REFUSED)."""
        ctx = zmq.asyncio.Context()
        identity = f"node{self.node_rank}-{os.getpid()}".encode()  # (a reconnect is the same launcher; a restart not)
        self.sock, monitor = curve.client(ctx, curve.cluster_secret(), self.address, identity)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        tasks = [asyncio.ensure_future(t) for t in (curve.handshakes(monitor, self.address), stop.wait())]
        tasks += [asyncio.ensure_future(self._hello()), asyncio.ensure_future(self._receive())]
        log.info("node %d: connecting to the leader at %s", self.node_rank, self.address)
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            errors = [t.exception() for t in done if t.exception() is not None]
            for error in errors:
                log.error("node %d: %s", self.node_rank, error, exc_info=not isinstance(error, curve.Refused))
            return EXIT_REFUSED if any(isinstance(e, curve.Refused) for e in errors) else 1 if errors else 0
        finally:
            for t in tasks:
                t.cancel()
            self._kill()
            monitor.close(0)
            self.sock.close(0)
            ctx.term()

    async def _hello(self) -> None:
        while True:
            await self.sock.send(self.codec.encode(NodeHello(node_rank=self.node_rank, gang=self.gang)))
            await asyncio.sleep(HELLO_S)

    async def _receive(self) -> None:
        watch = None
        while True:
            try:
                msg = self.codec.decode(await self.sock.recv())
            except BadFrame as e:
                log.warning("dropped a bad frame from the leader: %s", e)
                continue
            if not isinstance(msg, SpawnRanks) or msg.gang == self.gang:
                continue
            engine = msgspec.structs.replace(msgspec.convert(msg.engine, EngineConfig), model=self.config.model)
            layout = (engine.tensor_parallel_size, engine.nnodes)
            if layout != (self.config.tensor_parallel_size, self.config.nnodes):
                if msg.gang != self.mismatched:
                    self.mismatched = msg.gang
                    log.error("node %d: the leader's gang is -tp %d over %d nodes, not -tp %d over %d as this node "
                              "was told: not started", self.node_rank, *layout, self.config.tensor_parallel_size,
                              self.config.nnodes)  # fmt: skip
                continue
            if watch is not None:
                watch.cancel()
            self._kill()
            self.gang = msg.gang
            self.ranks = {rank: spawn_rank(self._follower(msg, engine, rank)) for rank in self._my_ranks()}
            log.info("node %d: ranks %s started in gang %s", self.node_rank, list(self.ranks), msg.gang)
            watch = asyncio.ensure_future(self._watch(msg.gang))

    def _my_ranks(self) -> range:
        per_node = self.config.tensor_parallel_size // self.config.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    def _follower(self, msg: SpawnRanks, engine: EngineConfig, rank: int) -> FollowerConfig:
        return FollowerConfig(
            engine=engine, rank=rank, device_index=rank - self._my_ranks().start, store=msg.store,
            num_blocks=msg.num_blocks, parent_pid=os.getpid(), log_level=msg.log_level,
        )  # fmt: skip

    async def _watch(self, gang: str) -> None:
        """A rank of this gang exited: tell the leader, end the others (the gang is over)."""
        rank, code = await first_exit(self.ranks)
        log.error("node %d: rank %d exited (code %s): gang %s is over", self.node_rank, rank, code, gang)
        await self.sock.send(self.codec.encode(RankExited(gang=gang, rank=rank, code=code)))
        self._kill()
        self.gang = ""

    def _kill(self) -> None:
        for p in self.ranks.values():
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait()
        self.ranks = {}

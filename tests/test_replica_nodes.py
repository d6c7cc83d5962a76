"""An engine replica on another "node" on loopback (actors/replica_link.py): the front serves replica 0 and waits
for replica 1 at its door; `sluice serve --headless --data-parallel-rank 1` joins it. Both serve (requests land on
each, their greedy outputs the one-replica server's); a node with the wrong cluster secret is refused (it exits with
code 2 saying so) and the front serves on; once the node is killed, the front takes replica 1 out of rotation
(/health stays 200) and serves on replica 0. Without processes: the door's table (actors/replica_link.py), epochs,
numbered relays and what a node may deliver."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import sys

import pytest

from actors import replica_link
from actors.engine.config import EngineConfig
from actors.replica_link import STALE_S, Door
from actors.replica_remote import NUMBER_WINDOW, QUARANTINE_S
from actors.runtime.curve import SECRET_ENV
from frontend.http_base import HttpConfig
from frontend.launch import start_server
from messages.codec import Codec
from messages.step import REPLICA_TYPES, Relay, ReplicaHello, Welcome
from messages.wire import Abort, ActorDown, ActorUp, Shutdown, TextOutputs
from tests.conftest import ServerHandle
from tests.test_gang_nodes import free_port

PROMPTS = [[1, 2, 3], [40, 41, 42, 43], [7] * 12, [300, 12, 4000, 91], [99, 98]]
SERVING = "sluice:dp_engine_serving"
LIMITS = {"max_model_len": 512, "max_num_seqs": 16, "num_kv_blocks": 256}  # the `server` fixture's


async def node(model_dir, port: int, secret: str, stderr=None) -> asyncio.subprocess.Process:
    argv = ["-m", "frontend.cli", "serve", str(model_dir), "--headless", "--data-parallel-size", "2"]
    argv += ["--data-parallel-rank", "1", "--data-parallel-rpc-port", str(port), "--engine-threads", "1"]
    argv += [f"--{k.replace('_', '-')}={v}" for k, v in LIMITS.items()]
    env = {**os.environ, SECRET_ENV: secret}
    return await asyncio.create_subprocess_exec(sys.executable, *argv, env=env, stderr=stderr)


@pytest.fixture(scope="module")
async def front(tiny_model_dir):
    os.environ[SECRET_ENV] = "the right secret"  # (the launcher's door reads it; the processes inherit it)
    port = free_port()
    engine = EngineConfig(model=str(tiny_model_dir), data_parallel_size=2, data_parallel_size_local=1,
                          data_parallel_rpc_port=port, engine_threads=1, **LIMITS)  # fmt: skip
    srv = await start_server(engine, HttpConfig(port=0), log_level="WARNING")
    handle = ServerHandle(srv, tiny_model_dir)
    try:
        yield handle, port
    finally:
        await handle.close_clients()
        await srv.stop()
        del os.environ[SECRET_ENV]


async def greedy(handle: ServerHandle) -> list[tuple[str, int]]:
    async def one(prompt):
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0}
        async with handle.session() as s, s.post("/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return (await resp.json())["choices"][0]["text"], int(resp.headers["X-Sluice-Engine"])

    return await asyncio.gather(*(one(p) for p in PROMPTS))


async def test_a_replica_on_another_node_joins_serves_and_leaves(front, server, tiny_model_dir):
    handle, port = front
    assert await handle.per_engine(SERVING) == {"0": 1.0, "1": 0.0}, "replica 1 is down until its node joins"
    joined = await node(tiny_model_dir, port, "the right secret")
    try:
        await handle.wait_per_engine(SERVING, lambda up: up == {"0": 1.0, "1": 1.0}, 120)
        wrong = await node(tiny_model_dir, port, "a wrong secret", asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(wrong.communicate(), 120)
        assert wrong.returncode == 2 and b"is the cluster secret the same on every node?" in err
        served, reference = await greedy(handle), await greedy(server)
        assert [text for text, _ in served] == [text for text, _ in reference]
        assert {engine for _, engine in served} == {0, 1}
        await handle.wait_per_engine("sluice:generation_tokens_total", lambda n: n.get("1"))  # (through the door)
    finally:
        joined.send_signal(signal.SIGKILL)
        await joined.wait()
    await handle.wait_per_engine(SERVING, lambda up: up == {"0": 1.0, "1": 0.0}, 3 * STALE_S)
    async with handle.session() as s, s.get("/health") as resp:
        assert resp.status == 200
    assert {engine for _, engine in await greedy(handle)} == {0}


class FakeSocket:
    def __init__(self):
        self.sent: list[tuple[bytes, object]] = []

    def send_multipart(self, frames):
        peer, frame = frames
        self.sent.append((peer, Codec(REPLICA_TYPES).decode(frame)))
        done = concurrent.futures.Future()
        done.set_result(None)
        return done


class FakeRouter:
    def __init__(self):
        self.delivered: list[tuple[str, object]] = []

    def send(self, src, dst, msg):
        self.delivered.append((dst, msg))


class Clock:
    """actors.replica_link's time (its monotonic clock), moved by the test."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    """actors.replica_link on a Clock of the test's (monotonic only: for the Door's tests, not NodeLink's)."""
    monkeypatch.setattr(replica_link, "time", clock := Clock())
    return clock


def door() -> Door:
    d = Door([1], "http", "tcp://127.0.0.1:0")
    d.sock, d.router = FakeSocket(), FakeRouter()
    return d


def relay(d: Door, peer: bytes, msg) -> None:
    d._on_relay(Relay(dst="http", frame=Codec().encode(msg)), peer)


def joined(d: Door, peer: bytes = b"A") -> None:
    """Replica 1 up in a new epoch: its node's hello, the Welcome it adopts, its hello in that epoch."""
    r = d.remote[1]
    d._on_hello(ReplicaHello(replica=1, epoch=0), peer)
    d._on_hello(ReplicaHello(replica=1, epoch=r.epoch), peer)
    assert r.up


def test_the_door_admits_a_node_under_a_new_epoch_and_delivers_only_its_replicas_messages():
    d, r = door(), None
    d._on_hello(ReplicaHello(replica=1, epoch=0), b"A")
    (peer, welcome), r = d.sock.sent[-1], d.remote[1]
    assert (peer, welcome.epoch) == (b"A", r.epoch) and not r.up and not d.router.delivered
    d._on_hello(ReplicaHello(replica=1, epoch=welcome.epoch), b"A")
    assert r.up and [(dst, m.actor) for dst, m in d.router.delivered] == [("http", a) for a in r.names.actors]
    d.router.delivered.clear()
    d._on_hello(ReplicaHello(replica=1, epoch=0), b"B")  # a second launcher while the first is heard
    assert r.up and r.peer == b"A" and d.sock.sent[-1][0] == b"A"
    ours = TextOutputs(step=0, deltas=[], replica=1)
    for msg in (ours, TextOutputs(step=0, deltas=[], replica=0), ActorDown(actor="scheduler"), Shutdown(reason="x"),
                ActorDown(actor="detokenizer.1")):  # fmt: skip
        relay(d, b"A", msg)
    relay(d, b"B", ours)  # (not its node)
    assert d.router.delivered == [("http", ours), ("http", ActorDown(actor="detokenizer.1"))]
    d.forward(1, "scheduler.1", Abort(request_id="x", reason="client"))
    d.forward(1, "scheduler.1", Abort(request_id="y", reason="client"))
    assert [m.seq for _, m in d.sock.sent if isinstance(m, Relay)] == [1, 2]


def test_a_node_that_left_the_epoch_is_down_until_it_adopts_a_new_one():
    d = door()
    r = d.remote[1]
    d._on_hello(ReplicaHello(replica=1, epoch=0), b"A")
    first = r.epoch
    d._on_hello(ReplicaHello(replica=1, epoch=first), b"A")
    d.router.delivered.clear()
    d._on_hello(ReplicaHello(replica=1, epoch=0), b"A")  # it found a relay missing (or restarted)
    assert not r.up and [m.actor for _, m in d.router.delivered if isinstance(m, ActorDown)] == list(r.names.actors)
    assert r.epoch == first + 1 and d.sock.sent[-1][1] == Welcome(replica=1, epoch=first + 1)
    d.forward(1, "scheduler.1", Abort(request_id="x", reason="client"))  # (down: dropped)
    assert not any(isinstance(m, Relay) for _, m in d.sock.sent)
    d.router.delivered.clear()
    d.on_actor_up(ActorUp(actor="http"))  # the client restarted while replica 1 was down: told again
    assert [m.actor for _, m in d.router.delivered] == list(r.names.actors)
    d._on_hello(ReplicaHello(replica=1, epoch=first + 1), b"A")
    assert r.up


def test_a_node_whose_outputs_jump_past_the_window_is_taken_out_of_rotation(clock):
    """One TextOutputs numbered far past the last (2**62: the front listed every number up to it, hung) is a protocol
    violation: not delivered, the replica down (its requests go on elsewhere), counted, and its node offered no new
    epoch for QUARANTINE_S (its hellos unanswered), twice that after a second; then it serves again, its numbering
    taken afresh. Within the window, gaps (losses) and a new detokenizer's 0 are delivered."""
    d = door()
    joined(d)
    r = d.remote[1]
    numbers = [0, 1, 5, 10_005, 10_005 + NUMBER_WINDOW, 0, 3]  # (10,000 skipped: 2 s lost at 5,000 steps a second;
    for n in numbers:  # a gap of NUMBER_WINDOW: a loss; 0: its detokenizer restarted)
        relay(d, b"A", TextOutputs(step=0, deltas=[], number=n, replica=1))
    assert [m.number for _, m in d.router.delivered if isinstance(m, TextOutputs)] == numbers
    for violation in (1, 2):
        d.router.delivered.clear()
        jump = 2 ** (61 + violation)  # (2**62 after 3, then 2**63 after 2**62 + 1)
        relay(d, b"A", TextOutputs(step=0, deltas=[], number=jump, replica=1))
        assert not r.up and d.violations == violation
        assert [(type(m), m.actor) for _, m in d.router.delivered] == [(ActorDown, a) for a in r.names.actors]
        assert "protocol violation" in d.router.delivered[0][1].reason
        assert f"no new epoch for {QUARANTINE_S * violation:.0f} s" in d.router.delivered[0][1].reason
        welcomes = len(d.sock.sent)
        for _ in range(violation):
            d._on_hello(ReplicaHello(replica=1, epoch=0), b"A")
            assert not r.up and len(d.sock.sent) == welcomes, "barred: no Welcome"
            clock.now += QUARANTINE_S
        joined(d)
        d.router.delivered.clear()
        relay(d, b"A", TextOutputs(step=0, deltas=[], number=jump + 1, replica=1))  # (the client's link was reset)
        assert r.up and [m.number for _, m in d.router.delivered] == [jump + 1]

"""The actor runtime over real processes and real ZMQ sockets (its supervision: tests/test_runtime_supervision.py)."""

from __future__ import annotations

import asyncio
import os
from typing import get_args

import pytest
import zmq

from actors.runtime import Actor, ActorSpec, ActorSystem, AskTimeout, ProcessSpec, RestartPolicy
from actors.runtime.process import GC_GEN0
from messages.codec import BadFrame, Codec, LocalOnlyError
from messages.wire import (
    Abort,
    AbortReason,
    CheckIdle,
    Finished,
    FinishReason,
    Opaque,
    Ping,
    Pong,
    Probe,
    Shutdown,
)
from tests.runtime_actors import ECHO, Drainer, Recorder, Sender


async def test_ping_pong_across_processes():
    tester = Sender()
    async with ActorSystem([ECHO], local=[tester]) as system:
        pong = await tester.ask("echo", Ping(payload=b"hi"), timeout=5)
        assert isinstance(pong, Pong) and pong.payload == b"hi"
        assert os.stat(system.rundir).st_mode & 0o777 == 0o700
        rundir = system.rundir
    assert not os.path.exists(rundir), "runtime directory removed on exit"


async def test_order_preserved_under_load():
    tester, recorder = Sender(), Recorder()
    async with ActorSystem([ECHO], local=[tester, recorder]):
        for i in range(10_000):
            tester.tell("echo", Probe(seq=i))
        assert await recorder.until(lambda: len(recorder.probes) == 10_000, 20)
        assert [p.seq for p in recorder.probes] == list(range(10_000))


async def test_bad_frames_counted_and_survived():
    tester, recorder = Sender(), Recorder()
    async with ActorSystem([ECHO], local=[tester, recorder]) as system:
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.connect(system.placement.address("echo"))
        for frame in (b"garbage", b"\x93\xa5Probe\xa1x", b"\x91\xa7Unknown"):
            sock.send(frame)
        sock.close(linger=1000)
        tester.tell("echo", Probe(seq=1))
        assert await recorder.until(lambda: len(recorder.probes) == 1, 20)
        report = await tester.ask("echo", CheckIdle())
        assert report.details["bad_frames"] == 3


async def test_an_actor_process_once_started_collects_young_objects_every_gc_gen0_allocations():
    """settle_heap (actors/runtime/process.py) runs in every actor process: CPython's 700 is the test's power."""
    tester = Sender()
    async with ActorSystem([ECHO], local=[tester]):
        report = await tester.ask("echo", CheckIdle())
    assert report.details["gc_young"] == GC_GEN0 != 700


async def test_ask_timeout_and_local_only_refused():
    tester = Sender()
    async with ActorSystem([ECHO], local=[tester], policy=RestartPolicy(heartbeat_s=60, stop_timeout_s=1)):
        tester.tell("echo", Probe(seq=0, payload=b"hang"))
        with pytest.raises(AskTimeout):
            await tester.ask("echo", Ping(), timeout=0.3)
        with pytest.raises(LocalOnlyError, match="local-only"):
            tester.tell("echo", Opaque(kind="tensor", payload=object()))


def test_reasons_are_declared_once_and_a_stray_one_is_a_bad_frame():
    """Finish and abort reasons are Literals in messages.wire: every declared one crosses a link, a stray one (a typo
    on the sending side) is a bad frame, logged and dropped by the receiver, never a request ended for no reason."""
    codec = Codec()
    for reason in get_args(AbortReason):
        assert codec.decode(codec.encode(Abort(request_id="r", reason=reason))).reason == reason
    for reason in get_args(FinishReason):
        assert codec.decode(codec.encode(Finished(request_id="r", finish_reason=reason))).finish_reason == reason
    with pytest.raises(BadFrame, match=r"Invalid enum value 'timeout'"):
        codec.decode(codec.encode(Abort(request_id="r", reason="timeout")))


async def test_until_wakes_when_the_state_moves_and_gives_up_at_its_deadline():
    """`Actor.until` re-checks its condition at each change (a handled message, `moved()`), not on a timer."""
    actor, state, checks = Actor("waiter"), [], []

    def done() -> bool:
        checks.append(len(state))
        return len(state) == 2

    async def change() -> None:
        for _ in range(2):
            await asyncio.sleep(0)
            state.append(1)
            actor.moved()

    task = asyncio.create_task(change())
    assert await actor.until(done, timeout_s=5)
    assert checks == [0, 1, 2], "checked once at the start and once per change"
    await task
    assert not await actor.until(lambda: len(state) > 2, timeout_s=0.05)


async def test_an_actor_drains_while_it_goes_on_handling_messages():
    """Shutdown runs `on_shutdown` in a task of the actor's own: a drain that waits for a message gets it (awaited
    inside the message loop, as it was, it waited out its deadline: the scheduler's did, for a worker's results)."""
    tester, drainer = Sender(), Drainer()
    async with ActorSystem([ECHO], local=[tester, drainer]):
        tester.tell("drainer", Shutdown(reason="shutdown"))
        tester.tell("drainer", Probe(seq=1))
        await asyncio.wait_for(drainer.done.wait(), 10)
    assert drainer.drained and [p.seq for p in drainer.probes] == [1]


class Listener(Recorder):
    """A Recorder that handles no Probe until its processes have exited (they all lie in its inbox or socket then),
    and then waits (5 s at most) until `count` Probes were handled."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count
        self.exited = asyncio.Event()

    async def on_probe(self, msg: Probe) -> None:
        await self.exited.wait()
        super().on_probe(msg)

    async def on_processes_exited(self, timeout_s: float) -> None:
        self.exited.set()
        await self.until(lambda: len(self.probes) == self.count, 5)


async def test_what_a_process_sends_as_it_ends_arrives():
    """What a process's actors sent last (ZMQ's I/O thread may still hold it as they end) goes out before it exits,
    and the launcher's actors handle it before they stop: the detokenizer's Finished(abort, "shutdown") was lost
    either way."""
    count, size = 400, 65536
    last = ActorSpec(name="last", factory="tests.runtime_actors:LastWords", kwargs={"count": count, "size": size})
    listener = Listener(count)
    async with ActorSystem([ProcessSpec(name="lastproc", actors=[last])], local=[listener]) as system:
        pass  # (its drain sends them as the system stops)
    assert [(p.seq, len(p.payload)) for p in listener.probes] == [(seq, size) for seq in range(count)]
    assert system.children["lastproc"].exitcode == 0


class Holder(Sender):
    """Counts its `on_stop` calls."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.stops = 0

    def on_stop(self) -> None:
        self.stops += 1


async def test_a_stopped_actor_releases_what_it_holds():
    """`on_stop` runs once an actor has ended, stopped as a launcher stops its local actors, not drained: the replica
    door closed its ZMQ context only on a drain, left it to the collector, and the process hung at its exit."""
    holder = Holder("holder")
    async with ActorSystem([], local=[holder]):
        assert holder.stops == 0
    assert holder.stops == 1

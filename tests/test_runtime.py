"""The actor runtime over real processes and real ZMQ sockets."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import get_args

import msgspec
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
from tests.cancel_harness import wait_for
from tests.runtime_actors import Drainer, Recorder, Sender

ECHO = ProcessSpec(name="echoproc", actors=[ActorSpec(name="echo", factory="tests.runtime_actors:Echo")])
FAST = RestartPolicy(heartbeat_s=0.2, heartbeat_timeout_s=0.5, max_missed=2, max_restarts=2, window_s=60)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


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


async def test_kill_restart_and_actor_events():
    recorder = Recorder()
    async with ActorSystem([ECHO], local=[recorder], policy=FAST) as system:
        old = system.pids()["echoproc"]
        system.kill("echoproc")
        assert await recorder.until(lambda: ("ActorUp", "echo") in recorder.events, 20)
        assert recorder.events[:2] == [("ActorDown", "echo"), ("ActorUp", "echo")]
        assert system.pids()["echoproc"] != old and not alive(old)
        recorder.probes.clear()
        recorder.tell("echo", Probe(seq=7))  # the new incarnation serves
        assert await recorder.until(lambda: len(recorder.probes) == 1, 20)


async def test_hung_actor_is_killed_and_restarted():
    tester, recorder = Sender(), Recorder()
    async with ActorSystem([ECHO], local=[tester, recorder], policy=FAST) as system:
        old = system.pids()["echoproc"]
        tester.tell("echo", Probe(seq=0, payload=b"hang"))
        assert await recorder.until(lambda: ("ActorUp", "echo") in recorder.events, 20)
        assert system.pids()["echoproc"] != old


async def test_restart_intensity_exceeded_stops_nonzero_with_exit_past_intensity():
    """The old behaviour, kept behind `exit_past_intensity` (--exit-on-engine-failure): tests/test_supervision_backoff.py
    has the default's back-off."""
    recorder = Recorder()
    policy = RestartPolicy(heartbeat_s=60, max_restarts=1, window_s=60, exit_past_intensity=True)
    system = ActorSystem([ECHO], local=[recorder], policy=policy)
    await system.start()
    try:
        pid = system.pids()["echoproc"]
        system.kill("echoproc")
        assert await recorder.until(lambda: ("ActorUp", "echo") in recorder.events, 20)
        assert system.pids()["echoproc"] != pid
        system.kill("echoproc")
        await asyncio.wait_for(system.done.wait(), 20)
        assert system.exit_code == 1
        assert not system.pids()
    finally:
        await system.stop()


async def test_a_restart_that_dies_during_startup_is_tried_again(tmp_path):
    """Within max_restarts, a process that dies while it restarts is restarted again (not the system stopped)."""
    marker = tmp_path / "fail-next-start"
    spec = ProcessSpec(
        name="echoproc",
        actors=[
            ActorSpec(name="echo", factory="tests.runtime_actors:FailsOnceAtStart", kwargs={"marker": str(marker)})
        ],
    )
    recorder = Recorder()
    async with ActorSystem([spec], local=[recorder], policy=FAST) as system:
        marker.touch()
        system.kill("echoproc")
        assert await recorder.until(lambda: ("ActorUp", "echo") in recorder.events, 20)
        assert not marker.exists() and not system.done.is_set() and len(system.restarts["echoproc"]) == 2
        recorder.tell("echo", Probe(seq=3))
        assert await recorder.until(lambda: len(recorder.probes) == 1, 20)


def heard(recorder: Recorder) -> list[bytes]:
    """What the watcher heard about the echo actor."""
    return [p.payload for p in recorder.probes if p.seq == 0 and p.payload.startswith(b"watcher heard ")
            and p.payload.endswith(b":echo")]  # fmt: skip


async def test_a_restarted_actor_hears_who_is_down_now_not_what_died_while_it_started(tmp_path):
    """A death broadcast while an actor restarts must not reach its new incarnation late (the engine once aborted
    every request on the news of a detokenizer death that happened, and was repaired, while it restarted); a
    process down when it is Ready is announced to it then, and its ActorUp follows. Restarts are held at a gate."""

    def spec(proc: str, name: str) -> ProcessSpec:
        kwargs = {"marker": str(tmp_path / f"{name}-held"), "gate": str(tmp_path / f"{name}-gate")}
        return ProcessSpec(
            name=proc, actors=[ActorSpec(name=name, factory="tests.runtime_actors:Watcher", kwargs=kwargs)]
        )

    gates = {}  # name -> the write end of its FIFO gate (held open: a byte written waits there for the reader)
    for name in ("watcher", "echo"):
        os.mkfifo(tmp_path / f"{name}-gate")
        gates[name] = os.open(tmp_path / f"{name}-gate", os.O_RDWR)

    def held_restart(name: str) -> None:
        (tmp_path / f"{name}-held").touch()

    recorder = Recorder()
    policy = msgspec.structs.replace(FAST, max_restarts=4)
    async with ActorSystem(
        [spec("watchproc", "watcher"), spec("echoproc", "echo")], local=[recorder], policy=policy
    ) as system:
        held_restart("watcher")
        system.kill("watchproc")
        await wait_for(lambda: system.state.get("watchproc") == "starting")
        system.kill("echoproc")  # dies and comes back while the watcher starts
        assert await recorder.until(lambda: ("ActorUp", "echo") in recorder.events, 20)
        os.write(gates["watcher"], b"x")
        assert await recorder.until(lambda: ("ActorUp", "watcher") in recorder.events, 20)
        recorder.tell("watcher", Probe(seq=1))  # every event it heard arrives before this
        assert await recorder.until(lambda: any(p.seq == 1 for p in recorder.probes), 20)
        assert heard(recorder) == []
        held_restart("echo")
        system.kill("watchproc")
        await wait_for(lambda: system.state.get("watchproc") == "starting")
        system.kill("echoproc")  # down (held) when the watcher is Ready: it is told so, then hears the ActorUp
        assert await recorder.until(lambda: recorder.events.count(("ActorUp", "watcher")) == 2, 20)
        os.write(gates["echo"], b"x")
        assert await recorder.until(lambda: len(heard(recorder)) == 2, 20)
        assert heard(recorder) == [b"watcher heard ActorDown:echo", b"watcher heard ActorUp:echo"]
    for fd in gates.values():
        os.close(fd)


LAUNCHER = """
import asyncio, sys
from actors.runtime import ActorSpec, ActorSystem, ProcessSpec
async def main():
    procs = [ProcessSpec(name=f"p{i}", actors=[ActorSpec(name=f"echo{i}", factory="tests.runtime_actors:Echo")]) for i in range(2)]
    async with ActorSystem(procs) as system:
        print(" ".join(str(p) for p in system.pids().values()), flush=True)
        await asyncio.sleep(3600)
asyncio.run(main())
"""


async def test_children_die_with_the_launcher():
    launcher = await asyncio.create_subprocess_exec(
        sys.executable, "-c", LAUNCHER, stdout=asyncio.subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(__file__))
    )
    line = await asyncio.wait_for(launcher.stdout.readline(), 60)
    pids = [int(p) for p in line.split()]
    assert len(pids) == 2 and all(alive(p) for p in pids)
    launcher.kill()
    await launcher.wait()
    await wait_for(lambda: not any(alive(p) for p in pids), timeout=10)


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

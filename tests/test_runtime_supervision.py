"""The actor runtime's supervision over real processes: restarts on a kill or a hang, the restart intensity, a restart
that dies as it starts, who a restarted actor hears is down, children that die with their launcher."""

from __future__ import annotations

import asyncio
import os
import sys

import msgspec

from actors.runtime import ActorSpec, ActorSystem, ProcessSpec, RestartPolicy
from messages.wire import Probe
from tests.cancel_harness import wait_for
from tests.runtime_actors import ECHO, FAST, Recorder, Sender, alive


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

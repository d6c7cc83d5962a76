"""Past its restart intensity a process is restarted after an exponential back-off, not the system stopped
(actors/runtime/backoff.py, actors/runtime/system.py); the old stop is kept behind exit_past_intensity
(tests/test_runtime_supervision.py) and --exit-on-engine-failure (refused where nothing restarts). A restart that fails in any way
(a fork refused, a nameless signal, no Ready in time: killed first, its late Ready ignored) is tried again, and
explained as the caller explains a first start. The HTTP front's side: tests/test_readiness.py."""

from __future__ import annotations

import errno
import os
import signal
from multiprocessing.context import ForkServerProcess

import msgspec
import pytest

from actors.runtime import ActorSpec, ActorSystem, ProcessSpec, RestartPolicy, StartupError
from actors.runtime.backoff import RestartBudget
from actors.runtime.curve import SECRET_ENV
from frontend.cli import build_parser
from frontend.cli_engine import engine_config, restart_policy
from messages.wire import ActorDown, Ready
from tests.cancel_harness import wait_for
from tests.runtime_actors import Recorder, alive

ECHO = ProcessSpec(name="echoproc", actors=[ActorSpec(name="echo", factory="tests.runtime_actors:Echo")])
PATIENT = RestartPolicy(heartbeat_s=60, max_restarts=3, window_s=60)  # (every restart here is within the intensity)


def test_the_budget_restarts_at_once_within_the_intensity_then_backs_off_doubling_to_its_cap():
    policy = RestartPolicy(max_restarts=3, window_s=60, backoff_s=1, max_backoff_s=8)
    budget = RestartBudget(policy)
    waits = [budget.next_wait(t) for t in (0, 1, 2, 3, 4, 5, 6, 7)]
    assert waits == [0, 0, 0, 1, 2, 4, 8, 8]
    assert budget.total == 8


def test_a_group_up_a_whole_window_gets_its_budget_back():
    budget = RestartBudget(RestartPolicy(max_restarts=1, window_s=60, backoff_s=1, max_backoff_s=60))
    assert [budget.next_wait(t) for t in (0, 10, 20)] == [0, 1, 2]
    assert budget.next_wait(50) == 4  # (its last restart, at 22, is within the window: still backing off)
    assert budget.next_wait(54 + 61) == 0  # up 61 s since its last restart (at 54): at once again
    assert budget.next_wait(116) == 1


class DownRecorder(Recorder):
    """Records every ActorDown whole."""

    def __init__(self):
        super().__init__()
        self.downs: list[ActorDown] = []

    def on_event(self, msg) -> None:
        if isinstance(msg, ActorDown):
            self.downs.append(msg)
        super().on_event(msg)


async def test_past_the_intensity_the_process_is_restarted_after_a_doubling_back_off():
    """max_restarts 1: the first death restarts at once, each one after waits backoff_s, then twice that (the cap);
    every death is announced with its wait and the group's restart count, the system never stops."""
    recorder = DownRecorder()
    policy = RestartPolicy(heartbeat_s=60, max_restarts=1, window_s=60, backoff_s=0.05, max_backoff_s=0.1)
    async with ActorSystem([ECHO], local=[recorder], policy=policy) as system:
        for n in (1, 2, 3):
            pid = system.pids()["echoproc"]
            system.kill("echoproc")
            assert await recorder.until(lambda n=n: recorder.events.count(("ActorUp", "echo")) == n, 30)
            assert system.pids()["echoproc"] != pid
        assert not system.done.is_set() and system.exit_code == 0
        assert [(d.retry_in_s, d.restarts) for d in recorder.downs] == [(0.0, 1), (0.05, 2), (0.1, 3)]
        assert system.restarts["echoproc"].backoff == 0.1


@pytest.mark.parametrize(("flag", "exits"), [([], False), (["--exit-on-engine-failure"], True)])
def test_exit_on_engine_failure_restores_the_stop(flag, exits):
    args = build_parser().parse_args(["serve", "m", *flag])
    assert restart_policy(args).exit_past_intensity is exits
    generate = build_parser().parse_args(["generate", "m", "hi"])
    assert restart_policy(generate, give_up=True).exit_past_intensity  # (generate's caller waits at a terminal)


def test_exit_on_engine_failure_is_refused_on_a_gang_node_that_restarts_nothing(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "s")
    gang = ["serve", "m", "--headless", "--nnodes", "2", "--node-rank", "1", "--tensor-parallel-size", "2"]
    with pytest.raises(SystemExit, match="--exit-on-engine-failure: a gang's headless node"):
        engine_config(build_parser().parse_args([*gang, "--exit-on-engine-failure"]), "m")
    replica = ["serve", "m", "--headless", "-dp", "2", "--data-parallel-rank", "1", "--exit-on-engine-failure"]
    assert engine_config(build_parser().parse_args(replica), "m").data_parallel_rank == 1  # (its own supervisor)


@pytest.mark.parametrize("failure", ["fork refused", "a real-time signal"])
async def test_a_restart_that_cannot_start_is_tried_again(monkeypatch, caplog, failure):
    """A restart whose fork fails, or whose child dies of a signal with no name (SIGRTMIN + 6) as it starts, is a
    failed start (logged, tried again), not a recovery that ends silently with the process "starting" for ever."""
    start, failed = ForkServerProcess.start, []

    def fails_once(child: ForkServerProcess) -> None:
        if failed:
            return start(child)
        failed.append(child.name)
        if failure == "fork refused":
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        start(child)
        os.kill(child.pid, signal.SIGRTMIN + 6)

    recorder = Recorder()
    async with ActorSystem([ECHO], local=[recorder], policy=PATIENT) as system:
        monkeypatch.setattr(ForkServerProcess, "start", fails_once)
        system.kill("echoproc")
        assert await recorder.until(lambda: ("ActorUp", "echo") in recorder.events, 30)
        assert failed == ["sluice:echoproc"] and len(system.restarts["echoproc"]) == 2
    how = (
        "could not be started: [Errno 11]"
        if failure == "fork refused"
        else f"was killed by signal {signal.SIGRTMIN + 6}"
    )
    assert f"restart of echoproc failed: process echoproc {how}" in caplog.text


@pytest.fixture
def held(tmp_path):
    """A watcher's process whose next start, once the file `marker` exists, waits at a gate that is never opened (its
    FIFO, written at the end for an incarnation left waiting)."""
    marker, gate = tmp_path / "held", tmp_path / "gate"
    os.mkfifo(gate)
    fd = os.open(gate, os.O_RDWR)
    kwargs = {"marker": str(marker), "gate": str(gate)}
    yield ProcessSpec(name="watchproc", actors=[ActorSpec(name="watcher", factory="tests.runtime_actors:Watcher",
                                                          kwargs=kwargs)]), marker  # fmt: skip
    os.write(fd, b"x")
    os.close(fd)


async def held_restart(system: ActorSystem, marker) -> int:
    """Kill the watcher's process with its next start held; the pid of that start, once spawned (its wait for Ready
    begun)."""
    old = system.pids()["watchproc"]
    marker.touch()
    system.kill("watchproc")
    await wait_for(lambda: system.children["watchproc"].pid != old, 30, "the held restart spawned")
    return system.children["watchproc"].pid


async def test_a_restart_not_ready_in_time_is_killed_before_the_next_and_its_late_ready_ignored(held):
    """An incarnation left running would hold its memory beside the next, and its late Ready would count as the
    next one's."""
    spec, marker = held
    recorder = Recorder()
    async with ActorSystem([spec], local=[recorder], policy=msgspec.structs.replace(PATIENT)) as system:
        patience, system.policy.ready_timeout_s = system.policy.ready_timeout_s, 1.0  # (the held start's deadline)
        pid = await held_restart(system, marker)
        system.policy.ready_timeout_s = patience  # (the held start's deadline is set: the next one's is the default)
        assert await recorder.until(lambda: ("ActorUp", "watcher") in recorder.events, 30)
        assert not alive(pid) and system.pids()["watchproc"] != pid
        system.supervisor.ready["watcher"].clear()
        system.supervisor.on_ready(Ready(actor="watcher", pid=pid))  # (the killed one's, arriving late)
        assert not system.supervisor.ready["watcher"].is_set()


async def test_a_restart_killed_as_it_starts_is_explained_as_a_first_start_is(held, caplog):
    """The caller's explanation (the front's: most likely out of memory, frontend/launch.py `explain`) of a process
    SIGKILLed while it starts covers its restarts too."""
    spec, marker = held
    recorder = Recorder()
    explain = lambda e: StartupError(f"{e}: explained", e.proc, e.exitcode)  # noqa: E731
    async with ActorSystem([spec], local=[recorder], policy=PATIENT, explain=explain) as system:
        await held_restart(system, marker)
        await wait_for(lambda: not marker.exists(), 30, "the restart held")  # (its start consumed it: at the gate)
        system.kill("watchproc")
        assert await recorder.until(lambda: ("ActorUp", "watcher") in recorder.events, 30)
    assert (
        "restart of watchproc failed: process watchproc was killed by SIGKILL during startup: explained" in caplog.text
    )

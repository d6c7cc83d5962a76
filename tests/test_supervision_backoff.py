"""Past its restart intensity a process is restarted after an exponential back-off, not the system stopped
(actors/runtime/backoff.py, actors/runtime/system.py); the old stop is kept behind exit_past_intensity
(tests/test_runtime.py) and --exit-on-engine-failure. The HTTP front's side: tests/test_readiness.py."""

from __future__ import annotations

import pytest

from actors.runtime import ActorSpec, ActorSystem, ProcessSpec, RestartPolicy
from actors.runtime.backoff import RestartBudget
from frontend.cli import build_parser
from frontend.cli_engine import restart_policy
from messages.wire import ActorDown
from tests.runtime_actors import Recorder

ECHO = ProcessSpec(name="echoproc", actors=[ActorSpec(name="echo", factory="tests.runtime_actors:Echo")])


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

"""Fault plans: each action observed exactly as configured for a fixed seed, and replayed."""

from __future__ import annotations

import time

import pytest

from actors.runtime import ActorSystem, FaultPlan, FaultRule
from actors.runtime.faults import FaultInjector
from messages.wire import CheckIdle, Probe
from tests.cancel_harness import wait_for
from tests.runtime_actors import ECHO, Recorder, Sender

N = 200


def expected_order(plan: FaultPlan, n: int) -> list[int]:
    """What the receiver must see, from the plan's semantics (see actors/runtime/faults.py)."""
    injector, out, held = FaultInjector(plan), [], None

    def forward(i):
        nonlocal held
        out.append(i)
        if held is not None:
            out.append(held)
            held = None

    for i in range(n):
        rule = injector.decide("tester->echo", "Probe")
        if rule is None:
            forward(i)
        elif rule.action == "duplicate":
            forward(i)
            forward(i)
        elif rule.action == "reorder" and held is None:
            held = i
        elif rule.action == "reorder":
            forward(i)
    return out if held is None else [*out, held]


async def run_plan(plan: FaultPlan, n: int) -> list[int]:
    """What the recorder got, complete: FIFO barriers instead of a quiet period. The first ask sends a
    held (reordered) probe right behind it; the second's reply proves echo forwarded every probe; a
    marker probe on an unfaulted link, forwarded after them, arrives after them."""
    tester, marker, recorder = Sender(), Sender("marker"), Recorder()
    async with ActorSystem([ECHO], local=[tester, marker, recorder], fault_plan=plan):
        for i in range(n):
            tester.tell("echo", Probe(seq=i))
        for _ in range(2):
            await tester.ask("echo", CheckIdle())
        marker.tell("echo", Probe(seq=-1))
        await wait_for(lambda: recorder.probes and recorder.probes[-1].seq == -1)
        return [p.seq for p in recorder.probes[:-1]]


@pytest.mark.parametrize("action", ["drop", "duplicate", "reorder"])
async def test_fault_action_exact_and_replayed(action):
    plan = FaultPlan(seed=11, rules=[FaultRule(link="tester->echo", msg_type="Probe", action=action, probability=0.2)])
    expected = expected_order(plan, N)
    assert expected != list(range(N)), "the plan must fire for this seed"
    first = await run_plan(plan, N)
    assert first == expected
    assert await run_plan(plan, N) == first  # same seed, same faults
    other = FaultPlan(seed=12, rules=plan.rules)
    assert expected_order(other, N) != expected  # a different seed gives different faults


async def test_delay_stalls_the_link_and_keeps_fifo():
    plan = FaultPlan(seed=1, rules=[FaultRule(link="tester->echo", action="delay", delay_ms=300)])
    tester, recorder = Sender(), Recorder()
    async with ActorSystem([ECHO], local=[tester, recorder], fault_plan=plan):
        start = time.monotonic()
        for i in range(20):
            tester.tell("echo", Probe(seq=i))
        await wait_for(lambda: len(recorder.probes) == 20)
        assert [p.seq for p in recorder.probes] == list(range(20))
        assert min(recorder.times) - start >= 0.3


async def test_a_reorder_in_a_stall_overtakes_nothing_sent_before_it():
    """A chaos run hung when an AbortAck drawn for reordering while its link was stalled was delivered ahead of its
    request's AddRequest, queued behind the delay: a reorder may swap a message with the next one only."""
    from actors.runtime.mailbox import Link

    delay, reorder = (FaultRule(link="a->b", action=a, delay_ms=1) for a in ("delay", "reorder"))

    class Faults:  # (the decisions of a seeded plan, in the order that hung)
        decisions = iter([delay, None, reorder, None])

        def decide(self, link, msg_type):
            return next(self.decisions)

    got = []
    link = Link("a->b", got.append, remote=False, faults=Faults())
    for i in range(4):
        link.send(Probe(seq=i))
    link._unstall()  # (the delay's timer, run now)
    assert [p.seq for p in got] == [0, 1, 2, 3]


async def test_child_processes_apply_the_plan():
    plan = FaultPlan(seed=3, rules=[FaultRule(link="echo->recorder", action="drop")])
    tester, recorder = Sender(), Recorder()
    async with ActorSystem([ECHO], local=[tester, recorder], fault_plan=plan):
        for i in range(10):
            tester.tell("echo", Probe(seq=i))
        report = await tester.ask("echo", CheckIdle())  # FIFO (one link from the launcher): all handled before this
        assert report.details["handled"] == 12 and recorder.probes == []  # the start's ActorUp, 10 probes, the ask


def test_plan_parses_from_json_and_rejects_unknown_fields(tmp_path):
    text = '{"seed": 5, "rules": [{"link": "a->b", "action": "drop", "probability": 0.5}]}'
    assert FaultPlan.parse(text).rules[0].probability == 0.5
    path = tmp_path / "plan.json"
    path.write_text(text)
    assert FaultPlan.parse(str(path)).seed == 5
    with pytest.raises(Exception, match="action"):
        FaultPlan.parse('{"rules": [{"action": "explode"}]}')

"""Actor death and shutdown through the real processes (DESIGN section 3, "Actor death").

Killing the engine ends every in-flight stream with an error at once and the restarted engine
serves; killing the detokenizer fails its requests, the engine aborts them silently, and the
restarted detokenizer serves; stopping the system aborts what is in flight (reason "shutdown")
and every process exits 0. No zombies, no leftover state (the idle invariant) after recovery.
"""

from __future__ import annotations

import os

import pytest

from actors.runtime import RestartPolicy
from frontend.offline import AsyncLLM
from messages.sampling_params import SamplingParams
from tests.cancel_harness import (
    Run,
    assert_idle,
    engine_config,
    gate,
    model_dir,  # noqa: F401 (a fixture)
    start,
    wait_for,
    wait_state,
)

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[50, 51], [52, 53, 54], [55], [56, 57, 58, 59]]


@pytest.fixture(scope="module")
async def llm(model_dir):  # noqa: F811
    policy = RestartPolicy(heartbeat_s=0.5, max_restarts=5)
    async with AsyncLLM(engine_config(model_dir), policy=policy) as engine:
        yield engine


@pytest.fixture(autouse=True)
async def idle_after(llm):
    yield
    if llm.system.done.is_set():
        return
    gate(llm, None)
    await assert_idle(llm)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def zombie_children() -> list[int]:
    zombies = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, IndexError):
            continue
        if fields[0] == "Z" and int(fields[1]) == os.getpid():
            zombies.append(int(entry))
    return zombies


async def restarted(llm: AsyncLLM, proc: str, old_pid: int) -> None:
    await wait_for(lambda: llm.system.state.get(proc) == "up" and llm.system.pids().get(proc) != old_pid, 180)
    assert not alive(old_pid) and not zombie_children()


async def test_every_process_is_titled(llm):
    for proc, pid in llm.system.pids().items():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[0] == f"sluice:{proc}".encode()


async def test_engine_death_ends_every_stream_and_the_restart_serves(llm):
    before = start(llm, [60, 61], SHORT)
    await before.done()
    runs = [start(llm, p, LONG) for p in PROMPTS]
    for run in runs:
        await run.wait_tokens(2)
    old = llm.system.pids()["engine"]
    llm.system.kill("engine")
    for run in runs:
        fin = await run.done(timeout=2)
        assert fin.finish_reason == "error" and "died" in fin.error
    await restarted(llm, "engine", old)
    after = start(llm, [60, 61], SHORT)
    await after.done()
    assert (after.token_ids, after.finished.finish_reason) == (before.token_ids, "length")


async def held_runs(llm) -> list[Run]:
    """PROMPTS running, every one of them known to the engine, its first step executed and held at the gate."""
    gate(llm, 0)
    runs = [start(llm, p, LONG) for p in PROMPTS]
    await wait_state(llm, held_steps=1)
    await wait_for(lambda: all(r.request_id in llm.client.streams for r in runs), what="requests sent")
    await wait_state(llm, requests=len(PROMPTS))
    return runs


async def test_detokenizer_death_aborts_its_requests_in_the_engine(llm):
    runs = await held_runs(llm)
    old = llm.system.pids()["detokenizer"]
    llm.system.kill("detokenizer")
    for run in runs:
        fin = await run.done(timeout=2)
        assert fin.finish_reason == "error" and "detokenizer died" in fin.error
    state = await wait_state(llm, running=0, waiting=0, held_steps=1)  # aborted while the engine was held
    assert state["silent_aborts"] > 0, "those in the held step: freed after it, no AbortAck for a dead detokenizer"
    gate(llm, None)
    await restarted(llm, "detokenizer", old)
    after = start(llm, [62, 63], SHORT)
    assert (await after.done()).finish_reason == "length" and len(after.token_ids) == SHORT.max_tokens


async def test_shutdown_aborts_in_flight_requests_and_exits_zero(llm):
    """Last in this module: it stops the system."""
    runs = await held_runs(llm)
    pids = llm.system.pids()
    await llm.system.stop()
    for run in runs:
        fin = await run.done(timeout=1)
        assert (fin.finish_reason, fin.stop_reason) == ("abort", "shutdown")
    assert {proc: child.exitcode for proc, child in llm.system.children.items()} == {"engine": 0, "detokenizer": 0}
    assert not any(alive(pid) for pid in pids.values()) and not zombie_children()

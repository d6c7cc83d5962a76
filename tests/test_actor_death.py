"""Actor death and shutdown through the real processes (DESIGN section 3, "Actor death", I8), at the offline client.

Killing the engine pauses every in-flight stream, and once the engine is back each is resumed from what it
received and finishes exactly as an undisturbed run; killing the detokenizer does the same (the engine drops its
copies silently and takes the resumed ones); a stream live at more detokenizer deaths than the client's
max_resumes fails (the engine judges its own deaths: tests/test_worker_e2e.py); stopping the system aborts
what is in flight (reason "shutdown") and every process exits 0. No zombies, no leftover state (the idle
invariant) after recovery.
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
    policy = RestartPolicy(heartbeat_s=0.5, max_restarts=8)
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
    """The new process is up (a killed one reaped before its exit handler ran is absent from pids, not restarted)."""
    await wait_for(
        lambda: llm.system.state.get(proc) == "up" and llm.system.pids().get(proc) not in (None, old_pid), 180
    )
    assert not alive(old_pid) and not zombie_children()


async def test_every_process_is_titled(llm):
    for proc, pid in llm.system.pids().items():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[0] == f"sluice:{proc}".encode()


async def reference(llm) -> list[list[int]]:
    runs = [start(llm, p, LONG) for p in PROMPTS]
    return [(await run.done(), run.token_ids)[1] for run in runs]


async def test_engine_death_pauses_every_stream_and_each_resumes_exactly(llm):
    want = await reference(llm)
    runs = [start(llm, p, LONG) for p in PROMPTS]
    for run in runs:
        await run.wait_tokens(2)
    old = llm.system.pids()["engine"]
    llm.system.kill("engine")
    await restarted(llm, "engine", old)
    for run, tokens in zip(runs, want, strict=True):
        assert (await run.done(timeout=60)).finish_reason == "length"
        assert run.token_ids == tokens
    assert llm.client.streams.counts.resumes["death"] >= len(PROMPTS)


async def held_runs(llm) -> list[Run]:
    """PROMPTS running, every one of them known to the engine, its first step executed and held at the gate."""
    gate(llm, 0)
    runs = [start(llm, p, LONG) for p in PROMPTS]
    await wait_state(llm, held_steps=1)
    await wait_for(lambda: all(r.request_id in llm.client.streams.live for r in runs), what="requests sent")
    await wait_state(llm, requests=len(PROMPTS))
    return runs


async def test_detokenizer_death_drops_the_engine_copies_and_the_streams_resume(llm):
    want = await reference(llm)
    runs = await held_runs(llm)
    old = llm.system.pids()["detokenizer"]
    llm.system.kill("detokenizer")
    state = await wait_state(llm, running=0, waiting=0, held_steps=1)  # dropped while the engine was held
    assert state["silent_aborts"] > 0, "those in the held step: freed after it, no AbortAck for a dead detokenizer"
    gate(llm, None)
    await restarted(llm, "detokenizer", old)
    for run, tokens in zip(runs, want, strict=True):
        assert (await run.done(timeout=60)).finish_reason == "length"
        assert run.token_ids == tokens


async def test_a_stream_live_at_more_deaths_than_max_resumes_fails(llm):
    """max_resumes is 2: a stream through three detokenizer deaths fails (a poison request); the system serves on."""
    run = start(llm, [70, 71], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    await run.wait_tokens(1)
    for deaths in range(3):
        old = llm.system.pids()["detokenizer"]
        llm.system.kill("detokenizer")
        await restarted(llm, "detokenizer", old)
        if deaths < 2:
            assert run.finished is None
    fin = await run.done(timeout=60)
    assert fin.finish_reason == "error" and "after 2 restarts of the detokenizer" in fin.error
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
    late = start(llm, [60, 61], SHORT)  # after the stop: ends at once, never waits
    assert (await late.done(timeout=1)).error == "the system stopped"
    assert not any(alive(pid) for pid in pids.values()) and not zombie_children()

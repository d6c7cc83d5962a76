"""Who sizes the KV cache on CUDA, and how its count reaches the scheduler (actors/engine/kv_sizing.py): the worker
in its own process by default there, a process started after another is Ready (ProcessSpec.after, over real
processes), the count published in the runtime directory. A real card runs it whole in tests/test_cuda.py."""

from __future__ import annotations

import asyncio
import os
import stat

import pytest
import torch

from actors.engine import kv_sizing
from actors.engine.config import EngineConfig, SpeculativeConfig
from actors.graph import replica_processes
from actors.runtime import ActorSpec, ActorSystem, ProcessSpec, RestartPolicy, StartupError
from tests.cancel_harness import wait_for
from tests.runtime_actors import Recorder

POLICY = RestartPolicy(heartbeat_s=0.2, heartbeat_timeout_s=0.5, max_missed=2, max_restarts=0, window_s=60)


def spec(name: str, actor: str, factory: str, after: str | None = None, **kwargs) -> ProcessSpec:
    return ProcessSpec(name=name, actors=[ActorSpec(name=actor, factory=f"tests.runtime_actors:{factory}",
                                                   kwargs=kwargs)], after=after)  # fmt: skip


async def test_a_process_after_another_is_started_once_that_one_is_ready(tmp_path):
    """The reader's start fails unless the publisher's start has written its file: listed first, it is forked only
    once the publisher is Ready (held at a gate until the test has seen the reader not forked)."""
    gate, path = tmp_path / "gate", tmp_path / "published"
    os.mkfifo(gate)
    fd = os.open(gate, os.O_RDWR)  # (held open: the byte waits for the reader of the FIFO)
    reader = spec("second", "reader", "Reader", after="first", path=str(path))
    publisher = spec("first", "publisher", "Publisher", gate=str(gate), path=str(path))
    recorder = Recorder()
    system = ActorSystem([reader, publisher], local=[recorder], policy=POLICY)
    starting = asyncio.create_task(system.start())
    try:
        assert await recorder.until(lambda: recorder.probes, 20)  # the publisher's start has begun
        assert system.state == {"first": "starting"}  # ... the reader's not
        os.write(fd, b"x")
        await asyncio.wait_for(starting, 30)
        assert system.state == {"first": "up", "second": "up"}
    finally:
        await system.stop()
        os.close(fd)


async def test_a_process_after_one_that_fails_to_start_is_never_forked(tmp_path):
    marker = tmp_path / "fail"
    marker.touch()
    reader = spec("second", "reader", "Reader", after="first", path=str(tmp_path / "never"))
    failing = spec("first", "echo", "FailsOnceAtStart", marker=str(marker))
    system = ActorSystem([reader, failing], policy=POLICY)
    with pytest.raises(StartupError) as e:
        await system.start()
    assert e.value.proc == "first" and "second" not in system.state


async def test_no_process_is_forked_once_the_start_has_failed(tmp_path):
    """One process fails at once while another still loads: the system stops, and the one after the loader is not
    forked when the loader comes up during that stop (it would have heard no Shutdown)."""
    gate, marker = tmp_path / "gate", tmp_path / "fail"
    os.mkfifo(gate)
    fd = os.open(gate, os.O_RDWR)
    marker.touch()
    loader = spec("loader", "publisher", "Publisher", gate=str(gate), path=str(tmp_path / "published"))
    third = spec("third", "reader", "Reader", after="loader", path=str(tmp_path / "published"))
    failing = spec("failing", "echo", "FailsOnceAtStart", marker=str(marker))
    recorder = Recorder()
    system = ActorSystem([third, loader, failing], local=[recorder], policy=POLICY)
    starting = asyncio.create_task(system.start())
    try:
        await wait_for(lambda: system._stopping, what="the failed start's stop")
        os.write(fd, b"x")  # the loader comes up now
        with pytest.raises(StartupError):
            await asyncio.wait_for(starting, 30)
        assert "third" not in system.state and system.done.is_set()
    finally:
        os.close(fd)


def test_an_order_that_would_wait_for_ever_is_refused():
    a, b = spec("a", "x", "Echo", after="b"), spec("b", "y", "Echo", after="a")
    with pytest.raises(ValueError, match="process a's start waits on b -> a: a cycle"):
        ActorSystem([a, b])
    with pytest.raises(ValueError, match="process c's start waits on nobody: none such"):
        ActorSystem([spec("c", "z", "Echo", after="nobody")])


def test_the_count_is_published_whole_for_the_users_eyes_only(tmp_path):
    assert kv_sizing.published(str(tmp_path), "worker") is None  # (before the first start)
    with pytest.raises(RuntimeError, match="worker published no KV cache size"):
        kv_sizing.published(str(tmp_path), "worker", expected=True)  # (the scheduler's read)
    kv_sizing.publish(str(tmp_path), "worker", 1234)
    kv_sizing.publish(str(tmp_path), "worker", 4321)  # (replaced whole)
    assert kv_sizing.published(str(tmp_path), "worker") == 4321
    assert stat.S_IMODE(os.stat(tmp_path / "worker.kv-blocks").st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["worker.kv-blocks"]


@pytest.fixture
def cuda(monkeypatch):
    """This process sees a CUDA device (nothing here initializes one)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_the_worker_runs_in_its_own_process_on_cuda_and_inline_on_cpu(cuda):
    assert EngineConfig(model="m").placed().worker == "process"
    assert EngineConfig(model="m", device="cpu").placed().worker == "inline"
    assert EngineConfig(model="m", worker="inline").placed().worker == "inline"
    draft = SpeculativeConfig(method="draft_model", num_speculative_tokens=2, model="d")
    assert EngineConfig(model="m", speculative=draft).placed().worker == "inline"  # (the draft model runs beside it)
    for elsewhere in ({"worker": "process"}, {"tensor_parallel_size": 2}):
        with pytest.raises(ValueError, match="draft-model speculation runs beside the scheduler"):
            EngineConfig(model="m", speculative=draft, **elsewhere)
    assert EngineConfig(model="m", device="cpu", tensor_parallel_size=2).placed().worker == "process"  # (a gang)
    with pytest.raises(ValueError, match="worker must be"):
        EngineConfig(model="m", worker="inline", tensor_parallel_size=2)


def test_the_scheduler_starts_after_a_worker_that_sizes_the_cache(cuda):
    def after(**kwargs) -> dict[str, str | None]:
        config = EngineConfig(model="m", **kwargs)
        return {p.name: p.after for p in replica_processes(config, {})}

    assert after() == {"worker": None, "engine": "worker", "detokenizer": None}
    assert after(device="cpu", worker="process") == {"worker": None, "engine": None, "detokenizer": None}
    assert after(worker="process", num_kv_blocks=64)["engine"] is None  # (a count given: both know it)
    assert after(worker="process", kv_cache_memory_gb=2.0)["engine"] is None
    assert after(worker="inline") == {"engine": None, "detokenizer": None}
    assert after(worker="process", tensor_parallel_size=2)["engine"] is None  # (a gang's ranks take a budget)

"""WorkerActor: the Worker (actors/engine/worker.py) in a process of its own (`EngineConfig.worker = "process"`).

ExecuteSteps run on the one device thread in arrival order; one owned sender task answers each with its
StepResult in the same order, waiting (off the loop on CUDA) for that step's host copy only, so the device
thread launches step N+1 while step N's copy completes. FillMasks go straight to the worker (any thread).
The supervisor restarts the process when it dies; the scheduler then resets the worker's state (a new epoch).
With tensor parallelism this process leads a gang of ranks (actors/engine/gang.py) and the gang dies with it.

Heartbeats: while it holds a step (received, not yet answered) the actor sends the scheduler a StepProgress every
step_timeout_s / 5 (Worker.beat(): the device thread's step and progress counter), so that a slow step is told from
a hung one (messages/step.py). StepHung: the device thread is stuck in a step that cannot be stopped, so the process
exits (code 3) and the supervisor restarts it; ignored by an incarnation that has run no step yet or whose epoch is
newer (a late or repeated ask).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import logging
import os
import threading

import msgspec
import torch

from actors.engine import kv_sizing
from actors.engine.config import EngineConfig
from actors.engine.executor import num_kv_blocks
from actors.engine.gang import Gang
from actors.engine.worker import Launched, Worker
from actors.runtime import Actor
from gpu.loading.config import ModelConfig
from messages.step import ExecuteStep, FillMasks, StepHung
from messages.wire import CheckIdle, IdleReport

log = logging.getLogger("sluice.worker")
HUNG_EXIT = 3  # the exit code of a worker told its step hung


class WorkerActor(Actor):
    def __init__(self, config: dict):
        super().__init__()
        self.config = msgspec.convert(config, EngineConfig)
        self._device = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sluice-device")
        self._launched: asyncio.Queue[asyncio.Future[Launched | None]] = asyncio.Queue()
        self._held = 0  # ExecuteSteps received and not yet answered (or ignored)
        self._busy = asyncio.Event()  # set while _held > 0: heartbeats go out
        self.gang: Gang | None = None  # tensor parallelism: this process leads a gang of ranks
        self._keepalives: asyncio.Task | None = None  # the gang's, once every rank loaded

    def handlers(self):
        return {ExecuteStep: self.on_execute, FillMasks: lambda msg: self.worker.fill(msg), CheckIdle: self.on_check,
                StepHung: self.on_hung}  # fmt: skip

    async def on_check(self, msg: CheckIdle) -> IdleReport:
        """Idle: no request held (the scheduler frees them at its next step, and when it goes idle), once every step
        received has run."""
        await asyncio.get_running_loop().run_in_executor(self._device, lambda: None)
        details = {"requests": len(self.worker.requests)}
        return IdleReport(actor=self.name, idle=not any(details.values()), details=details)

    async def on_start(self) -> None:
        # xgrammar takes seconds to import: not at the first constrained step after a restart (not a daemon: see
        # actors/engine/grammar.py's warm())
        threading.Thread(target=importlib.import_module, args=("xgrammar",), name="sluice-grammar-warm").start()
        torch.set_num_threads(self.config.threads())
        model = ModelConfig.from_path(self.config.model)
        rundir = self.router.placement.rundir
        if (blocks := num_kv_blocks(self.config, model)) is None:  # sized to the device: here, at the first start
            blocks = kv_sizing.published(rundir, self.name)  # (a restart: as the first start published)
        loop = asyncio.get_running_loop()
        if self.config.tensor_parallel_size > 1:  # the leader of a gang (actors/engine/gang.py)
            level = logging.getLevelName(logging.getLogger().level)
            self.gang = Gang(self.config, blocks, level, self.router.placement.rundir)
            self.spawn(self.gang.watch())
            await loop.run_in_executor(self._device, self.gang.join)
        self.worker = await loop.run_in_executor(self._device, Worker, self.config, model, blocks)
        if blocks is None:  # (before Ready: the scheduler's process starts then, and reads it)
            kv_sizing.publish(rundir, self.name, self.worker.executor.runner.num_blocks)
        if self.gang is not None:
            await loop.run_in_executor(self._device, self.gang.loaded)
            log.info("rank 0 of %d (the leader) ready: every rank loaded its shard", self.gang.size)
            self._keepalives = self.spawn(self._keepalive())  # (the followers wait for steps from now on)
        self.on_device = self.worker.executor.device.type != "cpu"
        self.spawn(self._send_results())
        self.spawn(self._heartbeats())

    def on_execute(self, msg: ExecuteStep) -> None:
        self.worker.abandon(msg.epoch)
        self._held += 1
        self._busy.set()
        self._launched.put_nowait(asyncio.get_running_loop().run_in_executor(self._device, self.worker.launch, msg))

    def on_hung(self, msg: StepHung) -> None:
        if 0 <= self.worker.epoch <= msg.epoch:
            log.error("a step of epoch %d hung (no progress): exiting, to be restarted", self.worker.epoch)
            os._exit(HUNG_EXIT)  # (a normal exit would wait for the stuck device thread)

    async def _send_results(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            launched = await (await self._launched.get())
            if launched is not None:  # (None: a stale or duplicated step, not answered)
                result = await loop.run_in_executor(None, launched.result) if self.on_device else launched.result()
                self.tell(self.config.replica.scheduler, result)
            self._held -= 1
            if not self._held:
                self._busy.clear()

    async def _heartbeats(self) -> None:
        """A StepProgress every step_timeout_s / 5 while a step is held."""
        while True:
            await self._busy.wait()
            await asyncio.sleep(self.config.step_timeout_s / 5)
            if self._busy.is_set():
                self.tell(self.config.replica.scheduler, self.worker.beat())

    async def _keepalive(self) -> None:
        """A gang's followers wait for the next step under the group's deadline: while no step is held, a keepalive
        every step_timeout_s / 2."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.config.step_timeout_s / 2)
            if not self._held:
                await loop.run_in_executor(self._device, self.gang.keepalive)

    async def on_shutdown(self, reason: str) -> None:
        if self._keepalives is not None:
            self._keepalives.cancel()
        if self.gang is not None:  # (after the steps already queued on the device thread)
            await asyncio.get_running_loop().run_in_executor(self._device, self.gang.stop)
        self._device.shutdown(wait=False, cancel_futures=True)

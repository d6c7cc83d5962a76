"""WorkerActor: the Worker (actors/engine/worker.py) in a process of its own (`EngineConfig.worker = "process"`).

ExecuteSteps run on the one device thread in arrival order; one owned sender task answers each with its
StepResult in the same order, waiting (off the loop on CUDA) for that step's host copy only, so the device
thread launches step N+1 while step N's copy completes. FillMasks go straight to the worker (any thread).
The supervisor restarts the process when it dies; the scheduler then resets the worker's state (a new epoch).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import threading

import msgspec
import torch

from actors.engine.config import EngineConfig
from actors.engine.executor import num_kv_blocks
from actors.engine.worker import Launched, Worker
from actors.runtime import Actor
from gpu.config import ModelConfig
from messages.names import SCHEDULER
from messages.step import ExecuteStep, FillMasks
from messages.wire import CheckIdle, IdleReport


class WorkerActor(Actor):
    def __init__(self, config: dict):
        super().__init__()
        self.config = msgspec.convert(config, EngineConfig)
        self._device = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sluice-device")
        self._launched: asyncio.Queue[asyncio.Future[Launched | None]] = asyncio.Queue()

    def handlers(self):
        return {ExecuteStep: self.on_execute, FillMasks: lambda msg: self.worker.fill(msg), CheckIdle: self.on_check}

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
        blocks = num_kv_blocks(self.config, model)
        loop = asyncio.get_running_loop()
        self.worker = await loop.run_in_executor(self._device, Worker, self.config, model, blocks)
        self.on_device = self.worker.executor.device.type != "cpu"
        self.spawn(self._send_results())

    def on_execute(self, msg: ExecuteStep) -> None:
        self.worker.abandon(msg.epoch)
        self._launched.put_nowait(asyncio.get_running_loop().run_in_executor(self._device, self.worker.launch, msg))

    async def _send_results(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            launched = await (await self._launched.get())
            if launched is None:
                continue  # a stale or duplicated step: not answered
            result = await loop.run_in_executor(None, launched.result) if self.on_device else launched.result()
            self.tell(SCHEDULER, result)

    async def on_shutdown(self, reason: str) -> None:
        self._device.shutdown(wait=False, cancel_futures=True)

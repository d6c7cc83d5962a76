"""The scheduler actor's handlers of adapters named while serving (messages/lora.py): a RegisterLora is registered
at once (a copy of a request resumed right behind it finds it), then its files are hashed and checked against the
engine's model off the event loop (gpu/loading/lora.py read_adapter, on the model built on meta: no weight read);
one that cannot be served is unregistered again and the answer says why. An UnregisterLora retires the adapter
(actors/engine/lora_table.py): new requests naming it are refused, the running ones end first."""

from __future__ import annotations

import asyncio
import logging

import torch

from gpu.loading.lora import LoraError, adapter_digest, read_adapter
from gpu.models import REGISTRY
from messages.lora import LoraRegistered, RegisterLora, UnregisterLora

log = logging.getLogger("sluice.engine")


class LoraRegistry:
    _meta_model = None

    async def on_register_lora(self, msg: RegisterLora) -> LoraRegistered:
        if msg.digest:  # (a registration again: at once)
            self.sched.loras.register(msg.digest, msg.path)
        loop = asyncio.get_running_loop()
        try:
            digest = await loop.run_in_executor(None, adapter_digest, msg.path)
        except LoraError as e:
            return LoraRegistered(error=str(e))
        known = digest in self.sched.loras.paths
        self.sched.loras.register(digest, msg.path)
        try:
            await loop.run_in_executor(None, self._check_adapter, msg.path)
        except LoraError as e:
            if not known:
                self.sched.loras.unregister(digest)
            return LoraRegistered(digest=digest, error=str(e))
        log.info("LoRA adapter %s registered (%s)", digest, msg.path)
        return LoraRegistered(digest=digest)

    def on_unregister_lora(self, msg: UnregisterLora) -> None:
        self.sched.loras.unregister(msg.digest)
        log.info("LoRA adapter %s unregistered: its slot is freed once no request names it", msg.digest)

    def _check_adapter(self, path: str) -> None:
        if self._meta_model is None:
            with torch.device("meta"):
                self._meta_model = REGISTRY[self.model.architecture](self.model)
        read_adapter(path, self._meta_model, self.config.lora.max_lora_rank)

"""The scheduler actor's handlers of adapters named while serving (messages/lora.py): a RegisterLora that names its
digest is registered at once (a copy of a request resumed right behind it finds it); its files are hashed and
checked against the engine's model in a task of its own, off the event loop (gpu/loading/lora.py read_adapter, on the model built on meta: no weight read);
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

    def on_register_lora(self, msg: RegisterLora) -> None:
        if msg.digest:  # (a registration again: at once)
            self.sched.loras.register(msg.digest, msg.path)
        self.spawn(self._answer_register(msg))  # (the check reads files: not in the inbox's way)

    async def _answer_register(self, msg: RegisterLora) -> None:
        try:
            answer = await self._check_registration(msg)
        except Exception as e:  # (a bug here fails the registration, never the actor's task group)
            log.exception("registering LoRA adapter %s failed", msg.path)
            answer = LoraRegistered(error=f"{type(e).__name__}: {e}")
        answer.corr_id = msg.corr_id
        self.tell(msg.reply_to, answer)

    async def _check_registration(self, msg: RegisterLora) -> LoraRegistered:
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
        try:
            read_adapter(path, self._meta_model, self.config.lora.max_lora_rank)
        except LoraError:
            raise
        except Exception as e:  # (anything else an adapter's files can raise: named, never the actor's)
            raise LoraError(f"LoRA adapter {path}: {type(e).__name__}: {e}") from e

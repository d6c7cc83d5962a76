"""The scheduler actor's handlers of adapters named while serving (messages/lora.py): a RegisterLora that names its
digest is registered at once (a copy of a request resumed right behind it finds it); its files are read, hashed and
checked against the engine's model in a task of its own, off the event loop (gpu/loading/lora.py check_adapter, on
the model built on meta: no base weight read). One that passes is registered, and a load's (no digest named) is
wanted at once where --max-cpu-loras leave a slot free (the worker begins reading it with the next step; nothing
held is evicted for it: a waiting request may need it); one that cannot be served is not registered and the answer
says why (the HTTP actor unregisters what other replicas registered). An UnregisterLora retires the adapter
(actors/engine/lora_table.py): new requests naming it are refused, the running ones end first."""

from __future__ import annotations

import asyncio
import logging

import torch

from gpu.loading.lora import LoraError, check_adapter, lora_tables
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
        try:
            digest = await asyncio.get_running_loop().run_in_executor(None, self._check_adapter, msg.path)
        except LoraError as e:  # (nothing registered, but a digest named: the worker's read will say so too)
            return LoraRegistered(digest=msg.digest, error=str(e))
        if msg.digest and digest != msg.digest:
            return LoraRegistered(digest=msg.digest, error=f"LoRA adapter {msg.path} changed since it was named")
        loras = self.sched.loras
        loras.register(digest, msg.path)
        if not msg.digest and len(loras.wanted) < loras.capacity:  # (a load's, into a free slot: its read begins)
            loras.ready(digest, set())
        log.info("LoRA adapter %s registered (%s)", digest, msg.path)
        return LoraRegistered(digest=digest)

    def on_unregister_lora(self, msg: UnregisterLora) -> None:
        self.sched.loras.unregister(msg.digest)
        log.info("LoRA adapter %s unregistered: its slot is freed once no request names it", msg.digest)

    def meta_model(self) -> torch.nn.Module:
        """The engine's model built on meta (its layers' shapes, no weight), once: the scheduler's on_start builds it
        where LoRA is on, so that a first load's check does not hold the GIL the step loop needs for as long."""
        if self._meta_model is None:
            with torch.device("meta"):
                self._meta_model = REGISTRY[self.model.architecture](self.model)
        return self._meta_model

    def _check_adapter(self, path: str) -> str:
        """Its digest, once read and checked (within the range of the tables' format)."""
        try:
            lora = self.config.lora  # (its lora_dtype named by the launch: frontend/preflight.py checked_loras)
            return check_adapter(
                path, self.meta_model(), lora.max_lora_rank, lora_tables(lora.lora_dtype, torch.float32)
            )
        except LoraError:
            raise
        except Exception as e:  # (anything else an adapter's files can raise: named, never the actor's)
            raise LoraError(f"LoRA adapter {path}: {type(e).__name__}: {e}") from e

"""LoRA adapters named while serving (issue 51): the HTTP actor -> every engine replica's scheduler (frontend/lora_api.py,
actors/engine/lora_registry.py)."""

from __future__ import annotations

from messages.wire import Msg, Query, Reply


class RegisterLora(Query, kw_only=True):
    """HTTP -> scheduler: serve the PEFT adapter in `path` (checked against the engine's model; requests name it by the
    digest of its files, which the answer gives). Idempotent."""

    path: str
    digest: str = ""  # its files' digest where the sender knows it (a scheduler back from a restart): registered at
    # once, before the copies of requests that name it (their AddRequests follow on the same link)


class LoraRegistered(Reply, kw_only=True):
    digest: str = ""  # its files' (gpu/loading/lora.py adapter_digest)
    error: str | None = None  # why it cannot be served (nothing is registered then)


class UnregisterLora(Msg, kw_only=True):
    """HTTP -> scheduler: no new request names the adapter; the running ones end first, then its slot is freed."""

    digest: str


LORA_TYPES: tuple[type[Msg], ...] = (RegisterLora, LoraRegistered, UnregisterLora)

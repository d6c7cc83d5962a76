"""The model runner's LoRA adapters (a mixin of gpu/runner/model_runner.py's ModelRunner): read from a PEFT directory
on any thread (`read_adapter`: its files' digest checked, its tensors checked against the model, laid out as its slot's tables), then put in a free
slot of the model's tables between steps (`install_adapter`: gpu/layers/lora.py), the native layer loop rebuilt where
a layer got its first tables (the loop holds them)."""

from __future__ import annotations

import logging

import torch
from tqdm import tqdm

from gpu.distributed.group import current
from gpu.kernels import native
from gpu.loading.lora import LoraError, read_adapter
from gpu.runner.native_loop import native_loop

log = logging.getLogger("sluice.worker")


def lora_kernels(native_weights: bool, runner):
    """The LoRA kernels a runner's layers call (gpu/layers/lora.py): the native CPU pair for float32 activations on
    the native kernels, the Triton pair on CUDA, else None (torch's matmuls)."""
    if native_weights and runner.dtype == torch.float32:
        return native.ops()
    if runner.device.type == "cuda":
        from gpu.kernels.triton import lora  # (triton imported where it runs)

        return lora
    return None


class RunnerAdapters:
    def add_adapters(self, adapters: dict[str, str]) -> None:
        """Hold the adapters a runner starts with (digest -> directory). One that cannot be served (its files changed
        since the launch checked them) is logged and left out: the worker's read of it reports it at the first step
        that wants it (actors/engine/worker_loras.py), and its requests fail alone. A gang's rank raises instead: its
        ranks must hold the same adapters (a follower loads none later)."""
        for digest, path in tqdm(
            adapters.items(), desc="Loading LoRA adapters", unit="adapter", disable=len(adapters) < 8
        ):
            try:
                self.add_adapter(digest, path)
            except LoraError as e:
                if current().size > 1:
                    raise
                log.error("LoRA adapter %s not held at start: %s", digest, e)

    def add_adapter(self, digest: str, path: str) -> None:
        """Hold the LoRA adapter at `path` (a PEFT directory, whose files hash to `digest`) in a free slot: LoraError
        if it cannot be served (gpu/loading/lora.py)."""
        self.install_adapter(digest, self.read_adapter(digest, path))

    def read_adapter(self, digest: str, path: str) -> dict:
        """The adapter's slot images, read and checked against the model (any thread)."""
        return read_adapter(path, self.model, self.lora.rank, self.lora.dtype, digest)[1]

    def install_adapter(self, digest: str, images: dict) -> None:
        """Put read slot images in a free slot (between steps)."""
        made = self.lora.install(self.model, digest, images)
        if made and (loop := self.model.model.native_loop) is not None:
            self.model.model.native_loop = native_loop(self.model, self.attention, self.lora, loop)

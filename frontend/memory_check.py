"""The engine's memory on this host, before any process starts: a model that cannot fit is refused (the kernel's OOM
killer would SIGKILL the engine while it loads: "process engine was killed by SIGKILL during startup"), and an engine
killed so while it starts or restarts is explained with the same figures and what to try (`explanation`, which
frontend/launch.py's `explain` adds: the supervisor's hook, set by `sluice serve`, a replica's headless node and
`sluice generate`).

On CPU this node's engine processes hold the weights as served (gpu/runner/memory.py `served_weight_bytes`, a floor) and
the KV cache (--kv-cache-memory-gb, default 1 GiB, or --num-kv-blocks blocks: actors/engine/executor.py), for each local
replica, and under tensor parallelism this node's ranks' shares. That is refused when it is more than the kernel's
MemAvailable (/proc/meminfo), unless --skip-memory-check. On CUDA the weights and the cache live on the device (sized by
--gpu-memory-utilization there): nothing is refused, an engine killed while it starts is still explained.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.engine.config import EngineConfig, device_type
from actors.engine.executor import draft_configs, num_kv_blocks
from gpu.attention.kv_cache import bytes_per_block
from gpu.distributed.group import TensorParallel
from gpu.layers.parallel import local_config
from gpu.loading.config import ModelConfig, ModelLoadError
from gpu.runner.memory import served_weight_bytes
from gpu.runner.model_runner import native_cpu_weights, resolve_dtypes

GIB = 1 << 30
# what else to try, and how the weights are then served (the KV cache as it is)
OPTIONS = [("--quantization q4_k", "float32", "q4_k"), ("--quantization q8_0", "float32", "q8_0"),
           ("--dtype bfloat16", "bfloat16", None)]  # fmt: skip


def mem_available() -> int | None:
    """The kernel's estimate of the memory available to a new process, in bytes (None: not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
    except OSError:
        return None
    kb = fields.get("MemAvailable", "").split()
    return int(kb[0]) * 1024 if kb else None


@dataclass(frozen=True)
class MemoryNeed:
    model: ModelConfig
    engine: EngineConfig
    device: str  # where the weights and the KV cache live: cpu, or cuda
    weights: int  # bytes, every engine process of this node's together (a floor)
    kv_cache: int | None  # ... (None: on CUDA, what --gpu-memory-utilization leaves)
    available: int | None  # MemAvailable when the server started (None: unknown)

    @property
    def total(self) -> int:
        return self.weights + (self.kv_cache or 0)

    def figures(self) -> str:
        e = self.engine
        served = str(served_dtypes(self.model, e, e.dtype)[1]).removeprefix("torch.")
        served += f", --quantization {e.quantization}" if e.quantization else ""
        cache = "sized to the device" if self.kv_cache is None else f"{self.kv_cache / GIB:.1f} GiB"
        where = "host memory" if self.device == "cpu" else f"{self.device} device memory"
        avail = "unknown" if self.available is None else f"{self.available / GIB:.1f} GiB"
        return (f"its weights take at least {self.weights / GIB:.1f} GiB of {where} ({served}), its KV cache {cache}; "
                f"this host has {avail} available (MemAvailable in /proc/meminfo)")  # fmt: skip

    def explanation(self) -> str:
        """The figures and what to try (frontend/launch.py's `explain` of an engine killed as it starts)."""
        return f"{self.figures()}; {self.advice()}"

    def advice(self) -> str:
        if self.device != "cpu":
            return "try a smaller --max-model-len or --gpu-memory-utilization, or free the host's memory"
        e = self.engine
        blocks = native_cpu_weights(torch.device("cpu"), e.cpu_kernels, load=False)  # (--quantization needs them)
        held = {flag: weights(self.model, e, dtype, q) for flag, dtype, q in OPTIONS if blocks or q is None}
        options = [f"{flag} ({n / GIB:.1f} GiB of weights)" for flag, n in held.items() if n < self.weights]
        return f"try {', '.join([*options, 'a smaller --kv-cache-memory-gb / --num-kv-blocks'])}"


def served_dtypes(model: ModelConfig, engine: EngineConfig, dtype: str):
    """(activations, weights) as the engine's runner resolves them (gpu/runner/model_runner.py)."""
    device = torch.device(device_type(engine.device))
    return resolve_dtypes(dtype, device, model.dtype, native_cpu_weights(device, engine.cpu_kernels, load=False))


def weights(model: ModelConfig, engine: EngineConfig, dtype: str, quantization: str | None) -> int:
    """This node's engine processes' weights, as `dtype` and `quantization` serve them (the draft model's too)."""
    device = device_type(engine.device)

    def one(m: ModelConfig) -> int:
        activations, held = served_dtypes(m, engine, dtype)
        return served_weight_bytes(m, activations, quantization, device, held)

    total = sum(map(one, (model, *draft_configs(engine))))
    return total * engine.local_replicas // engine.nnodes  # (a gang across nodes: this node's ranks' shares)


def memory_need(model: ModelConfig, engine: EngineConfig) -> MemoryNeed:
    device, kv = device_type(engine.device), None
    if device == "cpu":  # (the KV cache's blocks: num_kv_blocks', of a rank's heads under tensor parallelism)
        dtype, tp = served_dtypes(model, engine, engine.dtype)[0], engine.tensor_parallel_size
        rank = local_config(model, TensorParallel(0, tp))
        per_block = sum(bytes_per_block(m, engine.block_size, dtype) for m in (rank, *draft_configs(engine)))
        kv = num_kv_blocks(engine, model) * per_block * tp // engine.nnodes * engine.local_replicas
    return MemoryNeed(model, engine, device, weights(model, engine, engine.dtype, engine.quantization), kv,
                      mem_available())  # fmt: skip


def check_memory(model: ModelConfig, engine: EngineConfig) -> MemoryNeed:
    """The need of `engine` serving `model` on this node; ModelLoadError if it cannot fit in MemAvailable."""
    need = memory_need(model, engine)
    if need.device == "cpu" and need.available is not None and need.total > need.available:
        raise ModelLoadError(
            f"{model.name} cannot fit in this host's memory: {need.figures()}; {need.advice()}; or "
            "--skip-memory-check to try anyway"
        )
    return need

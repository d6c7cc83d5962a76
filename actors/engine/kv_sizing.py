"""Who sizes the KV cache, and how a count the worker chose reaches its scheduler.

A count is fixed before either side starts (executor.num_kv_blocks: `num_kv_blocks`, or `kv_cache_memory_gb`, or
1 GiB) except on CUDA with one rank and neither given (`sized_on_device`): the worker then profiles its device as it
loads (`gpu_memory_utilization`, gpu/runner/memory.py). Inline, the scheduler reads the runner's count. A worker in
a process of its own writes it to `<rundir>/<worker>.kv-blocks` (0600, whole by a rename) before it is Ready, and
its scheduler's process is started only once it is (actors/graph.py: ProcessSpec.after): the scheduler reads it in
on_start. A restarted worker or scheduler reads the same file, so the two agree for the system's life (a worker
that can no longer allocate that many blocks fails its start, and is restarted as any failed start is).
"""

from __future__ import annotations

import os
from pathlib import Path

from actors.engine.config import EngineConfig, device_type


def sized_on_device(config: EngineConfig) -> bool:
    """Whether the worker sizes its KV cache to its device (no count or budget given; CUDA; one rank: a gang's
    ranks take the leader's budget)."""
    given = config.num_kv_blocks or config.kv_cache_memory_gb is not None
    return not given and config.tensor_parallel_size == 1 and device_type(config.device) == "cuda"


def _path(rundir: str, worker: str) -> Path:
    return Path(rundir) / f"{worker}.kv-blocks"


def publish(rundir: str, worker: str, blocks: int) -> None:
    """The worker's count, for its scheduler and its own restarts."""
    path = _path(rundir, worker)
    part = path.with_suffix(".part")
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(str(blocks))
    os.replace(part, path)


def published(rundir: str, worker: str, expected: bool = False) -> int | None:
    """The count a worker of this system published; None before its first start (a RuntimeError if `expected`)."""
    try:
        return int(_path(rundir, worker).read_text())
    except FileNotFoundError:
        if expected:
            raise RuntimeError(
                f"{worker} published no KV cache size (its process is started first: graph.py)"
            ) from None
        return None

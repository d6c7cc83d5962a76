"""The engine side of the actor graph: which actors run in which process, for each engine replica."""

from __future__ import annotations

import msgspec

from actors.engine.config import EngineConfig
from actors.engine.kv_sizing import sized_on_device
from actors.runtime import ActorSpec, ProcessSpec


def engine_processes(config: EngineConfig, client: str, devices: list[str] | None = None) -> list[ProcessSpec]:
    """Every local replica's (config.local_replicas): its engine process (the scheduler, and the worker: model runner
    + sampler, unless it has a process of its own: `config.worker`) and its detokenizer process, named after the
    replica (messages/names.py). `devices`: each replica's CUDA_VISIBLE_DEVICES (None: they share the node's).

    `client` is the actor that receives TextOutputs / Finished / stats (the HTTP actor, or the
    offline API's client actor)."""
    return [
        p
        for k in range(config.local_replicas)
        for p in replica_processes(
            msgspec.structs.replace(config, stats_to=[client], data_parallel_rank=k),
            client,
            {"CUDA_VISIBLE_DEVICES": devices[k]} if devices else {},
        )
    ]


def replica_processes(config: EngineConfig, client: str, env: dict[str, str]) -> list[ProcessSpec]:
    config = config.placed()
    names, engine = config.replica, msgspec.to_builtins(config)

    def process(name: str, actor: str, factory: str, kwargs: dict) -> ProcessSpec:
        return ProcessSpec(name=name, actors=[ActorSpec(name=actor, factory=factory, kwargs=kwargs)], env=env)

    worker = process(names.worker, names.worker, "actors.engine.worker_actor:WorkerActor", {"config": engine})
    detokenizer = {
        "model": config.model,
        "client": client,
        "abort_timeout_s": config.abort_timeout_s,
        "max_abort_tries": config.max_abort_tries,
        "stats_interval_s": config.stats_interval_s,
        "replica": config.data_parallel_rank,
    }
    scheduler = process(
        names.engine, names.scheduler, "actors.engine.scheduler_actor:SchedulerActor", {"config": engine}
    )
    if config.worker == "process" and sized_on_device(config):  # (it reads the count the worker publishes)
        scheduler.after = names.worker
    return [worker] * (config.worker == "process") + [
        scheduler,
        process(names.detokenizer, names.detokenizer, "actors.detokenizer.actor:DetokenizerActor", detokenizer),
    ]

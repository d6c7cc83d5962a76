"""The engine side of the actor graph: which actors run in which process, for each engine replica."""

from __future__ import annotations

import msgspec

from actors.engine.config import EngineConfig
from actors.engine.kv_sizing import sized_on_device
from actors.runtime import ActorSpec, ProcessSpec


def engine_processes(config: EngineConfig, clients: list[str], devices: list[str] | None = None) -> list[ProcessSpec]:
    """Every local replica's (config.local_replicas): its engine process (the scheduler, and the worker: model runner
    + sampler, unless it has a process of its own: `config.worker`) and its detokenizer process, named after the
    replica (messages/names.py). `devices`: each replica's CUDA_VISIBLE_DEVICES (None: they share the node's).

    `clients` are the actors that receive stats (the HTTP servers, or the offline API's client actor); a request's
    TextOutputs and Finished go to the client its AddRequest names."""
    return [
        p
        for k in range(config.local_replicas)
        for p in replica_processes(
            msgspec.structs.replace(config, stats_to=list(clients), data_parallel_rank=k),
            {"CUDA_VISIBLE_DEVICES": devices[k]} if devices else {},
        )
    ]


def replica_processes(config: EngineConfig, env: dict[str, str]) -> list[ProcessSpec]:
    """A replica's processes; its scheduler and detokenizer report their stats to `config.stats_to`."""
    config = config.placed()
    names, engine = config.replica, msgspec.to_builtins(config)

    def process(name: str, actor: str, factory: str, kwargs: dict) -> ProcessSpec:
        return ProcessSpec(name=name, actors=[ActorSpec(name=actor, factory=factory, kwargs=kwargs)], env=env)

    worker = process(names.worker, names.worker, "actors.engine.worker_actor:WorkerActor", {"config": engine})
    detokenizer = {
        "model": config.model,
        "stats_to": config.stats_to,
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

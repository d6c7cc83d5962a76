"""The engine side of the actor graph: which actors run in which process."""

from __future__ import annotations

import msgspec

from actors.engine.config import EngineConfig
from actors.runtime import ActorSpec, ProcessSpec
from messages.names import DETOKENIZER, SCHEDULER, WORKER


def engine_processes(config: EngineConfig, client: str) -> list[ProcessSpec]:
    """The engine process (the scheduler, and the worker: model runner + sampler, unless it has a process of its
    own: `config.worker`) and the detokenizer process.

    `client` is the actor that receives TextOutputs / Finished / stats (the HTTP actor, or the
    offline API's client actor)."""
    config = msgspec.structs.replace(config, stats_to=[client])
    worker = [
        ProcessSpec(
            name=WORKER,
            actors=[
                ActorSpec(
                    name=WORKER,
                    factory="actors.engine.worker_actor:WorkerActor",
                    kwargs={"config": msgspec.to_builtins(config)},
                )
            ],
        )
    ]
    return worker * (config.worker == "process") + [
        ProcessSpec(
            name="engine",
            actors=[
                ActorSpec(
                    name=SCHEDULER,
                    factory="actors.engine.scheduler_actor:SchedulerActor",
                    kwargs={"config": msgspec.to_builtins(config)},
                )
            ],
        ),
        ProcessSpec(
            name="detokenizer",
            actors=[
                ActorSpec(
                    name=DETOKENIZER,
                    factory="actors.detokenizer.actor:DetokenizerActor",
                    kwargs={
                        "model": config.model,
                        "client": client,
                        "abort_timeout_s": config.abort_timeout_s,
                        "max_abort_tries": config.max_abort_tries,
                        "stats_interval_s": config.stats_interval_s,
                    },
                )
            ],
        ),
    ]

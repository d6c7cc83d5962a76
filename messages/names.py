"""The actors' names (their mailbox addresses), declared once. Messages name actors by these (ActorDown.actor,
AddRequest.client, ...); a process may host several (actors/graph.py, frontend/launch.py).

An engine replica (--data-parallel-size) is a scheduler, its worker and its detokenizer: replica 0's keep the bare
names, replica k's carry ".k" (`replica(k)`), so one replica is today's whole engine side."""

from __future__ import annotations

import functools
from typing import NamedTuple

SUPERVISOR = "supervisor"  # the launcher's: spawns, heartbeats, restarts
SCHEDULER = "scheduler"  # the engine process's
WORKER = "worker"  # the model runner and sampler, when the worker has a process of its own (EngineConfig.worker)
DETOKENIZER = "detokenizer"
HTTP = "http"  # the OpenAI server (a client of the engine); the servers of --api-server-count: `http_servers`
CLIENT = "client"  # the offline API's client (frontend/offline.py), in the launcher process
ENGINE = "engine"  # the scheduler's process (a process is named after what it runs)


class Replica(NamedTuple):
    """The names of one engine replica's actors, and of the processes that run them."""

    index: int
    scheduler: str
    worker: str
    detokenizer: str
    engine: str  # the scheduler's process

    @property
    def request_path(self) -> tuple[str, str]:
        """The actors that hold its requests: the death of either forgets every one of them (DESIGN I8)."""
        return self.scheduler, self.detokenizer

    @property
    def actors(self) -> tuple[str, str, str]:
        return self.scheduler, self.worker, self.detokenizer


@functools.cache
def replica(k: int) -> Replica:
    suffix = f".{k}" if k else ""
    return Replica(k, SCHEDULER + suffix, WORKER + suffix, DETOKENIZER + suffix, ENGINE + suffix)


def replica_of(actor: str) -> int | None:
    """The replica an engine-side actor (or process) belongs to; None for any other name."""
    base, dot, k = actor.partition(".")
    if base not in (SCHEDULER, WORKER, DETOKENIZER, ENGINE):
        return None
    if not dot:
        return 0
    return int(k) if k.isascii() and k.isdecimal() and k == str(int(k)) != "0" else None  # (as `replica` names it)


def http_servers(n: int) -> list[str]:
    """The actors (and processes) of the n HTTP servers (--api-server-count): server 0 keeps the bare name, server k
    carries ".k"."""
    return [f"{HTTP}.{k}" if k else HTTP for k in range(n)]

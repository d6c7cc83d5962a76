"""The actors' names (their mailbox addresses), declared once. Messages name actors by these (ActorDown.actor,
AddRequest.client, ...); a process may host several (actors/graph.py, frontend/launch.py)."""

from __future__ import annotations

from typing import Literal

SUPERVISOR = "supervisor"  # the launcher's: spawns, heartbeats, restarts
SCHEDULER = "scheduler"  # the engine process's
WORKER = "worker"  # the model runner and sampler, when the worker has a process of its own (EngineConfig.worker)
DETOKENIZER = "detokenizer"
HTTP = "http"  # the OpenAI server (a client of the engine)
CLIENT = "client"  # the offline API's client (frontend/offline.py), in the launcher process

REQUEST_PATH = (SCHEDULER, DETOKENIZER)  # the actors that hold requests: the death of either forgets every one (I8)

ActorName = Literal["supervisor", "scheduler", "worker", "detokenizer", "http", "client"]

"""Actors, mailboxes, processes, supervision and fault injection."""

from actors.runtime.actor import Actor, AskTimeout, FatalError
from actors.runtime.faults import FaultPlan, FaultRule
from actors.runtime.process import ActorSpec, ProcessSpec, call_forked
from actors.runtime.system import ActorSystem, RestartPolicy, StartupError

__all__ = [
    "Actor",
    "ActorSpec",
    "ActorSystem",
    "AskTimeout",
    "FatalError",
    "FaultPlan",
    "FaultRule",
    "ProcessSpec",
    "RestartPolicy",
    "StartupError",
    "call_forked",
]

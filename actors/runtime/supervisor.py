"""The launcher's Supervisor actor: what actors/runtime/system.py's ActorSystem hears and asks of its children. It
records each actor's Ready from its process's current incarnation (the system's `_spawn` waits on them) and pings
every actor of a process that is up each `heartbeat_s`; an actor that misses `max_missed` answers in a row is hung:
its process is SIGKILLed (then restarted as any death is)."""

from __future__ import annotations

import asyncio
import collections
import logging
import multiprocessing
from typing import Protocol

from actors.runtime.actor import Actor, AskTimeout
from actors.runtime.backoff import RestartPolicy
from actors.runtime.router import Placement
from messages.names import SUPERVISOR
from messages.wire import Ping, Ready

log = logging.getLogger("sluice.supervisor")


class Supervised(Protocol):
    """What the supervisor reads of its system (actors/runtime/system.py's ActorSystem, which imports this module)."""

    placement: Placement
    children: dict[str, multiprocessing.process.BaseProcess]  # process -> its current child
    state: dict[str, str]  # process -> starting | up | down | stopped
    policy: RestartPolicy

    def kill(self, proc: str) -> None: ...


class Supervisor(Actor):
    name = SUPERVISOR

    def __init__(self, system: Supervised):
        super().__init__()
        self.system = system
        self.ready: dict[str, asyncio.Event] = collections.defaultdict(asyncio.Event)

    def handlers(self):
        return {Ready: self.on_ready}

    def on_ready(self, msg: Ready) -> None:
        """Counted only from the current incarnation of the actor's process (a late Ready of one killed for missing
        its deadline, still in flight, is not the next one's)."""
        procs = self.system.placement.processes
        child = next((self.system.children.get(p) for p, actors in procs.items() if msg.actor in actors), None)
        if child is None or child.pid != msg.pid:
            log.warning("a Ready of %s from pid %d, not its process's current one: ignored", msg.actor, msg.pid)
            return
        log.info("%s ready (pid %d)", msg.actor, msg.pid)
        self.ready[msg.actor].set()

    async def all_ready(self, actors: list[str]) -> None:
        for actor in actors:
            await self.ready[actor].wait()

    async def heartbeat(self, proc: str, actor: str) -> None:
        policy, missed = self.system.policy, 0
        while True:
            await asyncio.sleep(policy.heartbeat_s)
            if self.system.state.get(proc) != "up":
                missed = 0
                continue
            try:
                await self.ask(actor, Ping(), timeout=policy.heartbeat_timeout_s)
                missed = 0
            except AskTimeout:
                missed += 1
                log.warning("%s missed heartbeat %d/%d", actor, missed, policy.max_missed)
                if missed >= policy.max_missed and self.system.state.get(proc) == "up":
                    log.error("%s is hung: killing process %s", actor, proc)
                    self.system.kill(proc)
                    missed = 0

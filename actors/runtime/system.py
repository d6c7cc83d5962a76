"""The launcher: spawns actor processes from a placement, supervises them, tears them down.

Supervision (Erlang-style, one_for_one): a child is dead when its process sentinel fires, hung when it misses
`max_missed` heartbeats (it is then SIGKILLed). On a death the supervisor broadcasts ActorDown for each of its actors,
restarts the process unless `max_restarts` restarts of its group (an engine replica's processes, or the process
alone) already happened within `window_s`, and broadcasts ActorUp once the new incarnation is Ready. A group past that
intensity stops the whole system (exit code 1), unless it is an engine replica and another replica of this node
serves: then the whole replica is parked (its other processes killed too, so its requests go on elsewhere) for
`park_s`, and restarted with a fresh budget. Those broadcasts skip processes that are (re)starting: a restarted
incarnation is told, once Ready, which actors are down at that moment.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import multiprocessing
import os
import signal
import time

import msgspec

from actors.runtime.actor import Actor, AskTimeout
from actors.runtime.faults import FaultPlan
from actors.runtime.mailbox import LINGER_MS
from actors.runtime.process import ChildConfig, ProcessSpec, child_main
from actors.runtime.router import Placement, Router, make_rundir, remove_rundir
from messages.names import SUPERVISOR, replica_of
from messages.wire import ActorDown, ActorUp, Ping, Ready, Shutdown

log = logging.getLogger("sluice.supervisor")

LAUNCHER = "launcher"


class StartupError(RuntimeError):
    pass


class RestartPolicy(msgspec.Struct, kw_only=True):
    max_restarts: int = 3
    window_s: float = 60.0
    heartbeat_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    max_missed: int = 3
    ready_timeout_s: float = 180.0
    stop_timeout_s: float = 10.0
    park_s: float = 30.0  # an engine replica past the restart intensity sits out this long (another one serving)


class Supervisor(Actor):
    name = SUPERVISOR

    def __init__(self, system: ActorSystem):
        super().__init__()
        self.system = system
        self.ready: dict[str, asyncio.Event] = collections.defaultdict(asyncio.Event)

    def handlers(self):
        return {Ready: self.on_ready}

    def on_ready(self, msg: Ready) -> None:
        log.info("%s ready (pid %d)", msg.actor, msg.pid)
        self.ready[msg.actor].set()

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


class ActorSystem:
    """`async with ActorSystem(processes, local=[...]) as system:` runs the graph."""

    def __init__(
        self,
        processes: list[ProcessSpec],
        local: list[Actor] = (),
        fault_plan: FaultPlan | None = None,
        policy: RestartPolicy | None = None,
        log_level: str = "INFO",
        endpoints: dict[str, str] | None = None,
    ):
        self.specs = {p.name: p for p in processes}
        self.policy = policy or RestartPolicy()
        self.fault_plan = fault_plan
        self.log_level = log_level
        self.rundir = make_rundir()
        self.supervisor = Supervisor(self)
        self.local = [self.supervisor, *local]
        layout = {name: [a.name for a in spec.actors] for name, spec in self.specs.items()}
        layout[LAUNCHER] = [a.name for a in self.local]
        self.placement = Placement(rundir=self.rundir, processes=layout, endpoints=endpoints or {})
        self.router = Router(self.placement, LAUNCHER, fault_plan)
        self.children: dict[str, multiprocessing.process.BaseProcess] = {}
        self.state: dict[str, str] = {}  # process -> starting | up | down | stopped
        self.exited: dict[str, asyncio.Event] = {}  # process -> set as its current child exits
        self.restarts: dict[object, collections.deque[float]] = collections.defaultdict(collections.deque)  # by group
        self.parked: dict[object, asyncio.Event] = {}  # engine replicas out of rotation -> set as they come back
        self.exit_code = 0
        self.done = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    async def __aenter__(self) -> ActorSystem:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def start(self) -> None:
        for actor in self.local:
            self._tasks.append(asyncio.create_task(actor.run(self.router), name=f"{actor.name}:run"))
        await asyncio.sleep(0)
        try:
            await asyncio.gather(*(self._spawn(name) for name in self.specs))
        except BaseException:
            await self.stop()
            raise
        for proc, spec in self.specs.items():
            for a in spec.actors:
                self._tasks.append(asyncio.create_task(self.supervisor.heartbeat(proc, a.name)))

    async def _spawn(self, proc: str, restart: bool = False) -> None:
        spec = self.specs[proc]
        for a in spec.actors:
            self.supervisor.ready[a.name].clear()
        config = ChildConfig(process=spec, placement=self.placement, fault_plan=self.fault_plan, parent_pid=os.getpid(),
                             log_level=self.log_level)  # fmt: skip
        child = multiprocessing.get_context("spawn").Process(
            target=child_main, args=(msgspec.json.encode(config),), name=f"sluice:{proc}", daemon=True
        )
        self.state[proc] = "starting"
        exited = self.exited[proc] = asyncio.Event()
        child.start()
        self.children[proc] = child
        asyncio.get_running_loop().add_reader(child.sentinel, self._on_exit, proc, child, exited)
        ready = asyncio.ensure_future(_all_set([self.supervisor.ready[a.name] for a in spec.actors]))
        died = asyncio.ensure_future(exited.wait())
        try:  # every actor Ready, or the child gone, or the deadline
            await asyncio.wait([ready, died], timeout=self.policy.ready_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            died.cancel()
        if exited.is_set():
            raise StartupError(f"process {proc} exited with code {child.exitcode} during startup")
        if not all(self.supervisor.ready[a.name].is_set() for a in spec.actors):
            raise StartupError(f"process {proc} not ready within {self.policy.ready_timeout_s}s")
        self.state[proc] = "up"
        if restart:  # it heard nothing while it started: which actors are down now (their ActorUp follows)
            down = [a.name for p, other in self.specs.items() if self.state.get(p) != "up" for a in other.actors]
            for actor, gone in itertools.product(spec.actors, down):
                self.router.send(SUPERVISOR, actor.name, ActorDown(actor=gone, reason="down as this one started"))

    def _on_exit(self, proc: str, child, exited: asyncio.Event) -> None:
        asyncio.get_running_loop().remove_reader(child.sentinel)
        child.join(1)  # reap it: exitcode is set once joined
        exited.set()
        if self._stopping or self.children.get(proc) is not child or self.state.get(proc) != "up":
            return  # a death during startup is reported by _spawn
        log.error("process %s (pid %s) died with exit code %s", proc, child.pid, child.exitcode)
        self.state[proc] = "down"
        self._tasks.append(asyncio.create_task(self._recover(proc)))

    async def _recover(self, proc: str) -> None:
        dead = [a.name for a in self.specs[proc].actors]
        for actor in dead:
            self.router.forget(actor)
            self.broadcast(ActorDown(actor=actor, reason=f"process {proc} exited"), exclude=dead, only_up=True)
        group = _group(proc)
        restarts = self.restarts[group]
        fresh = False  # restarted with its replica after a park: not counted (the replica gets its whole budget)
        while True:  # a restart that dies during its startup is tried again, within the same bound
            if (parked := self.parked.get(group)) is not None:  # (its replica sits out: restarted after)
                await parked.wait()
                fresh = True
            if self._stopping or not (fresh or await self._within_budget(proc, group, restarts)):
                return  # (a stopping system restarts nothing)
            try:
                await self._spawn(proc, restart=True)
                break
            except StartupError as e:
                log.error("restart of %s failed: %s", proc, e)
                fresh = False
        for actor in dead:
            self.broadcast(ActorUp(actor=actor), exclude=[], only_up=True)

    async def _within_budget(self, proc: str, group: object, restarts: collections.deque[float]) -> bool:
        """Count a restart of `proc`; past the intensity, park its replica while another serves (then True: it is
        restarted after, with a fresh budget) or stop the system (False)."""
        now = time.monotonic()
        while restarts and now - restarts[0] > self.policy.window_s:
            restarts.popleft()
        if len(restarts) < self.policy.max_restarts:
            restarts.append(now)
            return True
        intensity = f"{len(restarts)} restarts in {self.policy.window_s}s"
        if not self._serving_besides(group):
            log.error("restart intensity of %s exceeded (%s): stopping", proc, intensity)
            self.exit_code = 1
            await self.stop()
            return False
        log.error("engine replica %s keeps dying (%s): out of rotation for %ss", group, intensity, self.policy.park_s)
        self.parked[group] = asyncio.Event()
        for other in self.specs:
            if other != proc and _group(other) == group:
                self.kill(other)  # (the replica sits out whole: its requests go on elsewhere)
        await asyncio.sleep(self.policy.park_s)  # (cancelled only by stop: nothing is restarted then)
        self.parked.pop(group).set()
        restarts.clear()
        return True

    def _serving_besides(self, group: object) -> bool:
        """Whether `group` is a replica and another one (of this node) has every process up."""
        others = {_group(p) for p in self.specs if isinstance(_group(p), int)} - {group}
        up = {k for k in others if all(self.state.get(p) == "up" for p in self.specs if _group(p) == k)}
        return isinstance(group, int) and bool(up)

    def broadcast(self, msg, exclude: list[str], only_up: bool = False) -> None:
        """To every actor but `exclude`; `only_up`: not to those whose process is (re)starting (a message queued
        for an incarnation not yet born would reach it stale: it learns who is down once Ready, in _spawn)."""
        for proc, actors in self.placement.processes.items():
            if only_up and self.state.get(proc, "up") != "up":  # (the launcher's actors have no state: always up)
                continue
            for actor in actors:
                if actor not in exclude and actor != SUPERVISOR:
                    self.router.send(SUPERVISOR, actor, msg)

    def kill(self, proc: str, sig: int = signal.SIGKILL) -> None:
        child = self.children.get(proc)
        if child is not None and child.pid and child.exitcode is None:
            os.kill(child.pid, sig)

    @property
    def num_restarts(self) -> int:  # (within the window, of every group)
        return sum(map(len, self.restarts.values()))

    def pids(self) -> dict[str, int]:
        return {name: c.pid for name, c in self.children.items() if c.exitcode is None}

    async def stop(self, reason: str = "shutdown") -> None:
        if self._stopping:
            await self.done.wait()
            return
        self._stopping = True
        self.broadcast(Shutdown(reason=reason), exclude=[a.name for a in self.local])
        deadline = asyncio.get_running_loop().time() + self.policy.stop_timeout_s
        for proc, child in self.children.items():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await self.exited[proc].wait()
            if child.exitcode is None:
                log.warning("process %s did not drain in time: killing", proc)
                child.kill()
            child.join(5)
            self.state[proc] = "stopped"
        grace = min(deadline - asyncio.get_running_loop().time(), LINGER_MS / 1000)  # (for what they sent last)
        await asyncio.gather(*(actor.on_processes_exited(grace) for actor in self.local), return_exceptions=True)
        for actor in self.local:
            actor.stop()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current and not task.done() and not task.get_name().endswith(":run"):
                task.cancel()
        await asyncio.gather(*(t for t in self._tasks if t is not current), return_exceptions=True)
        self.router.close()
        remove_rundir(self.rundir)
        self.done.set()


def _group(proc: str) -> object:
    """The restart group of a process: its engine replica's index, or its own name."""
    k = replica_of(proc)
    return proc if k is None else k


async def _all_set(events: list[asyncio.Event]) -> None:
    for event in events:
        await event.wait()

"""The launcher: starts actor processes from a placement (forked from its fork server: process.py), supervises them,
tears them down.

Supervision (Erlang-style, one_for_one): a child is dead when its process sentinel fires, hung when it misses
`max_missed` heartbeats (it is then SIGKILLed). On a death the supervisor broadcasts ActorDown for each of its actors
(with when it restarts them, and its group's restart count), restarts the process, and broadcasts ActorUp once the new
incarnation is Ready; a restart that fails (it dies while it starts, is not Ready within `ready_timeout_s`: then it
is killed first, or cannot be forked) is announced and tried again the same way. Within the
restart intensity of its group (an engine replica's processes, or the process alone: actors/runtime/backoff.py) it
is restarted at once. Past it: an engine replica while another replica of this node serves is parked whole (its other
processes killed too, so its requests go on elsewhere) for `park_s`, then restarted with a fresh budget; any other
group is restarted after an exponential back-off (logged; the HTTP front stays up and answers 503 meanwhile), or,
with `exit_past_intensity`, the whole system stops (exit code 1). Those broadcasts skip processes that are
(re)starting: a restarted incarnation is told, once Ready, which actors are down at that moment, then (once the
system has started) ActorUp(SUPERVISOR); every process hears ActorUp(SUPERVISOR) as the start ends.
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
from collections.abc import Callable

import msgspec

from actors.runtime.actor import Actor
from actors.runtime.backoff import RestartBudget, RestartPolicy, group_of
from actors.runtime.faults import FaultPlan
from actors.runtime.mailbox import LINGER_MS
from actors.runtime.process import ChildConfig, Inherited, ProcessSpec, child_main, how_it_exited, start_order
from actors.runtime.router import Placement, Router, make_rundir, remove_rundir
from actors.runtime.supervisor import Supervisor
from messages.names import SUPERVISOR
from messages.wire import ActorDown, ActorUp, Shutdown

log = logging.getLogger("sluice.supervisor")

LAUNCHER = "launcher"


class StartupError(RuntimeError):
    def __init__(self, message: str, proc: str | None = None, exitcode: int | None = None):
        """`proc`, `exitcode`: the process that exited while it started, and how (-N: killed by signal N)."""
        super().__init__(message)
        self.proc, self.exitcode = proc, exitcode


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
        explain: Callable[[StartupError], StartupError] | None = None,  # a failed start (or restart) as the caller
    ):  # tells it (the front adds the memory's figures: frontend/memory_check.py)
        self.specs = start_order(processes)
        self.explain, self.policy = explain or (lambda e: e), policy or RestartPolicy()
        self.fault_plan, self.log_level = fault_plan, log_level
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
        self.restarts: dict[object, RestartBudget] = collections.defaultdict(lambda: RestartBudget(self.policy))
        self.retry_at: dict[str, float] = {}  # a dead process -> when it is restarted (time.monotonic)
        self.parked: dict[object, asyncio.Event] = {}  # engine replicas out of rotation -> set as they come back
        self.started = False  # every process was Ready once
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
        ready, up = {name: asyncio.Event() for name in self.specs}, set()

        async def spawn(name: str) -> None:  # (once its `after` was up; never once that one failed, or stop began)
            try:
                after = self.specs[name].after
                if (after is None or (await ready[after].wait() and after in up)) and not self._stopping:
                    await self._spawn(name)
                    up.add(name)
            finally:
                ready[name].set()

        try:
            await asyncio.gather(*map(spawn, self.specs))
        except BaseException:
            await self.stop()
            raise
        self.started = True
        self.broadcast(ActorUp(actor=SUPERVISOR), exclude=[a.name for a in self.local], only_up=True)
        for proc, spec in self.specs.items():
            for a in spec.actors:
                self._tasks.append(asyncio.create_task(self.supervisor.heartbeat(proc, a.name)))

    async def _spawn(self, proc: str) -> None:
        spec = self.specs[proc]
        for a in spec.actors:
            self.supervisor.ready[a.name].clear()
        config = ChildConfig(process=spec, placement=self.placement, fault_plan=self.fault_plan, parent_pid=os.getpid(),
                             log_level=self.log_level)  # fmt: skip
        child = multiprocessing.get_context("forkserver").Process(
            target=child_main, args=(msgspec.json.encode(config), Inherited()), name=f"sluice:{proc}", daemon=True
        )
        self.state[proc] = "starting"
        try:
            child.start()
        except OSError as e:  # (a fork refused: ENOMEM, EAGAIN under memory pressure)
            raise StartupError(f"process {proc} could not be started: {e}", proc) from e
        exited = self.exited[proc] = asyncio.Event()
        self.children[proc] = child
        asyncio.get_running_loop().add_reader(child.sentinel, self._on_exit, proc, child, exited)
        ready = asyncio.ensure_future(self.supervisor.all_ready([a.name for a in spec.actors]))
        died = asyncio.ensure_future(exited.wait())
        timeout = self.policy.ready_timeout_s
        try:  # every actor Ready, or the child gone, or the deadline
            await asyncio.wait([ready, died], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            died.cancel()
        if exited.is_set():
            code = child.exitcode
            raise self.explain(StartupError(f"process {proc} {how_it_exited(code)} during startup", proc, code))
        if not all(self.supervisor.ready[a.name].is_set() for a in spec.actors):
            self.kill(proc)  # (left running, it would hold its memory beside the next incarnation)
            with contextlib.suppress(TimeoutError):  # (one stuck in the kernel, unkillable, is not waited for ever)
                await asyncio.wait_for(exited.wait(), self.policy.stop_timeout_s)
            raise StartupError(f"process {proc} not ready within {timeout:g} s (killed)", proc)
        self.state[proc] = "up"
        self.retry_at.pop(proc, None)
        # it heard nothing while it started: which actors are being restarted now (their ActorUp follows), then, if
        # the start has ended, that it has heard of every one down
        now, down = time.monotonic(), [p for p in self.retry_at if self.state.get(p) != "up"]
        news = [self._down(a.name, "down as this one started", p, now) for p in down for a in self.specs[p].actors]
        for actor, msg in itertools.product(spec.actors, [*news, *[ActorUp(actor=SUPERVISOR)] * self.started]):
            self.router.send(SUPERVISOR, actor.name, msg)

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
        group, reason = group_of(proc), f"process {proc} exited"
        while not self._stopping:  # (a stopping system restarts nothing)
            if (parked := self.parked.get(group)) is not None:  # its replica sits out: restarted with it, not counted
                self._announce(proc, dead, reason)
                await parked.wait()
            elif not await self._wait_budget(proc, dead, reason, group):
                return
            if self._stopping:
                return
            try:  # a restart that dies during its startup is announced and tried again, within the same budget
                await self._spawn(proc)
                break
            except Exception as e:  # (whatever failed, the process is not up: never a recovery that ends silently)
                log.error("restart of %s failed: %s", proc, e, exc_info=not isinstance(e, StartupError))
                reason = f"its restart failed: {e}"
        for actor in dead if not self._stopping else ():
            self.broadcast(ActorUp(actor=actor), exclude=[], only_up=True)

    async def _wait_budget(self, proc: str, dead: list[str], reason: str, group: object) -> bool:
        """Count a restart of `proc`, announce it and wait for it: at once within the intensity; past it, park its
        replica while another serves (restarted after with a fresh budget), else back off, or stop (False)."""
        budget, now = self.restarts[group], time.monotonic()
        wait = budget.next_wait(now)
        intensity = f"more than {self.policy.max_restarts} restarts in {self.policy.window_s:g} s"
        park = bool(wait) and self._serving_besides(group)
        if wait and not park and self.policy.exit_past_intensity:
            log.error("restart intensity of %s exceeded (%s): stopping", proc, intensity)
            self._announce(proc, dead, reason)
            self.exit_code = 1
            await self.stop()
            return False
        if park:
            wait = self.policy.park_s
            log.error("engine replica %s keeps dying (%s): out of rotation for %g s", group, intensity, wait)
            self.parked[group] = asyncio.Event()
        elif wait:
            log.error("%s keeps dying (%s; %d restarts in all): retried in %g s", proc, intensity, budget.total, wait)
        for p in self.specs if park else [proc]:
            if group_of(p) == group:
                self.retry_at[p] = now + wait
        self._announce(proc, dead, reason, now)  # (the wait as planned, however late this runs)
        for other in self.specs if park else ():
            if other != proc and group_of(other) == group:
                self.kill(other)  # (the replica sits out whole: its requests go on elsewhere)
        if wait:
            await asyncio.sleep(wait)  # (cancelled only by stop: nothing is restarted then)
        if park:
            self.parked.pop(group).set()
            budget.clear()
        return True

    def _announce(self, proc: str, dead: list[str], reason: str, now: float | None = None) -> None:
        """Broadcast that `dead` are down; `now` the moment their restart was planned at (else this one)."""
        now = time.monotonic() if now is None else now
        for actor in dead:
            self.broadcast(self._down(actor, reason, proc, now), exclude=dead, only_up=True)

    def _down(self, actor: str, reason: str, proc: str, now: float) -> ActorDown:
        """`actor` (of `proc`) is down: in how long it is restarted, and how often its group was."""
        budget = self.restarts.get(group_of(proc))
        wait = round(max(0.0, self.retry_at.get(proc, now) - now), 3)  # (ms: the back-off as planned)
        return ActorDown(actor=actor, reason=reason, retry_in_s=wait, restarts=0 if budget is None else budget.total)

    def _serving_besides(self, group: object) -> bool:
        """Whether `group` is a replica and another one (of this node) has every process up."""
        others = {group_of(p) for p in self.specs if isinstance(group_of(p), int)} - {group}
        up = {k for k in others if all(self.state.get(p) == "up" for p in self.specs if group_of(p) == k)}
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
        for proc, child in list(self.children.items()):
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

"""Actor processes: what runs in a child, and how it dies.

A child is spawned (never forked: torch and ZMQ do not survive fork) with a JSON config. It sets
its process title `sluice:<process>`, asks the kernel to SIGKILL it when the launcher dies (and
polls its parent as a second line), starts its actors on uvloop and tells the supervisor Ready.
SIGTERM/SIGINT drain gracefully; once its actors have ended and what they sent has gone out (a peer that
does not take it is given LINGER_MS) it exits at once (os._exit: no wait for executor threads still
running). Exit codes: 0 clean, 1 an actor failed, 3 the launcher died.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import logging
import os
import signal
import sys

import msgspec
import zmq

from actors.runtime.actor import Actor
from actors.runtime.faults import FaultPlan
from actors.runtime.mailbox import LINGER_MS
from actors.runtime.router import Placement, Router
from messages.names import SUPERVISOR
from messages.wire import Ready

log = logging.getLogger("sluice.process")

EXIT_OK, EXIT_FAILED, EXIT_ORPHANED = 0, 1, 3


class ActorSpec(msgspec.Struct, kw_only=True):
    """`factory` is "module:callable"; it is called with `kwargs` and returns an Actor."""

    name: str
    factory: str
    kwargs: dict = {}

    def build(self) -> Actor:
        module, _, attr = self.factory.partition(":")
        actor = getattr(importlib.import_module(module), attr)(**self.kwargs)
        actor.name = self.name
        return actor


class ProcessSpec(msgspec.Struct, kw_only=True):
    name: str
    actors: list[ActorSpec]
    env: dict[str, str] = {}


class ChildConfig(msgspec.Struct, kw_only=True):
    process: ProcessSpec
    placement: Placement
    fault_plan: FaultPlan | None = None
    parent_pid: int
    log_level: str = "INFO"


def child_main(config_json: bytes) -> None:
    """Entry point of every actor process (multiprocessing spawn target)."""

    config = msgspec.json.decode(config_json, type=ChildConfig)
    os.environ.update(config.process.env)
    die_with_parent(config.parent_pid)
    set_title(f"sluice:{config.process.name}")
    logging.basicConfig(
        level=config.log_level, format=f"%(asctime)s %(levelname)s [{config.process.name}] %(name)s: %(message)s"
    )
    import uvloop

    code = uvloop.run(_serve(config))
    try:  # what the actors sent last goes out first (ZMQ's I/O thread may still hold it): Router.close gave its
        # sockets a linger of LINGER_MS (for a peer that does not take it); a socket still open gets it here
        zmq.Context.instance().destroy(linger=LINGER_MS)
    finally:  # (a second Ctrl-C may interrupt the wait: the exit is the same)
        logging.shutdown()  # (flushed: what follows skips the interpreter's finalization)
        sys.stdout.flush(), sys.stderr.flush()
        # not sys.exit: that joins every non-daemon thread, and a device step or compile still running in an
        # executor's thread (a hung fault, a slow grammar) would keep this process, and its launcher's join, alive
        os._exit(code)


async def _serve(config: ChildConfig) -> int:
    router = Router(config.placement, config.process.name, config.fault_plan)
    actors = [spec.build() for spec in config.process.actors]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: [actor.drain("signal") for actor in actors])
    watchdog = asyncio.ensure_future(_watch_parent(config.parent_pid))
    try:
        async with asyncio.TaskGroup() as tasks:
            for actor in actors:
                tasks.create_task(actor.run(router))
            # Ready only once every on_start returned (model loaded): a failing start fails fast
            await asyncio.gather(*(a.started.wait() for a in actors))
            for actor in actors:
                router.send(actor.name, SUPERVISOR, Ready(actor=actor.name, pid=os.getpid()))
        return EXIT_OK
    except BaseExceptionGroup:
        log.exception("actor failure in process %s", config.process.name)
        return EXIT_FAILED
    finally:
        watchdog.cancel()
        router.close()


async def _watch_parent(parent_pid: int) -> None:
    while True:
        await asyncio.sleep(0.5)
        if os.getppid() != parent_pid:
            log.error("launcher %d is gone; exiting", parent_pid)
            os._exit(EXIT_ORPHANED)


def die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(EXIT_ORPHANED)


def set_title(title: str) -> None:
    import setproctitle

    setproctitle.setproctitle(title)

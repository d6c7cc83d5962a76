"""Actor processes: what runs in a child, and how it dies.

A child is forked from the launcher's fork server (multiprocessing's forkserver: a fresh interpreter, never the
launcher itself, whose threads, event loop and ZMQ sockets would not survive a fork), which imported the actors'
modules once (`start_forkserver`): a child, or a restart, starts without an interpreter and imports of its own
(torch's alone take about a second). It gets a JSON config and the launcher's environment, stdout and stderr as
they are when it starts (`Inherited`), as a spawned child would. It sets its process title `sluice:<process>`,
exits at once when the launcher does (a thread watches the launcher's pidfd; the kernel SIGKILLs it if the process
it was forked from dies first), starts its actors on uvloop, freezes what they hold out of the cyclic GC
(`settle_heap`) and tells the supervisor Ready. SIGTERM/SIGINT drain gracefully; once its actors have ended and what
they sent has gone out (a peer that does not take it is given LINGER_MS) it exits at once (os._exit: no wait for
executor threads still running). Exit codes: 0 clean, 1 an actor failed, 3 the launcher died.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import importlib
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import select
import signal
import sys
import threading
import time
from multiprocessing import reduction

import msgspec
import zmq

from actors.runtime.actor import Actor
from actors.runtime.faults import FaultPlan
from actors.runtime.mailbox import LINGER_MS
from actors.runtime.router import Placement, Router
from messages.names import SUPERVISOR
from messages.wire import Ready

GC_GEN0 = 20_000  # net allocations of tracked objects between young collections, once started (settle_heap)

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
    after: str | None = None  # the system's start forks this one once that process is Ready (restarts: unordered)


def start_order(specs: list[ProcessSpec]) -> dict[str, ProcessSpec]:
    """The specs by name; ValueError unless each `after` names another process, and no chain of them comes back (a
    start that would wait for ever)."""
    by_name = {p.name: p for p in specs}
    for p in specs:
        chain = [p.name]
        while (after := by_name[chain[-1]].after) is not None:
            chain.append(after)
            if after not in by_name or after in chain[:-1]:
                why = "none such" if after not in by_name else "a cycle"
                raise ValueError(f"process {p.name}'s start waits on {' -> '.join(chain[1:])}: {why}")
    return by_name


class ChildConfig(msgspec.Struct, kw_only=True):
    process: ProcessSpec
    placement: Placement
    fault_plan: FaultPlan | None = None
    parent_pid: int
    log_level: str = "INFO"


class Inherited:
    """What a spawned child inherits from the launcher as it starts, handed to a forked one (whose own are the fork
    server's, as they were when that started): the environment, stdout and stderr (where the launcher's output goes
    now, e.g. a test's capture)."""

    def __init__(self, environ: dict[str, str] | None = None, fds: tuple = ()):
        self.environ = dict(os.environ) if environ is None else environ
        self.fds = fds

    def __reduce__(self):  # (pickled as the child is launched: the fds travel with it)
        return Inherited, (self.environ, (reduction.DupFd(1), reduction.DupFd(2)))

    def attach_stdio(self) -> None:
        for target, fd in enumerate(self.fds, start=1):
            received = fd.detach()
            os.dup2(received, target)
            os.close(received)


def start_forkserver(preload: tuple[str, ...] = ()) -> None:
    """Start the fork server every actor process is forked from, importing `preload` (the actors' modules) in it:
    called early (`sluice serve` does, before its own imports and checks), it imports them meanwhile. Otherwise
    the first process started starts it, preloading nothing. Its first start's preload holds."""
    multiprocessing.set_forkserver_preload([__name__, *preload])
    multiprocessing.forkserver.ensure_running()


def call_forked(function: str, argument: bytes, title: str) -> bytes:
    """`function` ("module:callable", bytes -> bytes) called on `argument` in a child of the fork server, its answer:
    a launcher's work that needs modules the fork server imported and the launcher does not (torch). The child
    starts as an actor process does (`title`, the launcher's environment, stdout and stderr) and exits once it has
    answered. Blocks; ChildProcessError if the child dies first."""
    context = multiprocessing.get_context("forkserver")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_answer, args=(function, argument, send, title, Inherited()), daemon=True)
    child.start()
    send.close()
    try:
        return receive.recv_bytes()
    except EOFError:
        child.join()
        raise ChildProcessError(f"{title} {how_it_exited(child.exitcode)} before it answered (see its log)") from None
    finally:
        receive.close()
        child.join()


def _answer(function: str, argument: bytes, send, title: str, inherited: Inherited) -> None:
    inherited.attach_stdio()
    set_title(title)
    os.environ.clear()
    os.environ.update(inherited.environ)
    module, _, name = function.partition(":")
    send.send_bytes(getattr(importlib.import_module(module), name)(argument))
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(EXIT_OK)  # (not the interpreter's finalization: torch's alone takes a second)


def how_it_exited(code: int) -> str:
    """How a child exited, from its exit code (-N: killed by signal N, a real-time one, which has no name, included)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def child_main(config_json: bytes, inherited: Inherited) -> None:
    """Entry point of every actor process (multiprocessing's target, forked from the fork server)."""
    gc.freeze()  # (what the fork server imported is never collected here: its pages stay shared, ~40 MB a process)
    reuse_freed_heap()  # (first: before any thread has an arena of its own)

    config = msgspec.json.decode(config_json, type=ChildConfig)
    inherited.attach_stdio()
    set_title(f"sluice:{config.process.name}")  # (first: setproctitle finds the title's room from the environment)
    os.environ.clear()
    os.environ.update(inherited.environ | config.process.env)
    die_with_parent(config.parent_pid)
    one_process_progress_bars()
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
    try:
        async with asyncio.TaskGroup() as tasks:
            for actor in actors:
                tasks.create_task(actor.run(router))
            # Ready only once every on_start returned (model loaded): a failing start fails fast
            await asyncio.gather(*(a.started.wait() for a in actors))
            settle_heap()
            for actor in actors:
                router.send(actor.name, SUPERVISOR, Ready(actor=actor.name, pid=os.getpid()))
        return EXIT_OK
    except BaseExceptionGroup:
        log.exception("actor failure in process %s", config.process.name)
        return EXIT_FAILED
    finally:
        router.close()


def settle_heap() -> None:
    """Once a process has started (its model loaded, its KV cache's tables made), what it holds is frozen out of the
    cyclic GC, and a young generation is collected every GC_GEN0 net allocations of tracked objects, not CPython's 700.
    A step makes and drops thousands (rows, outputs, messages): at 700 the engine collected about once a step, and
    what steps keep (requests, the prefix cache's entries) was scanned again in full collections of up to 15 ms of
    CPU (36 ms in an HTTP process, 28 in a worker). Under serving at c256 (docs/PERFORMANCE.md) the engine's GC went
    from 8% of its CPU to none after its start. Cost: cyclic garbage is found later (a young collection every GC_GEN0
    allocations, the older ones 10 and 100 times rarer, as CPython's); startup objects that later form garbage cycles
    are never collected (what startup made lives as long as the process)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0, *gc.get_threshold()[1:])


def one_process_progress_bars() -> None:
    """tqdm's bars (loading, graph capture) lock a thread lock: its default also makes a multiprocessing semaphore,
    which a child ended by os._exit or kill -9 leaves behind (the resource tracker's "leaked semaphore" warning)."""
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def reuse_freed_heap() -> None:
    """glibc's malloc, set as its dynamic thresholds end up at most (32 MiB mmap, twice that trim), from the start and
    for every thread started after (one arena: the fork server has one thread): a step's tensors under 32 MiB (an
    encoder's 3-13 MiB activations, a prefill's) come from the heap that the last step freed, not from fresh mappings
    that are unmapped again and each page faulted in anew (~30,000 page faults in a 2,048-token step of
    all-MiniLM-L6-v2, about a tenth of its time). Cost: a process keeps up to 64 MiB freed at its heap's top (besides
    what any heap keeps between live blocks), and its threads' mallocs share one lock (a step's are few and large).
    Nothing where the C library is not glibc."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None and hasattr(os, "confstr") and "glibc" in (os.confstr("CS_GNU_LIBC_VERSION") or ""):
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
        for param, value in ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 64 << 20), (M_ARENA_MAX, 1)):
            mallopt(param, value)


def die_with_parent(parent_pid: int) -> None:
    """Exit when `parent_pid` (the launcher, or a gang's leader) does: SIGKILLed by the kernel when the process this
    one was forked from dies (the launcher, or its fork server), and on a thread watching `parent_pid`."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    threading.Thread(target=_watch, args=(parent_pid,), name="sluice-parent", daemon=True).start()


def _watch(parent_pid: int) -> None:
    """Exit once `parent_pid` has: its pidfd is readable then (polled where there are no pidfds)."""
    try:
        select.select([os.pidfd_open(parent_pid)], [], [])
    except ProcessLookupError:  # (it died before this one could watch it)
        pass
    except (AttributeError, OSError):  # (no pidfd_open: not Linux 5.3+)
        while _alive(parent_pid):
            time.sleep(0.5)
    log.error("launcher %d is gone; exiting", parent_pid)
    os._exit(EXIT_ORPHANED)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def set_title(title: str) -> None:
    import setproctitle

    setproctitle.setproctitle(title)

"""The suite's end (a pytest plugin, loaded by conftest.py): what the tests left running is named and ended, and the
process exits even if something still holds it.

A CI run printed its summary (every test passed) and then hung until the CI killed it, 55 minutes later. The cause
found since: a stopped actor's ZMQ context left to the garbage collector, whose finalizer waits for sockets that are
finalized after it (fixed: `Actor.on_stop`). What else may hold a process after the summary: the non-daemon threads
Python joins (the asyncio executors' too), and the children multiprocessing joins, after sending the daemonic ones
SIGTERM, which an actor process answers by draining. Here, at unconfigure (after the summary):
- a daemon watchdog is started first: it ends the process with the session's own exit status if exiting still takes
  EXIT_DEADLINE_S, after dumping every thread's stack (a hang at exit shows what it was instead of costing the run);
  past that, faulthandler's (status 1) covers the interpreter's last phase, where daemon threads no longer run;
- child processes still alive are listed on stderr and SIGKILLed (an actor process's own children die with it:
  PDEATHSIG);
- non-daemon threads still alive are listed with their stacks.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import sys
import threading
import traceback

import pytest

EXIT_DEADLINE_S = 120.0
_STATUS = pytest.StashKey[int]()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    session.config.stash[_STATUS] = int(session.exitstatus)


def pytest_unconfigure(config: pytest.Config) -> None:
    err, status = sys.__stderr__, config.stash.get(_STATUS, 1)

    def expire() -> None:
        print(f"exit_guard: still exiting after {EXIT_DEADLINE_S:.0f} s; every thread's stack:", file=err, flush=True)
        faulthandler.dump_traceback(err, all_threads=True)
        os._exit(status)

    watchdog = threading.Timer(EXIT_DEADLINE_S, expire)
    watchdog.daemon = True
    watchdog.start()
    faulthandler.dump_traceback_later(2 * EXIT_DEADLINE_S, exit=True, file=err)
    children = multiprocessing.active_children()
    for child in children:
        print(f"exit_guard: killing {child.name} (pid {child.pid}), left running by the tests", file=err)
        child.kill()
    for child in children:
        child.join(10)
    frames = sys._current_frames()
    for t in threading.enumerate():
        if not t.daemon and t is not threading.main_thread():
            stack = "".join(traceback.format_stack(frames[t.ident])) if t.ident in frames else ""
            print(f"exit_guard: thread {t.name} still running, at:\n{stack}", file=err)

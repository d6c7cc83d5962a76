"""What an actor process leaves behind when it ends without cleanup (os._exit, kill -9): no multiprocessing
semaphore for the resource tracker to find. tqdm's default write lock makes one wherever the start method is not
fork (an actor process is forked from the fork server: forkserver), so a child's progress bars must not use it
(actors/runtime/process.py, `one_process_progress_bars`)."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import multiprocessing, os, sys
multiprocessing.set_start_method("forkserver")  # (an actor process's context)
if sys.argv[1] == "actor":
    from actors.runtime.process import one_process_progress_bars
    one_process_progress_bars()
from tqdm import tqdm
list(tqdm(range(3)))
os._exit(0)
"""


def ended_abruptly(kind: str) -> str:
    """The stderr of a process (and of its resource tracker, which holds the pipe until it ends) that showed a bar."""
    return subprocess.run([sys.executable, "-c", CHILD, kind], capture_output=True, text=True, timeout=120).stderr


def test_an_actor_process_with_a_progress_bar_leaks_no_semaphore():
    assert "leaked semaphore" in ended_abruptly("plain")  # (the test's power: tqdm's default lock leaks)
    assert "leaked semaphore" not in ended_abruptly("actor")

"""tests/exit_guard.py, on a run of its own: a child that ignores SIGTERM and a thread blocked forever, left by a
passing test, would hang the interpreter's exit for ever; the guard kills the child (it is gone afterwards), names
the thread, and its watchdog ends the process with the session's status (0) after the deadline, every stack dumped."""

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

LEAKY = """
import multiprocessing, signal, threading
from pathlib import Path

import tests.exit_guard

tests.exit_guard.EXIT_DEADLINE_S = 2.0


def stubborn():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Event().wait()


def test_leaves_a_child_and_a_thread():
    child = multiprocessing.get_context("spawn").Process(target=stubborn, daemon=True, name="stubborn")
    child.start()
    Path(__file__).with_name("child.pid").write_text(str(child.pid))
    threading.Thread(target=threading.Event().wait, name="blocked-forever").start()
"""


def test_a_run_that_leaves_work_behind_still_exits_with_its_status(tmp_path):
    (tmp_path / "test_leaky.py").write_text(textwrap.dedent(LEAKY))
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.exit_guard", "--noconftest"]
    run = subprocess.run(
        [*args, "--rootdir", str(tmp_path), str(tmp_path / "test_leaky.py")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout
    assert "exit_guard: killing stubborn" in run.stderr
    assert "exit_guard: thread blocked-forever still running" in run.stderr
    assert "still exiting after 2 s" in run.stderr
    pid = int((tmp_path / "child.pid").read_text())
    assert not Path(f"/proc/{pid}").exists()  # (killed and reaped: left alone, it would wait for ever)

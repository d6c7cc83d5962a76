"""scripts/gpu_check.py's plumbing, on CPU: a GPU is lent rarely and for minutes, so a runbook that breaks there costs
the whole run. Its three files after a part; and a SIGTERM from an outer `timeout` (docs/GPU.md), which ends the part
running, keeps that part's output and says it was cut off. The card's part meets a fake `nvidia-smi` (a fault
injected: it answers, then hangs)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def gpu_check(tmp: Path) -> Iterator[subprocess.Popen]:
    """gpu_check's env part, with tmp's bin/ first in PATH and its work folder in tmp; its process group killed after."""
    env = {**os.environ, "PATH": f"{tmp / 'bin'}{os.pathsep}{os.environ['PATH']}", "TMPDIR": str(tmp)}
    cmd = [sys.executable, "scripts/gpu_check.py", "--out", str(tmp / "out"), "--only", "env", "--commit", "abc"]
    pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, **pipe)  # (a group: as `timeout` signals)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # (what is left of it: the fake's sleep)
        proc.communicate()


def fake_smi(bin_dir: Path, body: str) -> None:
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\necho 'Fake H100, 580.1, 81559 MiB'\n{body}\n")
    (bin_dir / "nvidia-smi").chmod(0o755)


def test_a_part_writes_the_report_the_log_and_the_results(tmp_path):
    fake_smi(tmp_path / "bin", "")
    with gpu_check(tmp_path) as proc:
        printed = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 0, printed
    report = (tmp_path / "out" / "report.md").read_text()
    assert report.startswith("# Sluice GPU check abc") and "- Fake H100, 580.1, 81559 MiB" in report
    assert "- torch " in report and " triton " in report and " transformers " in report  # (the versions' line)
    assert "===== env.log" in (tmp_path / "out" / "gpu_check.log").read_text()
    assert json.loads((tmp_path / "out" / "results.json").read_text()) == {}  # (env writes no benchmark's JSON)
    assert printed.rstrip().endswith("- Fake H100, 580.1, 81559 MiB")  # the summary: a line per part


def test_a_sigterm_keeps_the_running_parts_output_and_says_it_was_cut_off(tmp_path):
    ready = tmp_path / "ready"
    os.mkfifo(ready)
    fake_smi(tmp_path / "bin", f"echo up > {ready}\nexec sleep 600")  # (it says when it runs, then hangs)
    reader = os.open(ready, os.O_RDONLY | os.O_NONBLOCK)  # (no writer yet: a read would find nothing)
    with gpu_check(tmp_path) as proc:
        writer = os.open(ready, os.O_WRONLY)  # (ours keeps the fifo open: the fake's `echo` never meets an end)
        try:
            assert select.select([reader], [], [], 60)[0] and os.read(reader, 16) == b"up\n", "never at the card"
        finally:
            os.close(writer)
            os.close(reader)
        os.killpg(proc.pid, signal.SIGTERM)
        printed = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == 1 and "gpu_check: terminated (SIGTERM)" in printed, printed
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## env (" in report and "- cut off: its output so far is in gpu_check.log" in report
    assert "Fake H100, 580.1, 81559 MiB" in (tmp_path / "out" / "gpu_check.log").read_text()

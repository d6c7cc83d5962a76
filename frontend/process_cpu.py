"""CPU time of a local server's process tree by process title, from Linux's /proc: what `sluice bench serve
--server-pid` reports per output token, to tell which process a serving figure is bound by (one at about 1.0 core
is the limit; a Python actor cannot use more).

A title is a process's first argv word (setproctitle's, for Sluice's actors: `sluice:http`, `sluice:engine`, ...);
processes of one title are summed. Each counts every thread's user + system time (ZMQ's I/O thread included).
Readings are per process (pid and start time): one that started between two readings counts from 0, one that ended
counts until the first reading (an actor restarted in between is both).
"""

from __future__ import annotations

import os
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat(pid: str) -> tuple[int, int, float] | None:
    """(parent pid, start time in ticks, CPU seconds) of a live process, None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # (the name may hold ")")
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19]), (int(fields[11]) + int(fields[12])) * TICK_S


def _title(pid: int) -> str:
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return str(pid)
    return os.path.basename(argv0.split(" ", 1)[0]) or str(pid)


Reading = dict[tuple[int, int], tuple[str, float]]  # (pid, start time) -> (title, CPU seconds so far)


def tree_cpu(root: int) -> Reading:
    """The CPU seconds so far of `root` and of each of its descendants; {} without /proc."""
    if not Path("/proc").is_dir():
        return {}
    stats = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(p)) is not None}
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    out: Reading = {}
    todo = [root] if root in stats else []
    while todo:
        pid = todo.pop()
        _, start, cpu = stats[pid]
        out[pid, start] = _title(pid), cpu
        todo += children.get(pid, [])
    return out


def cpu_report(before: Reading, after: Reading, seconds: float, tokens: int) -> dict[str, dict]:
    """Per title: its processes' CPU seconds between the two readings, the cores that is over `seconds`, and
    microseconds per output token; busiest first."""
    spent: dict[str, float] = {}
    for key, (title, cpu) in after.items():
        spent[title] = spent.get(title, 0.0) + cpu - before.get(key, (title, 0.0))[1]
    return {
        title: {"cpu_s": s, "cores": s / seconds if seconds else 0.0, "us_per_token": 1e6 * s / max(tokens, 1)}
        for title, s in sorted(spent.items(), key=lambda kv: -kv[1])
    }

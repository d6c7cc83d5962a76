"""A gang's follower rank processes, which both of their spawners share: the leader's own node's (actors/engine/gang.py)
and a headless node's launcher (actors/engine/gang_nodes.py). A rank's config, its process (`python -m
actors.engine.gang`, whose follower_main runs it), and the wait for the first of a node's ranks to exit. Of the
engine, imports only actors/engine/config.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import msgspec

from actors.engine.config import EngineConfig


class FollowerConfig(msgspec.Struct, kw_only=True):
    engine: EngineConfig
    rank: int
    device_index: int  # its device among its node's (CUDA)
    store: str  # the group's rendezvous (gpu/distributed/group.py)
    num_blocks: int
    parent_pid: int  # the process that spawned it (the leader, or a headless node's launcher): it dies with it
    log_level: str


def spawn_rank(follower: FollowerConfig) -> subprocess.Popen:
    """A follower rank's process (call from a thread that outlives it: PDEATHSIG follows the spawning thread)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # (finds this code as we do)
    return subprocess.Popen(
        [sys.executable, "-m", "actors.engine.gang", msgspec.json.encode(follower).decode()], env=env
    )


async def first_exit(ranks: dict[int, subprocess.Popen]) -> tuple[int, int | None]:
    """Until one of the ranks' processes exits: its rank and exit code (negative: the signal that killed it)."""
    loop, exited = asyncio.get_running_loop(), asyncio.get_running_loop().create_future()
    fds = {os.pidfd_open(p.pid): rank for rank, p in ranks.items()}
    try:
        for fd, rank in fds.items():
            loop.add_reader(fd, lambda r=rank: exited.done() or exited.set_result(r))
        rank = await exited
        return rank, ranks[rank].poll()
    finally:
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)

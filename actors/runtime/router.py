"""Placement and the per-process Router: where every actor lives and how to reach it."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

import msgspec
import zmq

from actors.runtime.faults import FaultInjector, FaultPlan
from actors.runtime.mailbox import LINGER_MS, Inbox, Link, push_socket
from messages.codec import Codec
from messages.wire import Msg

log = logging.getLogger("sluice.router")

IPC_PATH_LIMIT = 107  # sun_path is 108 bytes including the NUL


class Placement(msgspec.Struct, kw_only=True):
    """Which actors live in which process, and their addresses.

    Addresses default to `ipc://<rundir>/<actor>`; `endpoints` overrides one (e.g. tcp://)."""

    rundir: str
    processes: dict[str, list[str]]
    endpoints: dict[str, str] = {}

    def address(self, actor: str) -> str:
        addr = self.endpoints.get(actor) or f"ipc://{self.rundir}/{actor}"
        if addr.startswith("ipc://") and len(addr) - len("ipc://") > IPC_PATH_LIMIT:
            raise ValueError(f"ipc path too long ({len(addr) - 6} > {IPC_PATH_LIMIT}): {addr}")
        return addr

    def process_of(self, actor: str) -> str:
        for proc, actors in self.processes.items():
            if actor in actors:
                return proc
        raise KeyError(f"actor {actor!r} is not placed in any process")

    @property
    def actors(self) -> list[str]:
        return [a for actors in self.processes.values() for a in actors]


def make_rundir() -> str:
    """A private (0700) runtime directory for this server's sockets, short enough for ipc://."""
    base = os.environ.get("SLUICE_RUNTIME_DIR") or os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    if len(base) > 60:
        base = "/tmp"
    path = tempfile.mkdtemp(prefix="sluice-", dir=base)  # mkdtemp creates it 0700
    os.chmod(path, 0o700)
    return path


def remove_rundir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class Router:
    """Sends messages from this process's actors: in-process for local receivers, ZMQ otherwise."""

    def __init__(self, placement: Placement, process: str, fault_plan: FaultPlan | None = None):
        self.placement = placement
        self.process = process
        self.ctx = zmq.Context.instance()
        self.codec = Codec()
        self.faults = FaultInjector(fault_plan) if fault_plan and fault_plan.rules else None
        self.inboxes: dict[str, Inbox] = {}
        self._links: dict[tuple[str, str], Link] = {}
        self._sockets: dict[tuple[str, str], zmq.Socket] = {}

    def open_inbox(self, actor: str) -> Inbox:
        inbox = Inbox(actor, Codec())
        inbox.bind(self.ctx, self.placement.address(actor))
        self.inboxes[actor] = inbox
        return inbox

    def send(self, src: str, dst: str, msg: Msg) -> None:
        link = self._links.get((src, dst))
        if link is None:
            link = self._links[(src, dst)] = self._make_link(src, dst)
        link.send(msg)

    def _make_link(self, src: str, dst: str) -> Link:
        name = f"{src}->{dst}"
        local = self.inboxes.get(dst)
        if local is not None:
            return Link(name, local.put, remote=False, faults=self.faults)
        sock = self._sockets[(src, dst)] = push_socket(self.ctx, self.placement.address(dst))
        encode = self.codec.encode
        return Link(name, lambda msg: sock.send(encode(msg), zmq.NOBLOCK), remote=True, faults=self.faults)

    def forget(self, dst: str) -> None:
        """Drop links to `dst` (it died): reconnect lazily, so nothing queued for the dead
        incarnation is replayed into the new one."""
        for key in [k for k in self._links if k[1] == dst]:
            self._links.pop(key)
            sock = self._sockets.pop(key, None)
            if sock is not None:
                sock.close(linger=0)

    def close(self) -> None:
        for inbox in self.inboxes.values():
            inbox.close()
        for sock in self._sockets.values():
            sock.close(linger=LINGER_MS)
        self._sockets.clear()
        self._links.clear()

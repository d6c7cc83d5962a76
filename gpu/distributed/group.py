"""The tensor-parallel group of a worker gang (torch.distributed) and the collectives the layers call.

A process holds at most one rank of one gang. Until `join()` it is `SINGLE` (size 1: every collective is the
identity, every shard the whole tensor), so the one-device path runs the same blocks with nothing sharded.
`join(rank, size, store)` makes it rank `rank` of `size` in a torch.distributed group: gloo on CPU; on CUDA one
group with NCCL for device tensors and gloo for host ones (the steps the first rank broadcasts: NCCL carries no host
tensors). Every collective has the group's timeout: a peer that died fails the others' collective at once (its
connections close), one that hangs within `timeout_s` — nothing waits forever. `rendezvous` makes the store the
ranks meet at: a file on one node, a sealed TCPStore on the master's address across nodes (gpu/distributed/store.py).

`current()` is this process's group; the layers read it when they are built (their shapes: gpu/layers/parallel.py)
and call its collectives in their forward. The first rank (0) is the one that samples: the logits are gathered
there only.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from gpu.distributed.store import SealedStore, gang_key, interface_toward, listener, master_address


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    @property
    def first(self) -> bool:
        """The sampling rank."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x (in place), on every rank."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def gather_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """On the first rank, every rank's x concatenated along the last dim (rank order); None on the others."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.first else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, -1) if self.first else None

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """The first rank's x, in place on every rank."""
        if self.size > 1:
            dist.broadcast(x, src=0)
        return x

    def broadcast_bytes(self, data: bytes = b"") -> bytes:
        """The first rank's bytes on every rank (host tensors): their length, then (unless empty) the bytes."""
        length = self.broadcast(torch.tensor([len(data)], dtype=torch.int64))
        if not int(length):
            return b""
        if self.first:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(int(length), dtype=torch.uint8)
        return self.broadcast(buf).numpy().tobytes()


SINGLE = TensorParallel()
_current = SINGLE


def current() -> TensorParallel:
    return _current


@contextmanager
def shaped_as(tp: TensorParallel):
    """Build layers as rank `tp.rank` of `tp.size` would, with no group (a checkpoint's check before any rank starts;
    a collective called inside fails)."""
    global _current
    saved, _current = _current, tp
    try:
        yield tp
    finally:
        _current = saved


def rendezvous(url: str, size: int, first: bool, key: bytes = b"") -> tuple[dist.Store, str]:
    """The group's store, and its URL for the other ranks; the collectives bound to the interface it says.

    "file://<path>" on one node: a file in the server's private runtime directory (nothing listens; gloo's and NCCL's
    sockets bound to loopback). "tcp://<host>:<port>/<gang>" across nodes: the first rank's TCPStore listening on
    <host> only (port 0: a free one; a name resolved once, there, and the URL given the others numeric: a name that
    resolves to loopback is refused), every value sealed under a key of this gang from `key` (the cluster's store key:
    actors/runtime/curve.py's `derive`) and its keys under a prefix derived so too (never the secret itself); gloo and
    NCCL bound to this node's interface toward <host> unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME say otherwise
    (gpu/distributed/store.py; docs/OPERATIONS.md)."""
    scheme, _, where = url.partition("://")
    if scheme == "file":
        _bind_collectives("lo", force=True)
        return dist.FileStore(where, size), url
    if not key:
        raise ValueError("a store across nodes is sealed with the cluster's key: none given")
    address, _, gang = where.partition("/")
    host, _, port = address.rpartition(":")
    host = master_address(host) if first else host
    _bind_collectives(interface_toward(host), force=False)
    if first:
        tcp, port = _master(host, size)
        url = f"tcp://{host}:{port}/{gang}"
    else:
        tcp = dist.TCPStore(host, int(port), size, is_master=False)
    prefix = gang_key(key, url, "prefix").hex()[:32]
    return SealedStore(dist.PrefixStore(prefix, tcp), gang_key(key, url, "seal")), url


def _master(host: str, size: int) -> tuple[dist.TCPStore, int]:
    """The store's server on a socket listening on `host` only, and its port. The store owns the socket once it has
    it; torch 2.13 closes it itself when it fails after taking it (libuv's server closes the handle it opened on it; a
    failure later destroys the server). So after any failure the socket is closed here only if its descriptor still
    names it (never taken, or left): not twice, and never a file that reused the number."""
    sock = listener(host)
    port = sock.getsockname()[1]
    ours = os.fstat(sock.fileno())
    try:
        tcp = dist.TCPStore(host, port, size, is_master=True, wait_for_workers=False, master_listen_fd=sock.fileno())
    except BaseException:
        if _names(sock.fileno(), ours):
            sock.close()
        else:
            sock.detach()
        raise
    sock.detach()  # (the store's now)
    return tcp, port


def _names(fd: int, file: os.stat_result) -> bool:
    """Whether `fd` is still open on `file`."""
    try:
        now = os.fstat(fd)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (file.st_dev, file.st_ino)


def _bind_collectives(interface: str, force: bool) -> None:
    """gloo's and NCCL's sockets on `interface` (NCCL's "=": that name exactly, not a prefix of others)."""
    for variable, value in (("GLOO_SOCKET_IFNAME", interface), ("NCCL_SOCKET_IFNAME", f"={interface}")):
        if force:
            os.environ[variable] = value
        else:
            os.environ.setdefault(variable, value)


def join(rank: int, size: int, store: dist.Store, device: torch.device, timeout_s: float) -> TensorParallel:
    """Make this process rank `rank` of `size` (blocks until every rank joined `store`, at most `timeout_s`)."""
    global _current
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    _current = TensorParallel(rank, size)
    return _current


def leave() -> None:
    """Back to SINGLE (the group torn down, where one was joined)."""
    global _current
    if dist.is_initialized():
        dist.destroy_process_group()
    _current = SINGLE

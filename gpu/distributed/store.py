"""What a gang's rendezvous across nodes is made of (gpu/distributed/group.py's `rendezvous`): the TCPStore's listening
socket, bound to the master's address only; the network interface the collectives bind to; and the sealing of the
store's values with a key from the cluster secret.

torch's TCPStore (2.13) binds its server to every interface whatever host it is given (libuv and the classic
backend alike), and serves any client: one can list every key (`list_keys`), read and overwrite them. So the store is
given a socket bound here to the master's address (`master_listen_fd`), and every value goes through `SealedStore`:
encrypted (HMAC-SHA256 in counter mode under a fresh nonce) and authenticated (HMAC-SHA256 over the key's name, the
nonce and the ciphertext) under keys the ranks derive from the cluster secret and the gang's URL. A client without the
secret still connects, sees the keys' names and their sizes, and can delete or overwrite them; it reads no value, and
a value it writes (or copies from another key, or another gang) is refused when a rank reads or waits for it: the
rendezvous fails, naming the key, instead of taking an intruder's address; a flag it forges (`check`: ProcessGroupNCCL
polls "exception_dump" and "remote_error" in the store) reads as absent. `add` counters are not sealed (the server
adds): a client without the secret can forge them (no rendezvous key of ours is one). gloo's and NCCL's own
connections are not covered: docs/OPERATIONS.md ("What is protected, and what is not").

The store listens on the master's address, resolved once by the first rank (`master_address`: a name resolving to a
loopback address is refused; the numeric address goes in the URL the other ranks are given).
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import ipaddress
import os
import socket

import torch.distributed as dist

NONCE, TAG = 16, 32


class SealedStore(dist.Store):
    """`inner` with every value sealed under `key` (module docstring). `add` counters pass unsealed and unauthenticated
    (a counter is no secret, and one without the key can forge it; none of the rendezvous's keys is one)."""

    def __init__(self, inner: dist.Store, key: bytes):
        super().__init__()
        self.inner = inner
        self.cipher, self.mac = (hmac.digest(key, label, "sha256") for label in (b"encrypt", b"authenticate"))

    def set(self, key: str, value: bytes | str) -> None:
        """`value` sealed under a fresh nonce: nonce, tag, ciphertext."""
        value = value.encode() if isinstance(value, str) else bytes(value)
        nonce = os.urandom(NONCE)
        body = self._xor(nonce, value)
        self.inner.set(key, nonce + self._tag(key, nonce + body) + body)

    def get(self, key: str) -> bytes:
        """`key`'s value (waits for it, as the inner store's get), authenticated: ValueError naming a forged one."""
        sealed = self.inner.get(key)
        nonce, tag, body = sealed[:NONCE], sealed[NONCE : NONCE + TAG], sealed[NONCE + TAG :]
        if len(sealed) < NONCE + TAG or not hmac.compare_digest(tag, self._tag(key, nonce + body)):
            raise ValueError(f"the gang's store holds a value of {key!r} not sealed with this cluster's key "
                             "(written by a client without the cluster secret): refused")  # fmt: skip
        return self._xor(nonce, body)

    def wait(self, keys: list[str], *timeout) -> None:
        """Until every key is there, each one's value authenticated (a forged one is refused here already)."""
        self.inner.wait(keys, *timeout)
        for key in keys:
            self.get(key)

    def check(self, keys: list[str]) -> bool:
        """Whether every key is there with a value sealed under this key: one a client without the secret wrote (or
        copied) counts as absent, so it cannot raise ProcessGroupNCCL's flags (a dump, an abort)."""
        if not self.inner.check(keys):
            return False
        try:
            for key in keys:
                self.get(key)
        except ValueError:
            return False
        return True

    def add(self, key: str, amount: int) -> int:
        """The inner store's counter (unsealed: anyone reaching the store can forge it)."""
        return self.inner.add(key, amount)

    def delete_key(self, key: str) -> bool:
        """Whether `key` was there (and is no more)."""
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        """How many keys the server holds (every gang's and a stranger's alike: no secret)."""
        return self.inner.num_keys()

    def _tag(self, key: str, sealed: bytes) -> bytes:
        """The MAC of `sealed` (nonce and ciphertext) bound to the key's name: a value moved to another key fails."""
        name = key.encode()
        return hmac.digest(self.mac, len(name).to_bytes(4, "big") + name + sealed, "sha256")

    def _xor(self, nonce: bytes, data: bytes) -> bytes:
        """`data` XOR the key stream of `nonce` (HMAC-SHA256 of nonce and counter): encrypts and decrypts."""
        blocks = range(-(-len(data) // 32))
        stream = b"".join(hmac.digest(self.cipher, nonce + i.to_bytes(8, "big"), "sha256") for i in blocks)
        return bytes(a ^ b for a, b in zip(data, stream, strict=False))


def gang_key(key: bytes, url: str, purpose: str) -> bytes:
    """A key of one gang (its rendezvous `url`, which names it) for `purpose`, from the cluster's store key."""
    return hmac.digest(key, f"{purpose} {url}".encode(), hashlib.sha256)


def master_address(host: str) -> str:
    """`host`'s numeric address, resolved once (the first of getaddrinfo's answers): the store listens there and the
    other ranks are given it, never a name each might resolve to another of its addresses. A name that resolves to
    a loopback address (Debian's /etc/hosts maps a node's own name to 127.0.1.1) is refused: no other node could
    reach it. A loopback address given as such (127.0.0.1: every "node" on one host) is taken."""
    address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][4][0]
    if ipaddress.ip_address(address.split("%")[0]).is_loopback and not _numeric(host):
        raise ValueError(f"--master-addr {host!r} resolves to {address}, a loopback address: the other nodes cannot "
                         "reach the gang's store there; give the address (or a name of it) that they reach")  # fmt: skip
    return address


def _numeric(host: str) -> bool:
    """Whether `host` is an IP address as written (not a name)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def listener(host: str) -> socket.socket:
    """A TCP socket listening on `host`'s address only, on a free port."""
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.bind(address)
    sock.listen(128)
    return sock


def interface_toward(host: str) -> str:
    """The name of this node's interface whose address its packets to `host` leave from: on the master's node the
    one that holds the master's address ("lo" for loopback), on another node the one that reaches it."""
    family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)  # (a datagram socket's connect sends nothing: it asks the routing table)
        local = ipaddress.ip_address(probe.getsockname()[0].split("%")[0])
    for name, held in interface_addresses():
        if held == local:
            return name
    raise OSError(f"no network interface holds {local}, this node's address toward {host}: set GLOO_SOCKET_IFNAME "
                  "and NCCL_SOCKET_IFNAME to the interface the gang is to use")  # fmt: skip


class _IfAddrs(ctypes.Structure):
    """struct ifaddrs (getifaddrs(3)): one address of one interface, linked to the next."""


_IfAddrs._fields_ = [
    ("next", ctypes.POINTER(_IfAddrs)), ("name", ctypes.c_char_p), ("flags", ctypes.c_uint), ("addr", ctypes.c_void_p),
    ("netmask", ctypes.c_void_p), ("ifu", ctypes.c_void_p), ("data", ctypes.c_void_p),
]  # fmt: skip
_OFFSET = {socket.AF_INET: (4, 4), socket.AF_INET6: (8, 16)}  # where a sockaddr_in / sockaddr_in6 holds its address


def interface_addresses() -> list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    """Every (interface name, IP address) of this node (getifaddrs(3): aliases and IPv6 too)."""
    libc = ctypes.CDLL(None, use_errno=True)
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    found, node = [], head
    try:
        while node:
            entry = node.contents
            family = ctypes.c_ushort.from_address(entry.addr).value if entry.addr else None
            if family in _OFFSET:
                offset, size = _OFFSET[family]
                found.append((entry.name.decode(), ipaddress.ip_address(ctypes.string_at(entry.addr + offset, size))))
            node = entry.next
    finally:
        libc.freeifaddrs(head)
    return found

"""A gang's rendezvous across nodes (gpu/distributed/group.py's rendezvous, gpu/distributed/store.py) on loopback: two
gloo ranks in spawned processes meet at the sealed TCPStore and all-reduce; every socket either listens on is bound to
the master's address (127.0.0.1), none on every interface. A TCPStore client without the cluster's key connects and,
torch's TCPStore serving `list_keys` to anyone, sees the keys' names; it reads no value, and what it writes, or copies
from another key or another gang, is refused by name when a rank reads or waits for it."""

from __future__ import annotations

import datetime
import ipaddress
import multiprocessing
import os
import socket

import pytest
import torch
import torch.distributed as dist

from actors.runtime.curve import derive
from gpu.distributed.group import join, leave, rendezvous
from gpu.distributed.store import interface_addresses, interface_toward, master_address

SECRET = "the cluster secret"
KEY = derive(SECRET, "gang-store")
BOUND = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # (what rendezvous sets, unless the caller's environment did)


@pytest.fixture(autouse=True)
def unbound(monkeypatch):
    """The collectives' interface variables neither inherited from the caller (rendezvous keeps what is set) nor left
    set after the test (a rendezvous in this process sets them)."""
    for variable in BOUND:
        monkeypatch.delenv(variable, raising=False)


def listening() -> set[tuple[str, int]]:
    """The (address, port) this process's TCP sockets listen on (/proc/net/tcp and tcp6: its sockets' inodes)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # (closed meanwhile)
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # (0A: LISTEN)
                    address, port = fields[1].split(":")
                    raw = bytes.fromhex(address)  # (each 32-bit word in host order)
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                    found.add((str(ipaddress.ip_address(words)), int(port, 16)))
    return found


def rank_main(rank: int, urls, results) -> None:
    """A spawned rank: meet at the store (rank 0 makes it and sends its URL), all-reduce rank + 1, report the sum,
    the sockets this process listens on and its collectives' interface variables."""
    if rank == 0:
        store, url = rendezvous("tcp://127.0.0.1:0/gang-test", 2, True, KEY)
        urls.put(url)
    else:
        store, _ = rendezvous(urls.get(timeout=60), 2, False, KEY)
        store.set("joining/1", "")
    store.wait(["joining/1"])
    tp = join(rank, 2, store, torch.device("cpu"), timeout_s=60)
    try:
        x = tp.all_reduce(torch.tensor([rank + 1.0]))
        env = (os.environ["GLOO_SOCKET_IFNAME"], os.environ["NCCL_SOCKET_IFNAME"])
        results.put((rank, float(x), sorted(listening()), env))
        tp.broadcast(torch.zeros(1))  # (rank 0's store stays up until both reported)
    finally:
        leave()


def test_a_gang_meets_at_the_sealed_store_and_listens_on_the_master_address_only():
    ctx = multiprocessing.get_context("spawn")
    urls, results = ctx.Queue(), ctx.Queue()
    ranks = [ctx.Process(target=rank_main, args=(r, urls, results)) for r in range(2)]
    try:
        for p in ranks:
            p.start()
        got = sorted(results.get(timeout=120) for _ in ranks)
        for p in ranks:
            p.join(60)
    finally:
        for p in ranks:
            if p.is_alive():  # (a rank that never reported: no process outlives the test)
                p.terminate()
                p.join(10)
    assert [p.exitcode for p in ranks] == [0, 0]
    assert [(rank, total, env) for rank, total, _, env in got] == [(r, 3.0, ("lo", "=lo")) for r in range(2)]
    assert got[0][2], "rank 0 listens (the store, gloo)"
    assert all(address == "127.0.0.1" for _, _, addresses, _ in got for address, _ in addresses), got


def forge(raw: dist.TCPStore, key: str, value: bytes) -> None:
    """`raw.set(key, value)`, done before any client's next call (a set is not answered; a check on its connection
    is, after it)."""
    raw.set(key, value)
    assert raw.check([key])


@pytest.fixture
def gang():
    """The first rank's store, another rank's, and a plain TCPStore client of the same server (no key)."""
    first, url = rendezvous("tcp://127.0.0.1:0/gang-a", 2, True, KEY)
    other, _ = rendezvous(url, 2, False, KEY)
    host, port = url.removeprefix("tcp://").split("/")[0].split(":")
    raw = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=10))
    return first, other, raw, url


def test_a_client_without_the_key_reads_no_value_and_what_it_writes_is_refused(gang):
    first, other, raw, url = gang
    port = int(url.split(":")[2].split("/")[0])
    assert {address for address, p in listening() if p == port} == {"127.0.0.1"}  # (not "::" nor "0.0.0.0")
    other.set("rank_1", b"10.0.0.2:43121 the gloo address")
    first.wait(["rank_1"])
    assert first.get("rank_1") == b"10.0.0.2:43121 the gloo address"
    [name] = raw.list_keys()  # (torch 2.13's TCPStore lists every key to any client: the prefix is no secret)
    assert name.endswith("/rank_1") and SECRET not in name and KEY.hex() not in name
    assert b"gloo" not in raw.get(name) and b"10.0.0.2" not in raw.get(name)
    assert first.check(["rank_1"])
    forge(raw, name, b"10.6.6.6:1 an intruder's address")
    with pytest.raises(ValueError, match="'rank_1' not sealed with this cluster's key"):
        first.get("rank_1")
    assert not first.check(["rank_1"]), "a forged value is no value"
    other.set("rank_0", b"genuine")
    forge(raw, name, raw.get(name.replace("rank_1", "rank_0")))  # a genuine value, copied to another key
    with pytest.raises(ValueError, match="'rank_1' not sealed"):
        first.wait(["rank_1"])
    forge(raw, name.replace("rank_1", "loaded/1"), b"")  # (waiting is authenticated too)
    with pytest.raises(ValueError, match="'loaded/1' not sealed"):
        first.wait(["loaded/1"])


def test_another_gang_or_another_secret_opens_nothing(gang):
    first, _, raw, url = gang
    first.set("rank_0", b"genuine")
    assert first.check(["rank_0"])  # (a set is not answered: a call on the same connection orders it)
    [name] = raw.list_keys()
    port = url.split(":")[2].split("/")[0]
    host_port = f"tcp://127.0.0.1:{port}"
    for stranger in (rendezvous(f"{host_port}/gang-b", 2, False, KEY)[0],  # (another gang's keys, same server)
                     rendezvous(url, 2, False, derive("another secret", "gang-store"))[0]):  # fmt: skip
        stranger.set("rank_0", b"theirs")
        assert (
            stranger.check(["rank_0"]) and first.get("rank_0") == b"genuine"
        )  # (under another prefix: not the gang's key)
    for prefix_of_stranger in {k.split("/")[0] for k in raw.list_keys()} - {name.split("/")[0]}:
        forge(raw, f"{name.split('/')[0]}/rank_0", raw.get(f"{prefix_of_stranger}/rank_0"))
        with pytest.raises(ValueError, match="not sealed"):
            first.get("rank_0")


def test_the_collectives_bind_to_the_interface_toward_the_master():
    assert interface_toward("127.0.0.1") == "lo"
    for name, address in interface_addresses():
        if not address.is_link_local:  # (a link-local address needs its scope to be reached)
            assert interface_toward(str(address)) == name
    with pytest.raises(ValueError, match="sealed with the cluster's key"):
        rendezvous("tcp://127.0.0.1:0/gang-c", 2, True)


def test_a_flag_forged_without_the_key_is_not_raised(gang):
    """ProcessGroupNCCL's heartbeat polls its store's `check` for "exception_dump" (a dump) and reads "remote_error"
    (an abort): flags a client without the key could set under the prefix it sees in `list_keys`."""
    first, other, raw, _ = gang
    other.set("joining/1", "")
    assert other.check(["joining/1"])  # (ordered: as above)
    prefix = raw.list_keys()[0].split("/")[0]
    for flag in ("exception_dump", "remote_error"):
        forge(raw, f"{prefix}/{flag}", b"1")
        assert not first.check([flag]) and not first.check(["joining/1", flag])
    other.set("exception_dump", b"1")
    assert other.check(["exception_dump"]) and first.check(["exception_dump", "joining/1"])
    assert not first.check(["absent"])


def test_the_first_rank_resolves_the_master_once_and_refuses_a_name_for_loopback(monkeypatch):
    """The URL the other ranks are given holds the address the store listens on, not a name each could resolve to
    another address; a name resolving to loopback (Debian's hostname at 127.0.1.1) would shut every other node
    out: refused before anything listens, naming it. A loopback address given as one is taken (nodes on one host)."""
    ours = [a for _, a in interface_addresses() if a.version == 4 and not a.is_loopback and not a.is_link_local]
    if not ours:
        pytest.skip("no IPv4 address of this host but loopback")
    resolve = socket.getaddrinfo
    named = {"master.test": str(ours[0]), "self.test": "127.0.1.1"}  # (a resolver's answers, for these names)
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: resolve(named.get(host, host), *a, **k))
    _store, url = rendezvous("tcp://master.test:0/gang-d", 2, True, KEY)  # (it listens while it lives)
    port = int(url.split(":")[2].split("/")[0])
    assert url == f"tcp://{ours[0]}:{port}/gang-d" and {a for a, p in listening() if p == port} == {str(ours[0])}
    before = listening()
    for name in ("self.test", "localhost"):
        with pytest.raises(ValueError, match=f"--master-addr '{name}' resolves to .+, a loopback address"):
            rendezvous(f"tcp://{name}:0/gang-e", 2, True, KEY)
    assert listening() == before and master_address("127.0.0.1") == "127.0.0.1"


def test_a_store_that_fails_to_start_leaves_no_socket_listening():
    before = listening()
    with pytest.raises(TypeError):
        rendezvous("tcp://127.0.0.1:0/gang-f", "two", True, KEY)  # (its arguments refused: it never took the socket)
    assert listening() == before


@pytest.mark.parametrize("taken", [False, True], ids=["before it took the socket", "once it took and closed it"])
def test_a_store_that_fails_with_any_error_leaves_no_socket_and_closes_nothing_twice(monkeypatch, taken):
    """TCPStore failing with another error than TypeError, before it took the socket or (as torch 2.13 does, its
    server closing the handle it opened) after taking and closing it, the number then reused by another file."""
    reused = []

    def failing(*args, master_listen_fd, **kwargs):
        if taken:
            os.close(master_listen_fd)
            reused.append(os.open(os.devnull, os.O_RDONLY))  # (the lowest free number: the socket's)
            assert reused == [master_listen_fd]
        raise RuntimeError("The server socket has failed to listen on provided socket.")

    monkeypatch.setattr(dist, "TCPStore", failing)
    before = listening()
    with pytest.raises(RuntimeError, match="failed to listen"):
        rendezvous("tcp://127.0.0.1:0/gang-g", 2, True, KEY)
    assert listening() == before
    for fd in reused:  # (still open: not closed a second time on torch's behalf)
        os.fstat(fd)
        os.close(fd)

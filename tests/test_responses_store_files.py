"""The Responses store's files (frontend/responses_api/files.py), checked with the OS's own view of them (lstat, fstat,
inodes): the database, its -wal, its -shm and its .lock are regular files of this server's user, or the store is
refused (a 503 naming the file and why, the file left as it was) until the operator removes it; files that other
users could open before the store kept them private are rebuilt into a fresh private inode, every row kept (by a
later try if one fails); a second server on the same file is refused until the first closes it; and whatever way
they came to exist, the files end 0600 and Sluice's own directory 0700."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import sqlite3
import stat

import msgspec
import pytest

from frontend.http_base import Unavailable
from frontend.responses_api.store import ResponseStore
from tests.test_responses_store import mode, response, row_bytes, user

OTHER_UID = 54321  # (a user id of nobody on this host)


def journal(path, suffix: str):
    return path.with_name(path.name + suffix)


def foreign(target):
    """Made another user's (as root: chown), else skipped: only root can give a file away."""
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    target.touch()
    os.chown(target, OTHER_UID, OTHER_UID)


UNSAFE = {  # name -> (what a hostile user could have left there, the file it names, why it is refused)
    "the database a symlink": (lambda p, elsewhere: p.symlink_to(elsewhere), "", "is a symbolic link"),
    "its -wal a symlink": (lambda p, elsewhere: journal(p, "-wal").symlink_to(elsewhere), "-wal", "is a symbolic link"),
    "its -shm a fifo": (lambda p, elsewhere: os.mkfifo(journal(p, "-shm")), "-shm", "is not a regular file"),
    "its lock a symlink": (
        lambda p, elsewhere: journal(p, ".lock").symlink_to(elsewhere),
        ".lock",
        "is a symbolic link",
    ),
    "the database another user's": (lambda p, elsewhere: foreign(p), "", f"belongs to user id {OTHER_UID}"),
    "its -wal another user's": (
        lambda p, elsewhere: foreign(journal(p, "-wal")),
        "-wal",
        f"belongs to user id {OTHER_UID}",
    ),
}


@pytest.mark.parametrize(("plant", "suffix", "why"), UNSAFE.values(), ids=UNSAFE.keys())
async def test_a_file_that_is_not_ours_refuses_the_store(tmp_path, plant, suffix, why):
    path = tmp_path / "r.sqlite3"
    elsewhere = tmp_path / "elsewhere"  # (what a symlink points at: never opened, never changed)
    elsewhere.write_bytes(b"theirs")
    os.chmod(elsewhere, 0o644)
    plant(path, elsewhere)
    bad = journal(path, suffix)
    before = os.lstat(bad)
    store = ResponseStore(path, retry_s=0)
    with pytest.raises(Unavailable) as e:
        await store.put("resp_x", response("resp_x", "hi"), [user("hi")])
    assert e.value.status == 503 and e.value.retry_after_s == 1
    assert f"{bad} {why}" in e.value.message and "--responses-db" in e.value.message, e.value.message
    after = os.lstat(bad)
    assert (after.st_ino, after.st_uid, after.st_mode) == (before.st_ino, before.st_uid, before.st_mode)
    assert elsewhere.read_bytes() == b"theirs" and mode(elsewhere) == 0o644
    bad.unlink()  # (what the message tells the operator)
    assert await store.put("resp_x", response("resp_x", "hi"), [user("hi")])
    files = [journal(path, suffix) for suffix in ("", "-wal", "-shm")]
    assert {f.name: stat.S_IMODE(os.lstat(f).st_mode) for f in files} == {f.name: 0o600 for f in files}
    await store.close()


PRIVATE = dict.fromkeys(("r.sqlite3", "r.sqlite3-wal", "r.sqlite3-shm", "r.sqlite3.lock"), 0o600)


async def left_open(tmp_path):
    """What an older server left after a crash: the database and its -wal 0644, a row only in the -wal."""
    live, path = tmp_path / "live.sqlite3", tmp_path / "r.sqlite3"
    store = ResponseStore(live)
    assert await store.put("resp_old", response("resp_old", "kept"), [user("hi")])
    for suffix in ("", "-wal", "-shm"):  # (a copy of the live files, as a killed process leaves them)
        shutil.copyfile(journal(live, suffix), journal(path, suffix))
        os.chmod(journal(path, suffix), 0o644)
    await store.close()
    assert b"kept" not in path.read_bytes() and b"kept" in journal(path, "-wal").read_bytes()  # (in the -wal alone)
    return path


@pytest.mark.parametrize("fails", [0, 1], ids=["at once", "after a rebuild that failed"])
async def test_files_others_could_open_are_rebuilt_into_a_private_inode(tmp_path, monkeypatch, fails):
    """Also when the first rebuild fails (a full disk) once it made the files 0600: a later try does it."""
    path = await left_open(tmp_path)
    opened = {suffix: os.open(journal(path, suffix), os.O_RDONLY) for suffix in ("", "-wal")}  # (another user's)
    replace = os.replace

    def full(*args):  # (the rebuild's last step, failing once)
        monkeypatch.setattr(os, "replace", replace)
        raise OSError(errno.ENOSPC, "No space left on device")

    try:
        if fails:
            monkeypatch.setattr(os, "replace", full)
            failed = ResponseStore(path)
            with pytest.raises(Unavailable, match="No space left on device"):
                await failed.put("resp_new", response("resp_new", "new"), [user("hi")])
            await failed.close()
            assert mode(path) == 0o600 and os.fstat(opened[""]).st_nlink == 1  # (private, but the old inode still)
        rebuilt = ResponseStore(path)
        assert await rebuilt.put("resp_new", response("resp_new", "new"), [user("hi")])
        assert msgspec.json.decode((await rebuilt.response("resp_old"))[0])["output"][0]["content"][0]["text"] == "kept"
        for fd in opened.values():  # (the old inodes are no file's now: nothing stored from now on reaches them)
            assert os.fstat(fd).st_nlink == 0
        assert {f.name: mode(f) for f in tmp_path.iterdir() if f.name.startswith("r.")} == PRIVATE  # (no copy left)
        await rebuilt.close()
    finally:
        for fd in opened.values():
            os.close(fd)
    assert set(row_bytes(path)) == {"resp_old", "resp_new"}


async def test_the_files_end_private_however_they_came_to_exist(tmp_path):
    chosen = tmp_path / "chosen"  # (a directory the operator chose, --responses-db: left as it is)
    chosen.mkdir()
    os.chmod(chosen, 0o755)
    path = chosen / "responses.sqlite3"
    files = (path, journal(path, "-wal"), journal(path, "-shm"))
    with contextlib.closing(sqlite3.connect(path)) as other:
        other.execute("CREATE TABLE t (x)")
    os.chmod(path, 0o644)
    store = ResponseStore(path, 10_000, 3600.0)
    await store.open()
    assert {f.name: mode(f) for f in (chosen, *files)} == {chosen.name: 0o755} | {f.name: 0o600 for f in files}
    await store.close()
    own = ResponseStore(path, own_dir=True)  # (Sluice's own directory, the default one: made 0700)
    await own.open()
    assert own.error is None and mode(chosen) == 0o700
    await own.close()
    made = tmp_path / "made"
    umask = os.umask(0)  # (created under any umask: SQLite's own default mode is 0644 less the umask)
    try:
        fresh = ResponseStore(made / "r.sqlite3", 10_000, 3600.0)
        await fresh.open()
        created = {f.name: mode(f) for f in (made, *made.iterdir())}
    finally:
        os.umask(umask)
    await fresh.close()
    assert created == {"made": 0o700} | PRIVATE


async def test_a_second_server_on_the_same_file_shares_it_and_rebuilds_only_alone(tmp_path):
    """A rebuild would replace the files under the first one's feet (its -wal and -shm unlinked): one store alone on
    the file rebuilds it; two serve it side by side, the rebuild left pending for an open alone."""
    path = tmp_path / "r.sqlite3"
    first, second = ResponseStore(path), ResponseStore(path, retry_s=0)
    assert await first.put("resp_a", response("resp_a", "a"), [user("hi")])
    os.chmod(path, 0o644)
    files = {suffix: os.stat(journal(path, suffix)).st_ino for suffix in ("", "-wal", "-shm")}
    assert (await second.response("resp_a"))[0]  # (shared: served, not rebuilt)
    assert {suffix: os.stat(journal(path, suffix)).st_ino for suffix in files} == files and mode(path) == 0o600
    assert await first.put("resp_b", response("resp_b", "b"), [user("hi")])
    assert (await second.response("resp_b"))[0]
    await first.close()
    await second.close()
    third = ResponseStore(path)  # (alone: the pending rebuild is done, every row kept)
    assert (await third.response("resp_a"))[0] and (await third.response("resp_b"))[0]
    assert mode(path) == 0o600 and os.stat(path).st_ino != files[""]
    await third.close()


async def test_a_store_opening_waits_for_another_ones_exclusive_open_within_its_bound(tmp_path, monkeypatch):
    """Another store holds the lock exclusively (opening, rebuilding or migrating: here a bare flock stands for it):
    one opening meanwhile gets the shared lock once it is released (HTTP servers starting side by side), and past
    LOCK_WAIT_S it is refused with a 503 naming why, as before."""
    import fcntl

    from frontend.responses_api import files

    path = tmp_path / "r.sqlite3"
    seed = ResponseStore(path)
    assert await seed.put("resp_a", response("resp_a", "a"), [user("hi")])
    await seed.close()
    lock = os.open(f"{path}.lock", os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_EX)
    monkeypatch.setattr(files, "LOCK_WAIT_S", 0.05)
    refused = ResponseStore(path, retry_s=0)
    with pytest.raises(Unavailable, match="held by another server"):
        await refused.response("resp_a")
    monkeypatch.setattr(files, "LOCK_WAIT_S", 30.0)
    waiting = ResponseStore(path)
    asked = asyncio.ensure_future(waiting.response("resp_a"))
    await asyncio.wait([asked], timeout=0.2)  # (a bound on a wait that must not end: it holds as long as the lock)
    assert not asked.done()
    os.close(lock)  # (the exclusive holder is done)
    assert (await asked)[0]
    await refused.close()
    await waiting.close()

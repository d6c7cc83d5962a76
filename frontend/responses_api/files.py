"""The Responses store's files (frontend/responses_api/db.py opens the database through these).

Files: the database, its -wal, its -shm (and a -journal, if one is there) and its .lock must be regular files this
server's user owns (opened without following a symbolic link, checked with fstat) and are made 0600, or the store is
refused (`Unsafe`: the Responses calls answer 503 naming the file and why, until the operator removes it or points
--responses-db elsewhere): in a directory others can write (under /tmp), another user could otherwise create them
first and read or change what is stored. They are checked before SQLite opens them and again once it has made its
-wal and -shm (SQLite makes them with the database's mode). Files found open to other users (group or other bits:
made before the store kept them private, and perhaps held open by another user since) are rebuilt into a fresh
0600 file (VACUUM INTO a mkstemp file beside it, which reads the -wal too, renamed over the database; the old -wal
and -shm deleted): whoever opened the old ones reads nothing stored after. That rebuild is decided from the modes
found before any chmod and kept pending in the .lock file until it is done: one that fails (a full disk) is done by
a later try. The .lock is flocked while the store is open: shared, and exclusive while a store alone on the file
opens it, rebuilds or migrates it, which only a store alone on the file does (another server's open files are never
replaced under it: its rebuild waits, pending, for a later open alone); a store opening meanwhile waits for its shared
lock, up to LOCK_WAIT_S. The directory is created 0700, and made 0700 when it is Sluice's own (`own_dir`: the default,
in the cache directory), left as it is when the operator chose it.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import logging
import os
import sqlite3
import stat
import tempfile
import time
from pathlib import Path

log = logging.getLogger("sluice.http")

LOCK_WAIT_S, LOCK_TRY_S = 10.0, 0.01  # a store waits this long for another's opening, rebuild or migration


class Unsafe(OSError):
    """A store file that is not a regular file of ours, or cannot be made private: the store is refused."""


def journals(path: Path) -> list[Path]:
    """The files SQLite keeps beside the database (a -journal: while it changes to WAL, or one an older one left)."""
    return [path.with_name(path.name + suffix) for suffix in ("-wal", "-shm", "-journal")]


def take_lock(path: Path) -> tuple[int, bool]:
    """`<db>.lock`, a file of ours made 0600 as the others are, and flocked: exclusively if no other store has the
    file open (then True: this one may rebuild and migrate it), else shared, once another store that opens it (an
    HTTP server beside this one: --api-server-count), rebuilds or migrates it is done (within LOCK_WAIT_S, else an
    OSError saying so). Its descriptor."""
    fd = _private(path.with_name(path.name + ".lock"), create=True)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd, True
        except BlockingIOError:
            _shared(fd, time.monotonic() + LOCK_WAIT_S)
            return fd, False
    except BaseException as e:
        os.close(fd)
        if isinstance(e, BlockingIOError):
            raise OSError(f"{path}.lock is held by another server rebuilding or migrating the store") from None
        raise


def _shared(fd: int, deadline: float) -> None:
    """The shared flock, once the store that holds it exclusively (opening, rebuilding, migrating) is done; flock(2)
    has neither a deadline nor an event to wait on, so it is tried every LOCK_TRY_S on the store's thread until
    `deadline` (then BlockingIOError)."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(LOCK_TRY_S)


def pending(lock: int) -> int:
    """The modes of the files found open to others since the last rebuild (or'ed; 0: none), kept in the lock file
    until a rebuild is done: one that failed is done by the next try, in this process or the next."""
    return int(os.pread(lock, 16, 0) or b"0", 8)


def own(file: Path, lock: int, create: bool = False) -> None:
    """`file` checked and made 0600 (`_private`), a rebuild left pending in the lock file first if it was open to
    others: from its mode before any chmod."""
    if (fd := _private(file, create, lock)) is not None:
        os.close(fd)


def _private(file: Path, create: bool = False, lock: int | None = None) -> int | None:
    """`file` opened read-write and made 0600 (None: no such file, unless `create`: then made 0600), refused (Unsafe)
    unless it is a regular file of ours; its mode first recorded as a pending rebuild in `lock` if others could
    open it. Never follows a symbolic link; checks the file it opened (fstat)."""
    try:
        fd = os.open(file, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | (os.O_CREAT if create else 0), 0o600)
    except FileNotFoundError:
        if create:
            raise
        return None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise  # (a directory, a missing permission: the error says so)
        raise Unsafe(
            f"{file} is a symbolic link (the store follows none): remove it, or choose another --responses-db"
        ) from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unsafe(f"{file} is not a regular file: remove it, or choose another --responses-db")
        if st.st_uid != os.geteuid():
            raise Unsafe(f"{file} belongs to user id {st.st_uid}, not to this server's ({os.geteuid()}): that user "
                         "could read or change the stored responses; remove it, or choose another --responses-db")  # fmt: skip
        if lock is not None and st.st_mode & 0o077:
            modes = b"%o" % (pending(lock) | stat.S_IMODE(st.st_mode))
            os.pwrite(lock, modes, 0)
            os.ftruncate(lock, len(modes))
        try:
            os.fchmod(fd, 0o600)
        except OSError as e:
            raise Unsafe(f"{file} cannot be made mode 600: {e.strerror}") from e
    except BaseException:
        os.close(fd)
        raise
    return fd


def rebuild(path: Path, mode: int, lock: int) -> None:
    """The database copied into a fresh 0600 file renamed over it (a new inode: an old open file reads nothing
    written from now on), its -wal checkpointed into the copy, the old -wal and -shm deleted; then none pending."""
    for left in path.parent.glob(glob.escape(path.name) + ".*rebuilt"):  # (by a rebuild that was cut short)
        if left.lstat().st_uid == os.geteuid():
            left.unlink(missing_ok=True)
    fd, name = tempfile.mkstemp(".rebuilt", path.name + ".", path.parent)  # (0600, a name of its own)
    os.close(fd)
    fresh = Path(name)
    try:
        old = sqlite3.connect(path, isolation_level=None)
        try:
            old.execute("VACUUM INTO ?", (str(fresh),))
        finally:
            old.close()
        os.replace(fresh, path)
    except BaseException:
        fresh.unlink(missing_ok=True)
        raise
    for journal in journals(path):
        journal.unlink(missing_ok=True)
    os.ftruncate(lock, 0)
    log.warning("the Responses store %s: its files were open to other users (mode %o): rebuilt into a fresh 0600 "
                "file, so that whoever opened them then reads nothing stored from now on", path, mode)  # fmt: skip

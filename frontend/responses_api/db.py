"""The Responses store's SQLite side: its files, its schema and every statement. All of it runs on the store's one
thread (frontend/responses_api/store.py), never on an event loop.

One row per response, each part a call reads in a column of its own, so that a call reads (and decodes) only what
it needs:

  column        holds                                                 read by
  response      the Response object, JSON                             GET /v1/responses/{id}: its body as stored
                                                                      (never decoded), cancel of an ended one
  conversation  its input items: previous_response_id's, then its     input_items; with output, the continuation
                own (JSON)                                            of previous_response_id
  output        its output items as a continuation carries them on    the continuation
                (JSON, no logprobs: items.py `continued`)
  events        a background run's stream events (msgpack list)       GET ?stream=true
  background    1 for a background response                           cancel, GET ?stream=true
  bytes         the row's size                                        eviction

Eviction, in each write's transaction: rows older than the age bound, the oldest past the row bound, then the
oldest until the rows' bytes are within the byte budget (their sum kept by triggers in `store_bytes`, so a write
does not add them up). A database of the first schema (no `bytes` column) is migrated when it is opened, in one
transaction, row by row through the store's `clean` (what a new row goes through: its items kept with their own
keys, no logprobs in the output a continuation carries on, the row's budget); a row that cannot be cleaned (JSON
that is not, a response without output, an item of no known type) is dropped with a log line naming it.

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
a later try. The .lock is flocked while the store is open: shared, and exclusive while a store alone on the file opens it, and
through a rebuild or migration, which only a store alone on the file does (another server's open files are never replaced under
it: its rebuild waits, pending, for a later open alone). The directory is created 0700, and made 0700 when it is Sluice's own
(`own_dir`: the default, in the cache directory), left as it is when the operator chose it.
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
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("sluice.http")

WAL_LIMIT = 64 << 20  # bytes the -wal file is truncated to after a checkpoint
_TABLE = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    response BLOB NOT NULL,
    conversation BLOB NOT NULL,
    events BLOB,
    output BLOB NOT NULL DEFAULT '[]',
    background INTEGER NOT NULL DEFAULT 0,
    bytes INTEGER NOT NULL DEFAULT 0
)"""
_SCHEMA = f"""{_TABLE};
DROP INDEX IF EXISTS responses_created;
CREATE INDEX IF NOT EXISTS responses_age ON responses (created_at, bytes);
CREATE TABLE IF NOT EXISTS store_bytes (total INTEGER NOT NULL);
INSERT INTO store_bytes SELECT coalesce(sum(bytes), 0) FROM responses WHERE NOT EXISTS (SELECT 1 FROM store_bytes);
CREATE TRIGGER IF NOT EXISTS responses_added AFTER INSERT ON responses
    BEGIN UPDATE store_bytes SET total = total + new.bytes; END;
CREATE TRIGGER IF NOT EXISTS responses_removed AFTER DELETE ON responses
    BEGIN UPDATE store_bytes SET total = total - old.bytes; END;
"""
_ADD = (
    "INSERT INTO responses (id, created_at, response, conversation, output, events, background, bytes) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
_EVICT_OLD = "DELETE FROM responses WHERE created_at < ?"
_EVICT_MANY = (
    "DELETE FROM responses WHERE rowid IN (SELECT rowid FROM responses ORDER BY created_at DESC LIMIT -1 OFFSET ?)"
)
Row = tuple[tuple, bool]  # (blobs: response, conversation, output, events or None; whether it ran in the background)
Clean = Callable[[str, bytes, bytes, bytes | None], Row | None]  # a first schema's row -> its row, or None


class Unsafe(OSError):
    """A store file that is not a regular file of ours, or cannot be made private: the store is refused."""


class Locked(sqlite3.Connection):
    """A connection that holds the store's lock (`lock`: its file's descriptor) until it is closed."""

    lock = -1

    def close(self) -> None:
        super().close()
        if self.lock >= 0:
            os.close(self.lock)  # (the flock goes with it)
            self.lock = -1


def connect(path: Path, own_dir: bool, clean: Clean) -> Locked:
    """The store's database, opened (created, migrated) with private files; raises OSError or sqlite3.Error."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if own_dir:
        try:
            os.chmod(path.parent, 0o700)
        except OSError as e:  # (its files are private even so)
            log.warning("the Responses store: cannot make %s mode 700: %s", path.parent, e.strerror)
    lock, alone = _lock(path)
    try:
        for file in (path, *_journals(path)):
            _own(file, lock, create=file == path)
        if (mode := _pending(lock)) and alone:  # (else pending, for an open alone)
            _rebuild(path, mode, lock)
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, factory=Locked)
    except BaseException:
        os.close(lock)
        raise
    db.lock = lock
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # (WAL: a commit survives a crash of the process)
        db.execute(f"PRAGMA journal_size_limit={WAL_LIMIT}")
        columns = {row[1] for row in db.execute("PRAGMA table_info(responses)")}  # (a read: -wal and -shm made)
        for journal in _journals(path):
            _own(journal, lock)
        if columns and "bytes" not in columns:
            _migrate(db, path, clean)
        db.executescript(_SCHEMA)
        fcntl.flock(lock, fcntl.LOCK_SH)  # (others may open it now)
    except BaseException:
        db.close()
        raise
    return db


def _journals(path: Path) -> list[Path]:
    """The files SQLite keeps beside the database (a -journal: while it changes to WAL, or one an older one left)."""
    return [path.with_name(path.name + suffix) for suffix in ("-wal", "-shm", "-journal")]


def _lock(path: Path) -> tuple[int, bool]:
    """`<db>.lock`, a file of ours made 0600 as the others are, and flocked: exclusively if no other store has the
    file open (then True: this one may rebuild and migrate it), else shared, once another store that opens it (an
    HTTP server beside this one: --api-server-count), rebuilds or migrates it is done. Its descriptor."""
    fd = _private(path.with_name(path.name + ".lock"), create=True)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd, True
        except BlockingIOError:
            fcntl.flock(fd, fcntl.LOCK_SH)  # (on the store's thread: the calls wait for its opening meanwhile)
            return fd, False
    except BaseException:
        os.close(fd)
        raise


def _pending(lock: int) -> int:
    """The modes of the files found open to others since the last rebuild (or'ed; 0: none), kept in the lock file
    until a rebuild is done: one that failed is done by the next try, in this process or the next."""
    return int(os.pread(lock, 16, 0) or b"0", 8)


def _own(file: Path, lock: int, create: bool = False) -> None:
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
            pending = b"%o" % (_pending(lock) | stat.S_IMODE(st.st_mode))
            os.pwrite(lock, pending, 0)
            os.ftruncate(lock, len(pending))
        try:
            os.fchmod(fd, 0o600)
        except OSError as e:
            raise Unsafe(f"{file} cannot be made mode 600: {e.strerror}") from e
    except BaseException:
        os.close(fd)
        raise
    return fd


def _rebuild(path: Path, mode: int, lock: int) -> None:
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
    for journal in _journals(path):
        journal.unlink(missing_ok=True)
    os.ftruncate(lock, 0)
    log.warning("the Responses store %s: its files were open to other users (mode %o): rebuilt into a fresh 0600 "
                "file, so that whoever opened them then reads nothing stored from now on", path, mode)  # fmt: skip


def _migrate(db: sqlite3.Connection, path: Path, clean: Clean) -> None:
    """The first schema's rows into the second, each through `clean`, in one transaction (module docstring)."""
    kept = dropped = 0
    with db:
        db.execute("BEGIN")
        db.execute("ALTER TABLE responses RENAME TO first_responses")
        db.execute(_TABLE)
        for id, created_at, *blobs in db.execute(
            "SELECT id, created_at, response, conversation, events FROM first_responses"
        ):
            try:
                row = clean(id, *blobs)
            except Exception as e:  # (whatever an old row holds: that row alone is dropped)
                row = None
                log.warning("the Responses store %s: response %s dropped while migrating: %s", path, id, e)
            if row is None:
                dropped += 1
                continue
            _add(db, id, created_at, *row)
            kept += 1
        db.execute("DROP TABLE first_responses")
    log.info("the Responses store %s: migrated to its second schema (%d responses kept, %d dropped)",
             path, kept, dropped)  # fmt: skip


def _add(db: sqlite3.Connection, id: str, created_at: float, blobs: tuple, background: bool) -> None:
    db.execute(_ADD, (id, created_at, *blobs, int(background), sum(len(b) for b in blobs if b is not None)))


def insert(db: sqlite3.Connection, id: str, now: float, blobs: tuple, background: bool, bounds: dict) -> None:
    """One row, and the eviction it makes room by, in one transaction. `blobs`: (response, conversation, output,
    events or None); `bounds`: {"oldest": created_at, "max_stored": rows, "max_bytes": bytes}."""
    with db:
        db.execute("BEGIN")
        db.execute("DELETE FROM responses WHERE id = ?", (id,))  # (INSERT OR REPLACE's delete fires no trigger)
        _add(db, id, now, blobs, background)
        db.execute(_EVICT_OLD, (bounds["oldest"],))
        db.execute(_EVICT_MANY, (bounds["max_stored"],))
        (excess,) = db.execute("SELECT total - ? FROM store_bytes", (bounds["max_bytes"],)).fetchone()
        if excess > 0:  # the oldest rows that hold it
            doomed = []
            for rowid, held in db.execute("SELECT rowid, bytes FROM responses ORDER BY created_at"):
                doomed.append((rowid,))
                excess -= held
                if excess <= 0:
                    break
            db.executemany("DELETE FROM responses WHERE rowid = ?", doomed)


def select(db: sqlite3.Connection, id: str, oldest: float, *columns: str) -> tuple | None:
    """The columns of a row younger than `oldest` (None: none)."""
    return db.execute(
        f"SELECT {', '.join(columns)} FROM responses WHERE id = ? AND created_at >= ?", (id, oldest)
    ).fetchone()


def delete(db: sqlite3.Connection, id: str) -> bool:
    with db:
        db.execute("BEGIN")
        return db.execute("DELETE FROM responses WHERE id = ?", (id,)).rowcount > 0

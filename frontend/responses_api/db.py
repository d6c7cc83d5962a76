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

Files, locks and their rebuild: frontend/responses_api/files.py.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path

from frontend.responses_api import files

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
    lock, alone = files.take_lock(path)
    try:
        for file in (path, *files.journals(path)):
            files.own(file, lock, create=file == path)
        if (mode := files.pending(lock)) and alone:  # (else pending, for an open alone)
            files.rebuild(path, mode, lock)
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
        for journal in files.journals(path):
            files.own(journal, lock)
        if columns and "bytes" not in columns:
            if not alone:  # (another store has it open: the one alone on it migrates, a later try of this one)
                raise OSError(f"{path} has the first schema and another server has it open: migrated once alone")
            _migrate(db, path, clean)
        db.executescript(_SCHEMA)
        fcntl.flock(lock, fcntl.LOCK_SH)  # (others may open it now)
    except BaseException:
        db.close()
        raise
    return db


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

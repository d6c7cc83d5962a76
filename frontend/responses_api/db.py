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
does not add them up). A database of the first schema (no `bytes` column) is migrated in place when it is opened.

Files: the database, its -wal and its -shm are made 0600 however they came to exist (the database is created
0600, and SQLite creates -wal and -shm with its mode); the directory is created 0700, and made 0700 when it is
Sluice's own (`own_dir`: the default, in the cache directory), left as it is when the operator chose it.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from pathlib import Path

log = logging.getLogger("sluice.http")

WAL_LIMIT = 64 << 20  # bytes the -wal file is truncated to after a checkpoint
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    response BLOB NOT NULL,
    conversation BLOB NOT NULL,
    events BLOB,
    output BLOB NOT NULL DEFAULT '[]',
    background INTEGER NOT NULL DEFAULT 0,
    bytes INTEGER NOT NULL DEFAULT 0
);
DROP INDEX IF EXISTS responses_created;
CREATE INDEX IF NOT EXISTS responses_age ON responses (created_at, bytes);
CREATE TABLE IF NOT EXISTS store_bytes (total INTEGER NOT NULL);
INSERT INTO store_bytes SELECT coalesce(sum(bytes), 0) FROM responses WHERE NOT EXISTS (SELECT 1 FROM store_bytes);
CREATE TRIGGER IF NOT EXISTS responses_added AFTER INSERT ON responses
    BEGIN UPDATE store_bytes SET total = total + new.bytes; END;
CREATE TRIGGER IF NOT EXISTS responses_removed AFTER DELETE ON responses
    BEGIN UPDATE store_bytes SET total = total - old.bytes; END;
"""
_MIGRATE = """
BEGIN;
ALTER TABLE responses ADD COLUMN output BLOB NOT NULL DEFAULT '[]';
ALTER TABLE responses ADD COLUMN background INTEGER NOT NULL DEFAULT 0;
ALTER TABLE responses ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0;
UPDATE responses SET output = CAST(json_extract(CAST(response AS TEXT), '$.output') AS BLOB),
    background = coalesce(json_extract(CAST(response AS TEXT), '$.background'), 0);
UPDATE responses SET bytes = length(response) + length(conversation) + length(output) + coalesce(length(events), 0);
COMMIT;
"""
_EVICT_OLD = "DELETE FROM responses WHERE created_at < ?"
_EVICT_MANY = (
    "DELETE FROM responses WHERE rowid IN (SELECT rowid FROM responses ORDER BY created_at DESC LIMIT -1 OFFSET ?)"
)


def connect(path: Path, own_dir: bool) -> sqlite3.Connection:
    """The store's database, opened (created, migrated) with private files; raises OSError or sqlite3.Error."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if own_dir:
        _private(path.parent, 0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # (a directory, a missing permission: the error says so)
    try:
        _private(fd, 0o600)
    finally:
        os.close(fd)
    _private_journal(path)
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # (WAL: a commit survives a crash of the process)
        db.execute(f"PRAGMA journal_size_limit={WAL_LIMIT}")
        columns = {row[1] for row in db.execute("PRAGMA table_info(responses)")}
        if columns and "bytes" not in columns:
            db.executescript(_MIGRATE)
            log.info("the responses store %s: migrated to its second schema", path)
        db.executescript(_SCHEMA)
    except BaseException:
        db.close()
        raise
    _private_journal(path)
    return db


def _private_journal(path: Path) -> None:
    for suffix in ("-wal", "-shm"):
        journal = path.with_name(path.name + suffix)
        if journal.exists():
            _private(journal, 0o600)


def _private(target: Path | int, mode: int) -> None:
    """chmod (a path, or an open file); one we do not own is left as it is, with a warning."""
    try:
        os.chmod(target, mode)
    except OSError as e:
        log.warning("the responses store: cannot make %s mode %o: %s", target, mode, e.strerror)


def insert(db: sqlite3.Connection, id: str, now: float, blobs: tuple, background: bool, bounds: dict) -> None:
    """One row, and the eviction it makes room by, in one transaction. `blobs`: (response, conversation, output,
    events or None); `bounds`: {"oldest": created_at, "max_stored": rows, "max_bytes": bytes}."""
    size = sum(len(b) for b in blobs if b is not None)
    with db:
        db.execute("BEGIN")
        db.execute("DELETE FROM responses WHERE id = ?", (id,))  # (INSERT OR REPLACE's delete fires no trigger)
        db.execute(
            "INSERT INTO responses (id, created_at, response, conversation, output, events, background, bytes) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (id, now, *blobs, int(background), size),
        )
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

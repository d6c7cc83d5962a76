"""Ended responses in SQLite (the standard library's), so a conversation outlives the server.

One row per response, written once, when it has ended (a transaction: never half-written), with what the API
reads back: the Response object (`GET /v1/responses/{id}`), its conversation (the previous response's items, then
its own input: `input_items`, and with its output what `previous_response_id` continues) and, for background runs,
its stream events (resumed with `starting_after`, after a restart too). WAL mode: readers never wait for the
writer. Bounded: past `max_stored` rows the oldest go, and rows older than `max_age_s`, at each write.

Every call runs on the store's one thread (SQLite connections are not shared across threads), never on the event
loop: a write costs a few hundred microseconds to milliseconds (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgspec

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    response BLOB NOT NULL,      -- the Response object, JSON
    conversation BLOB NOT NULL,  -- the items before its output, JSON
    events BLOB                  -- a background run's stream events, msgpack list of SSE bytes
);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created_at);
"""


@dataclass
class Stored:
    response: dict
    conversation: list[dict]
    events: list[bytes] | None = None
    size: int = 0  # bytes of the stored conversation (as read)


class ResponseStore:
    def __init__(self, path: Path, max_stored: int, max_age_s: float):
        self.path = path
        self.max_stored = max_stored
        self.max_age_s = max_age_s
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="sluice-responses-db")
        self._db: sqlite3.Connection | None = None

    async def open(self) -> None:
        await self._run(self._open)

    async def close(self) -> None:
        await self._run(self._db.close)
        self._thread.shutdown(wait=False)

    async def put(self, id: str, stored: Stored) -> None:
        await self._run(self._put, id, stored)

    async def get(self, id: str) -> Stored | None:
        return await self._run(self._get, id)

    async def delete(self, id: str) -> bool:
        return await self._run(self._delete, id)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    # ------------------------------------------------------------ on the store's thread

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # (WAL: a commit survives a crash of the process)
        self._db.executescript(_SCHEMA)

    def _put(self, id: str, s: Stored) -> None:
        now = time.time()
        events = msgspec.msgpack.encode(s.events) if s.events is not None else None
        row = (id, now, msgspec.json.encode(s.response), msgspec.json.encode(s.conversation), events)
        with self._db:  # one transaction: the row and the eviction it makes room by
            self._db.execute("BEGIN")
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)", row)
            self._db.execute("DELETE FROM responses WHERE created_at < ?", (now - self.max_age_s,))
            self._db.execute(
                "DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created_at DESC LIMIT -1 "
                "OFFSET ?)",
                (self.max_stored,),
            )

    def _get(self, id: str) -> Stored | None:
        row = self._db.execute(
            "SELECT response, conversation, events FROM responses WHERE id = ? AND created_at >= ?",
            (id, time.time() - self.max_age_s),
        ).fetchone()
        if row is None:
            return None
        events = msgspec.msgpack.decode(row[2], type=list[bytes]) if row[2] is not None else None
        return Stored(msgspec.json.decode(row[0]), msgspec.json.decode(row[1]), events, len(row[1]))

    def _delete(self, id: str) -> bool:
        with self._db:
            self._db.execute("BEGIN")
            return self._db.execute("DELETE FROM responses WHERE id = ?", (id,)).rowcount > 0

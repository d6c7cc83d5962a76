"""Ended responses in SQLite (the standard library's), so a conversation outlives the server.

One row per response, written once, when it has ended (a transaction: never half-written), each part that a call
reads in a column of its own (frontend/responses_api/db.py): `GET /v1/responses/{id}` answers the stored Response's
bytes as they are, input_items and previous_response_id decode only the conversation (and the output items a
continuation carries on), a resumed stream only the events. WAL mode: readers never wait for the writer.

Bounded, and what is stored is only what is rendered or what the API returns (items.py keeps an item's own keys):
- a row at most `max_row_bytes` (--responses-max-bytes-per-response): a request whose stored part alone would be
  more is refused at creation (`check_size`: a 400 naming its largest field); a response whose output takes its
  row over is stored without its stream events (a background run's events cannot be replayed once it has ended),
  and if it is over even so, not at all (logged);
- the store: at most `max_stored` rows and `max_bytes` bytes (--responses-max-store-bytes), none older than
  `max_age_s`: the oldest go at each write.

Opened lazily: `open()` (the HTTP actor's, in the background) tries once and never raises; every later call tries
again while it is not open (at most every `retry_s`), so a store that could not be opened (a read-only or full disk,
a file that is not SQLite, a file that is not ours, another server rebuilding it: db.py) serves once the cause
is gone. Until then each call raises a 503 naming the store's path and error, with Retry-After (`Unavailable`): only
the Responses calls that need the store fail, chat and completions never touch it.

Every call runs on the store's one thread (SQLite connections are not shared across threads), never on the event
loop, and so does every decode of what it read (a conversation's JSON, a run's events: up to a row's budget, tens of
milliseconds that would stall every stream of the process): a write costs a few hundred microseconds to
milliseconds (docs/PERFORMANCE.md, "Robustness costs (issue 48)").
"""

from __future__ import annotations

import asyncio
import logging
import math
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from frontend.body import RequestError
from frontend.http_base import MAX_ROW_BYTES, MAX_STORE_BYTES, Unavailable
from frontend.responses_api import db
from frontend.responses_api.items import continued, kept

log = logging.getLogger("sluice.http")

_json = msgspec.json.Encoder().encode
_decode_items = msgspec.json.Decoder(list[dict]).decode
_decode_events = msgspec.msgpack.Decoder(list[bytes]).decode
_decode_response = msgspec.json.Decoder(dict).decode
_FIELDS = {"text": "text.format"}  # a Response key -> the request's field it echoes, where they differ


class ResponseStore:
    def __init__(
        self,
        path: Path,
        max_stored: int = 10_000,
        max_age_s: float = 30 * 86400.0,
        max_bytes: int = MAX_STORE_BYTES,
        max_row_bytes: int = MAX_ROW_BYTES,
        own_dir: bool = False,
        retry_s: float = 1.0,
    ):
        """`own_dir`: the directory is Sluice's own (the default location): made 0700 (db.py)."""
        self.path = path
        self.max_stored, self.max_age_s, self.max_bytes = max_stored, max_age_s, max_bytes
        self.max_row_bytes = min(max_row_bytes, max_bytes)
        self.own_dir, self.retry_s = own_dir, retry_s
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="sluice-responses-db")
        self._db: sqlite3.Connection | None = None
        self._opening = asyncio.Lock()  # one try at a time; the calls that waited see its outcome
        self._retry_at = 0.0  # (time.monotonic) the next try
        self.error: str | None = None  # why it cannot be used (None: open, or not tried yet)

    async def open(self) -> None:
        """Try to open the store now; never raises (a later call tries again)."""
        try:
            await self.ready()
        except RequestError:
            pass

    async def ready(self) -> None:
        """Open, or a 503 naming the store's path and error."""
        if self._db is None:
            async with self._opening:
                if self._db is None and time.monotonic() >= self._retry_at:
                    await self._try_open()
            if self._db is None:
                raise self._unavailable(f"cannot be used: {self.error}")

    def _unavailable(self, why: str) -> Unavailable:
        """A 503, retried after the store's next try (`retry_s`, at least a second)."""
        return Unavailable(f"the Responses store {self.path} {why}", max(1, math.ceil(self.retry_s)),
                           code="responses_store_unavailable")  # fmt: skip

    async def _try_open(self) -> None:
        try:
            self._db = await self._run(db.connect, self.path, self.own_dir, self._migrated)
        except Exception as e:  # (an OSError or sqlite3.Error mostly: whatever it is, the HTTP actor goes on)
            self._retry_at = time.monotonic() + self.retry_s
            if str(e) != self.error:
                log.error("the Responses store %s cannot be used: %s (the Responses API answers 503 until it can; "
                          "retried on later calls)", self.path, e)  # fmt: skip
            self.error = str(e)
            return
        if self.error is not None:
            log.info("the Responses store %s is open", self.path)
        self.error = None

    async def close(self) -> None:
        async with self._opening:
            if self._db is not None:
                await self._run(self._db.close)
            self._db, self._retry_at, self.error = None, float("inf"), "the server is shutting down"
        self._thread.shutdown(wait=False)

    def check_size(self, parts: dict[str, object]) -> None:
        """A 400 naming the largest of a request's `parts` (the Response's keys, "input", "previous_response_id")
        when they alone would take its row over `max_row_bytes`. Encodes them: off the event loop for large ones."""
        sizes = {_FIELDS.get(key, key): len(_json(value)) for key, value in parts.items()}
        if (total := sum(sizes.values())) > self.max_row_bytes:
            field = max(sizes, key=sizes.__getitem__)
            raise RequestError(400, f"{field}: the response would store {total} bytes ({field}: {sizes[field]}), "
                               f"more than a stored response may hold ({self.max_row_bytes} bytes: "
                               "--responses-max-bytes-per-response); store: false is not stored", field)  # fmt: skip

    async def put(self, id: str, response: dict, conversation: list[dict], events: list[bytes] | None = None) -> bool:
        """Store an ended response (its output items carried on as `continued`); False: over its row's budget."""
        return await self._call(self._put, id, response, conversation, events)

    async def response(self, id: str) -> tuple[bytes, bool] | None:
        """(the Response's JSON, whether it ran in the background), or None."""
        row = await self._call(self._select, id, "response", "background")
        return None if row is None else (row[0], bool(row[1]))

    async def conversation(self, id: str, with_output: bool = False) -> list[dict] | None:
        """Its input items (`with_output`: then its output items, as a continuation carries them on), or None."""
        return await self._call(self._conversation, id, with_output)

    async def events(self, id: str) -> tuple[bool, list[bytes] | None] | None:
        """(whether it ran in the background, its stream events if they were kept), or None."""
        return await self._call(self._events, id)

    async def delete(self, id: str) -> bool:
        return await self._call(lambda: db.delete(self._db, id))

    async def _call(self, fn, *args):
        await self.ready()
        try:
            return await self._run(fn, *args)
        except (OSError, sqlite3.Error) as e:  # (a full disk, a file changed under it: this call fails alone)
            raise self._unavailable(f"failed: {e}") from e

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    # ------------------------------------------------------------ on the store's thread

    def _put(self, id: str, response: dict, conversation: list[dict], events: list[bytes] | None) -> bool:
        row = self._row(id, response, conversation, events)
        if row is None:
            return False
        now = time.time()
        bounds = {"oldest": now - self.max_age_s, "max_stored": self.max_stored, "max_bytes": self.max_bytes}
        db.insert(self._db, id, now, *row, bounds)
        return True

    def _migrated(self, id: str, response: bytes, conversation: bytes, events: bytes | None) -> db.Row | None:
        """A row of the first schema cleaned as a new row is (db.py's migration); raises if it cannot be."""
        items = kept(_decode_items(conversation), "conversation")
        return self._row(id, _decode_response(response), items, None if events is None else _decode_events(events))

    def _row(self, id: str, response: dict, conversation: list[dict], events: list[bytes] | None) -> db.Row | None:
        """An ended response's row within its budget (module docstring); None: over it even without its events."""
        blobs = [_json(response), _json(conversation), _json(continued(response["output"]))]
        packed = msgspec.msgpack.encode(events) if events is not None else None
        size = sum(map(len, blobs))
        budget = f"its budget of {self.max_row_bytes} bytes (--responses-max-bytes-per-response)"
        if packed is not None and size + len(packed) > self.max_row_bytes:
            log.warning("[%s] stored without its %d bytes of stream events (over %s)", id, len(packed), budget)
            packed = None
        if size > self.max_row_bytes:
            log.error("[%s] not stored: its %d bytes are over %s", id, size, budget)
            return None
        return (*blobs, packed), bool(response.get("background"))

    def _conversation(self, id: str, with_output: bool) -> list[dict] | None:
        row = self._select(id, "conversation", *(["output"] if with_output else []))
        return None if row is None else [item for blob in row for item in _decode_items(blob)]

    def _events(self, id: str) -> tuple[bool, list[bytes] | None] | None:
        row = self._select(id, "background", "events")
        return None if row is None else (bool(row[0]), None if row[1] is None else _decode_events(row[1]))

    def _select(self, id: str, *columns: str) -> tuple | None:
        return db.select(self._db, id, time.time() - self.max_age_s, *columns)

"""The Responses store alone (frontend/responses_api/store.py and db.py), checked against its SQLite file as SQLite
reads it: a store that cannot be opened (a directory, a file that is not SQLite, a directory that is a file) never
raises from `open`, answers each call with a 503 naming its path and error (with Retry-After, as a call that fails
in SQLite), and serves once the cause is gone; eviction counts bytes; a row over its budget loses its events, then is
not stored; a continuation reads its items without their logprobs; what a read decodes is decoded on the store's
thread; and a database of the first schema is migrated row by row, cleaned as new rows are, its bad rows dropped.
Its files: tests/test_responses_store_files.py."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import stat
import threading
import time

import msgspec
import pytest

from frontend.body import RequestError
from frontend.http_base import Unavailable
from frontend.responses_api import store as store_module
from frontend.responses_api.store import ResponseStore

FIRST_SCHEMA = """
CREATE TABLE responses (id TEXT PRIMARY KEY, created_at REAL NOT NULL, response BLOB NOT NULL,
                        conversation BLOB NOT NULL, events BLOB);
CREATE INDEX responses_created ON responses (created_at);
"""
LOGPROB = {"token": "x", "logprob": -1.0, "bytes": [120], "top_logprobs": []}


def user(text: str) -> dict:
    return {"type": "message", "id": "msg_in", "role": "user", "content": [{"type": "input_text", "text": text}]}


def response(rid: str, text: str, background: bool = False) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": [LOGPROB]}
    item = {"type": "message", "id": "msg_out", "status": "completed", "role": "assistant", "content": [part]}
    return {"id": rid, "object": "response", "status": "completed", "background": background, "output": [item]}


def continued_output(text: str) -> dict:
    """response(..., text)'s output item as a continuation carries it on: without its logprobs."""
    part = {"type": "output_text", "text": text, "annotations": []}
    return {"type": "message", "id": "msg_out", "status": "completed", "role": "assistant", "content": [part]}


def row_bytes(path) -> dict[str, int]:
    """{id: the bytes of its blobs}, as the file holds them (whatever its schema)."""
    with contextlib.closing(sqlite3.connect(path)) as c:
        return {
            row[0]: sum(len(v) for v in row if isinstance(v, bytes)) for row in c.execute("SELECT * FROM responses")
        }


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


BROKEN = {
    "a directory": (lambda p: p.mkdir(), "Is a directory"),
    "not SQLite": (lambda p: p.write_bytes(b"not a database, " * 512), "file is not a database"),
    "its directory a file": (lambda p: p.parent.rmdir() or p.parent.write_text("x"), "File exists"),
}


@pytest.mark.parametrize(("breaks", "error"), BROKEN.values(), ids=BROKEN.keys())
async def test_an_unusable_store_is_a_503_until_it_heals(tmp_path, breaks, error):
    path = tmp_path / "cache" / "responses.sqlite3"
    path.parent.mkdir()
    breaks(path)
    store = ResponseStore(path, retry_s=0)
    await store.open()  # (never raises: the HTTP actor goes on)
    for call in (store.ready(), store.response("resp_x"), store.put("resp_x", response("resp_x", "hi"), [])):
        with pytest.raises(RequestError) as e:
            await call
        assert e.value.status == 503 and str(path) in e.value.message and error in e.value.message, e.value.message
        assert isinstance(e.value, Unavailable) and e.value.retry_after_s == 1
    if path.is_dir():
        path.rmdir()
    elif not path.parent.is_dir():
        path.parent.unlink()
    else:
        path.unlink()
    assert await store.put("resp_x", response("resp_x", "hi"), [user("hi")])  # tried again: open
    assert msgspec.json.decode((await store.response("resp_x"))[0])["output"][0]["content"][0]["text"] == "hi"
    await store.close()


async def test_eviction_keeps_the_newest_within_the_byte_budget(tmp_path):
    path = tmp_path / "r.sqlite3"
    store = ResponseStore(path, max_bytes=20_000, max_row_bytes=8_000)
    for i in range(10):
        assert await store.put(f"resp_{i}", response(f"resp_{i}", "x" * 1000), [user("y" * 1000)])
        sizes = row_bytes(path)
        assert sum(sizes.values()) <= 20_000 and f"resp_{i}" in sizes
    assert 3 <= len(sizes) < 10 and set(sizes) == {f"resp_{i}" for i in range(10 - len(sizes), 10)}
    assert await store.response("resp_0") is None
    await store.close()


async def test_a_row_over_its_budget_loses_its_events_then_is_not_stored(tmp_path):
    path = tmp_path / "r.sqlite3"
    store = ResponseStore(path, max_row_bytes=10_000)
    events = [b"event: e\ndata: " + b"e" * 1000 + b"\n\n"] * 20
    assert await store.put("resp_small", response("resp_small", "hi", True), [user("hi")], events[:2])
    assert await store.events("resp_small") == (True, events[:2])
    assert await store.put("resp_bg", response("resp_bg", "hi", True), [user("hi")], events)
    assert await store.events("resp_bg") == (True, None)  # kept without its events
    assert (await store.response("resp_bg"))[1] is True
    assert not await store.put("resp_big", response("resp_big", "x" * 20_000), [user("hi")])
    assert await store.response("resp_big") is None
    assert set(row_bytes(path)) == {"resp_small", "resp_bg"} and max(row_bytes(path).values()) <= 10_000
    await store.close()


async def test_a_continuation_reads_the_items_without_their_logprobs(tmp_path):
    store = ResponseStore(tmp_path / "r.sqlite3")
    stored = response("resp_x", "hello")
    assert await store.put("resp_x", stored, [user("hi")])
    assert await store.conversation("resp_x") == [user("hi")]
    assert await store.conversation("resp_x", with_output=True) == [user("hi"), continued_output("hello")]
    assert msgspec.json.decode((await store.response("resp_x"))[0]) == stored  # GET's: as it was, logprobs too
    await store.close()


async def test_a_call_failing_in_sqlite_is_a_503_to_retry(tmp_path):
    path = tmp_path / "r.sqlite3"
    store = ResponseStore(path)
    assert await store.put("resp_x", response("resp_x", "hi"), [user("hi")])
    with contextlib.closing(sqlite3.connect(path)) as other:  # (the file changed under the store)
        other.execute("DROP TABLE responses")
    with pytest.raises(Unavailable) as e:
        await store.response("resp_x")
    assert e.value.status == 503 and e.value.retry_after_s == 1 and "no such table" in e.value.message
    await store.close()


async def test_reads_decode_on_the_stores_thread(tmp_path, monkeypatch):
    decoded = []  # (the thread of each decode)
    for name in ("_decode_items", "_decode_events"):
        real = getattr(store_module, name)
        monkeypatch.setattr(
            store_module, name, lambda blob, real=real: decoded.append(threading.current_thread()) or real(blob)
        )
    store = ResponseStore(tmp_path / "r.sqlite3")
    events = [b"event: e\ndata: {}\n\n"]
    assert await store.put("resp_x", response("resp_x", "hi", True), [user("hi")], events)
    assert await store.conversation("resp_x", with_output=True) == [user("hi"), continued_output("hi")]
    assert await store.events("resp_x") == (True, events)
    assert len(decoded) == 3 and all(t.name.startswith("sluice-responses-db") for t in decoded), decoded
    await store.close()


async def test_a_first_schema_database_is_migrated_row_by_row(tmp_path, caplog):
    path = tmp_path / "r.sqlite3"
    stored, events = response("resp_old", "hi", True), [b"event: e\ndata: {}\n\n"]
    extra = user("hi") | {"junk": "j" * 100}  # (kept verbatim by the first schema's server)
    extra["content"][0]["x"] = "never rendered"
    rows = {
        "resp_old": (stored, [extra], msgspec.msgpack.encode(events)),
        "resp_fg": (response("resp_fg", "yo"), [user("hey")], None),
        "resp_not_a_list": (response("resp_not_a_list", "hi"), {"role": "user"}, None),
        "resp_not_json": (b"{not json", [user("hi")], None),
        "resp_no_output": ({"id": "resp_no_output", "object": "response"}, [user("hi")], None),
        "resp_bad_item": (response("resp_bad_item", "hi"), [{"type": "input_image"}], None),
        "resp_bad_events": (response("resp_bad_events", "hi", True), [user("hi")], b"\xc1"),
    }
    with contextlib.closing(sqlite3.connect(path)) as old:
        old.executescript(FIRST_SCHEMA)
        for rid, (resp, conversation, packed) in rows.items():
            blobs = [b if isinstance(b, bytes) else msgspec.json.encode(b) for b in (resp, conversation)]
            old.execute("INSERT INTO responses VALUES (?, ?, ?, ?, ?)", (rid, time.time(), *blobs, packed))
        old.commit()
    store = ResponseStore(path)
    with caplog.at_level(logging.WARNING, logger="sluice.http"):
        assert await store.response("resp_old") == (msgspec.json.encode(stored), True)  # (GET's: as it was)
    assert await store.events("resp_old") == (True, events)
    assert await store.conversation("resp_old", with_output=True) == [user("hi"), continued_output("hi")]
    assert await store.conversation("resp_fg", with_output=True) == [user("hey"), continued_output("yo")]
    assert await store.events("resp_fg") == (False, None)
    dropped = {r.getMessage().split("response ")[1].split()[0] for r in caplog.records if "dropped" in r.getMessage()}
    assert dropped == set(rows) - {"resp_old", "resp_fg"}, caplog.text
    sizes = row_bytes(path)
    assert set(sizes) == {"resp_old", "resp_fg"}
    with contextlib.closing(sqlite3.connect(path)) as c:
        counted = dict(c.execute("SELECT id, bytes FROM responses"))
        (total,) = c.execute("SELECT total FROM store_bytes").fetchone()
    assert counted == sizes and total == sum(sizes.values())
    await store.close()

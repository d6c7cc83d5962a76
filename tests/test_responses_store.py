"""The Responses store alone (frontend/responses_api/store.py and db.py), checked against its SQLite file as SQLite
reads it: a store that cannot be opened (a directory, a file that is not SQLite, a directory that is a file) never
raises from `open`, answers each call with a 503 naming its path and error, and serves once the cause is gone; the
database's directory ends 0700 and its files 0600 however they came to exist; eviction counts bytes; a row over its
budget loses its events, then is not stored; a continuation reads its items without their logprobs; and a database
of the first schema is migrated in place."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
import time

import msgspec
import pytest

from frontend.body import RequestError
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
    if path.is_dir():
        path.rmdir()
    elif not path.parent.is_dir():
        path.parent.unlink()
    else:
        path.unlink()
    assert await store.put("resp_x", response("resp_x", "hi"), [user("hi")])  # tried again: open
    assert msgspec.json.decode((await store.response("resp_x"))[0])["output"][0]["content"][0]["text"] == "hi"
    await store.close()


async def test_the_files_end_private_however_they_came_to_exist(tmp_path):
    chosen = tmp_path / "chosen"  # (a directory the operator chose, --responses-db: left as it is)
    chosen.mkdir()
    os.chmod(chosen, 0o755)
    path = chosen / "responses.sqlite3"
    files = (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm"))
    with contextlib.closing(sqlite3.connect(path)) as other:  # (a WAL database open elsewhere: its -wal and -shm exist)
        other.execute("PRAGMA journal_mode=WAL")
        other.execute("CREATE TABLE t (x)")
        for f in files:
            os.chmod(f, 0o644)
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
    assert created == {"made": 0o700} | dict.fromkeys(("r.sqlite3", "r.sqlite3-wal", "r.sqlite3-shm"), 0o600)


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
    part = {"type": "output_text", "text": "hello", "annotations": []}
    output = {"type": "message", "id": "msg_out", "status": "completed", "role": "assistant", "content": [part]}
    assert await store.conversation("resp_x") == [user("hi")]
    assert await store.conversation("resp_x", with_output=True) == [user("hi"), output]
    assert msgspec.json.decode((await store.response("resp_x"))[0]) == stored  # GET's: as it was, logprobs too
    await store.close()


async def test_a_first_schema_database_is_migrated(tmp_path):
    path = tmp_path / "r.sqlite3"
    stored, conversation, events = response("resp_old", "hi", True), [user("hi")], [b"event: e\ndata: {}\n\n"]
    blobs = (msgspec.json.encode(stored), msgspec.json.encode(conversation), msgspec.msgpack.encode(events))
    with contextlib.closing(sqlite3.connect(path)) as old:
        old.executescript(FIRST_SCHEMA)
        old.execute("INSERT INTO responses VALUES (?, ?, ?, ?, ?)", ("resp_old", time.time(), *blobs))
        old.commit()
    store = ResponseStore(path)
    assert await store.response("resp_old") == (blobs[0], True)
    assert await store.events("resp_old") == (True, events)
    assert await store.conversation("resp_old", with_output=True) == conversation + stored["output"]
    with contextlib.closing(sqlite3.connect(path)) as c:
        (counted,) = c.execute("SELECT bytes FROM responses").fetchone()
    assert counted == row_bytes(path)["resp_old"]
    await store.close()

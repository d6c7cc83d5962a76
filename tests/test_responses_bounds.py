"""The Responses API's store and background runs, bounded, on the HTTP process over the fake engine (a server of this
module's each: `broken`'s store path is a directory, `bounded` has small budgets): a store that cannot be opened
costs only the Responses calls that need it (a 503 naming its path and error, with Retry-After; chat, completions
and store: false responses are served); a request whose stored part alone is over a row's budget is a 400 naming
the field; what is never rendered is not stored (the SQLite file holds none of it); eviction keeps the rows' bytes
(as SQLite counts them) within the store's budget; background runs past --max-background-responses are 429s with
Retry-After, counted by the gauge sluice:num_background_responses."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3

import openai
import pytest

from frontend.responses_api.endpoint import BACKGROUND_RETRY_S
from tests.conftest import fake_server_of
from tests.test_http_faults import held_request
from tests.test_responses_background import _ended, until
from tests.test_responses_store import row_bytes

ROW, STORE = 64 << 10, 200 << 10


@pytest.fixture(scope="module")
async def broken(tiny_model_dir, tmp_path_factory):
    db = tmp_path_factory.mktemp("broken-store")  # a directory where the database should be
    async with fake_server_of(tiny_model_dir, responses_db=str(db)) as handle:
        yield handle, str(db)


@pytest.fixture(scope="module")
async def bounded(tiny_model_dir, tmp_path_factory):
    db = tmp_path_factory.mktemp("bounded-store") / "responses.sqlite3"
    async with fake_server_of(tiny_model_dir, responses_db=str(db), responses_max_bytes_per_response=ROW,
                              responses_max_store_bytes=STORE, max_background_responses=2) as handle:  # fmt: skip
        yield handle, db


def raw_row(db, rid: str) -> bytes:
    with contextlib.closing(sqlite3.connect(db)) as c:
        return b"".join(x or b"" for x in c.execute("SELECT * FROM responses WHERE id = ?", (rid,)).fetchone()[2:6])


async def test_an_unopenable_store_costs_only_the_responses_calls(broken):
    server, db = broken
    calls = [
        ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2}),
        ("POST", "/v1/responses", {"input": "hi", "store": False, "previous_response_id": "resp_x"}),
        ("GET", "/v1/responses/resp_x", None),
        ("GET", "/v1/responses/resp_x/input_items", None),
        ("DELETE", "/v1/responses/resp_x", None),
    ]
    async with server.session() as s:
        for method, path, body in calls:
            async with s.request(method, path, json=body) as resp:
                error = (await resp.json())["error"]
            assert resp.status == 503 and db in error["message"] and "Is a directory" in error["message"], error
            assert resp.headers["Retry-After"] == "1"  # (the store tries again at the next call a second on)
        for path, body in [
            ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "store": False}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ]:
            async with s.post(path, json=body) as resp:
                assert resp.status == 200, await resp.text()


async def test_a_request_storing_too_much_is_refused_naming_the_field(bounded):
    server, _ = bounded
    async with server.session() as s:
        async with s.post("/v1/responses", json={"input": "hi", "user": "u" * ROW}) as resp:
            error = (await resp.json())["error"]
        assert resp.status == 400 and error["param"] == "user", error
        body = {"input": "hi", "user": "u" * ROW, "store": False, "max_output_tokens": 2}  # (nothing stored)
        async with s.post("/v1/responses", json=body) as resp:
            assert resp.status == 200


async def test_what_is_never_rendered_is_not_stored(bounded):
    server, db = bounded
    junk = "j" * (ROW // 2)
    items = [
        {"role": "user", "id": "msg_mine", "junk": junk, "content": [{"type": "input_text", "text": "hi", "x": junk}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": junk}],
         "encrypted_content": junk},
    ]  # fmt: skip
    client = server.client()
    r = await client.responses.create(model="", input=items, max_output_tokens=2)
    assert r.status == "incomplete" and r.output_text == "w0 w1"
    assert b"jjjj" not in raw_row(db, r.id) and row_bytes(db)[r.id] < 4096
    listed = await client.responses.input_items.list(r.id, order="asc")
    assert [i.model_dump(exclude_none=True) for i in listed.data] == [
        {"type": "message", "id": "msg_mine", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ]
    again = await client.responses.create(model="", input="and?", previous_response_id=r.id, max_output_tokens=2)
    assert again.status == "incomplete"


async def test_eviction_keeps_the_store_within_its_bytes(bounded):
    server, db = bounded
    client = server.client()
    ids = [(await client.responses.create(model="", input="hi", user="u" * (ROW // 2), max_output_tokens=1)).id
           for _ in range(2 * STORE // ROW + 2)]  # fmt: skip
    sizes = row_bytes(db)
    assert sum(sizes.values()) <= STORE and ids[-1] in sizes and ids[0] not in sizes
    assert (await client.responses.retrieve(ids[-1])).user == "u" * (ROW // 2)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(ids[0])


async def test_background_runs_are_capped_and_counted(bounded):
    server, _ = bounded
    engine = server.engine
    engine.added.clear()
    engine.hold = True
    client = server.client()
    try:
        runs = [await client.responses.create(model="", input="hi", background=True, max_output_tokens=5)
                for _ in range(2)]  # fmt: skip
        with pytest.raises(openai.RateLimitError) as e:
            await client.responses.create(model="", input="hi", background=True, max_output_tokens=5)
        assert e.value.status_code == 429 and e.value.body["param"] == "background", e.value.body
        assert e.value.response.headers["Retry-After"] == str(BACKGROUND_RETRY_S)
        assert e.value.body["type"] == "rate_limit_error" and "--max-background-responses" in e.value.body["message"]
        assert len(engine.added) == 2
        assert await server.metric("sluice:num_background_responses") == 2
        engine.finish(await held_request(server, 0), "length", text="w0", token_ids=[100])
        await until(lambda: _ended(client, runs[0].id))
        await server.wait_metrics({("sluice:num_background_responses", ()): 1})
        third = await client.responses.create(model="", input="hi", background=True, max_output_tokens=5)
        assert third.status == "queued"
    finally:
        engine.hold = False
        for rid in list(engine.live):
            engine.finish(rid, "length", text="w0", token_ids=[100])
    await server.wait_metrics({("sluice:num_background_responses", ()): 0})
    await asyncio.gather(*(until(lambda r=r: _ended(client, r)) for r in (runs[1].id, third.id)))

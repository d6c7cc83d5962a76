"""The HTTP side of the cancellation protocol, end to end: the real HTTP process against a fake
engine in the test process (tests.fake_engine), which injects the faults a real engine and
detokenizer only produce by chance: stale outputs, unknown ids, duplicates, gaps, lost acks, deaths."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import openai
import pytest

from messages.wire import ActorDown, ActorUp, Finished, TextDelta, TextOutputs
from tests.waits import eventually

STREAM = {"prompt": "hi", "max_tokens": 50, "stream": True}


async def held_request(fake, i: int = 0) -> str:
    """The engine id of the i-th request the fake received in this test (no output while `hold` is on)."""
    return (await fake.engine.wait_added(i)).request_id


def events(raw: bytes) -> list:
    assert raw.endswith(b"data: [DONE]\n\n")
    return [json.loads(e[6:]) for e in raw.split(b"\n\n")[:-2]]


def key(name: str, **labels) -> tuple:
    return name, tuple(sorted(labels.items()))


async def test_api_key_is_required_on_the_api_only(fake):
    async with aiohttp.ClientSession(fake.url) as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": fake.api_key}):
            async with s.post("/v1/completions", json={"prompt": "hi"}, headers=headers) as resp:
                assert resp.status == 401
                assert (await resp.json())["error"]["code"] == "invalid_api_key"
        for path in ("/v1/models", "/score", "/rerank", "/v2/rerank", "/classify"):  # (pooling's too, outside /v1)
            async with s.request("GET" if path == "/v1/models" else "POST", path, json={}) as resp:
                assert resp.status == 401, path
        async with s.get("/health") as resp:
            assert resp.status == 200
    async with openai.AsyncOpenAI(base_url=f"{fake.url}/v1", api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()
    out = await fake.client().completions.create(model=None, prompt="hi", max_tokens=3)
    assert out.choices[0].text == "w0 w1 w2" and out.choices[0].finish_reason == "length"


async def test_outputs_for_unknown_ids_are_counted_violations(fake):
    unknown = key("sluice:protocol_violations_total", actor="http", kind="unknown_id")
    before = (await fake.metrics()).get(unknown, 0.0)
    delta = TextDelta(request_id="ghost-0", seq=0, text="boo", token_ids=[1])
    fake.engine.tell(
        "http", TextOutputs(step=1, deltas=[delta], finished=[Finished(request_id="ghost-1", finish_reason="stop")])
    )
    await fake.wait_metrics({unknown: before + 2})


async def test_outputs_after_a_disconnect_are_stale_until_finished(fake):
    fake.engine.hold, fake.engine.ack_aborts = True, False
    stale = key("sluice:stale_outputs_dropped_total", actor="http")
    before = (await fake.metrics()).get(stale, 0.0)
    async with fake.session() as s:
        resp = await s.post("/v1/completions", json=STREAM)
        rid = await held_request(fake)
        fake.engine.emit(rid, "w0", [100])
        assert b'"text":"w0"' in await resp.content.readuntil(b"\n\n")
        resp.close()
    assert await fake.engine.until(
        lambda: [(a.request_id, a.reason) for a in fake.engine.aborts] == [(rid, "client")], 10
    )
    fake.engine.emit(rid, " late", [101])  # the engine ran on before it saw the Abort
    fake.engine.emit(rid, " later", [102])
    await fake.wait_metrics({stale: before + 2, key("sluice:num_tombstones", actor="http"): 1})
    fake.engine.finish(rid, "abort")
    await fake.wait_metrics({stale: before + 2, key("sluice:num_tombstones", actor="http"): 0})


async def test_an_unacknowledged_abort_is_resent_then_given_up(fake):
    fake.engine.hold, fake.engine.ack_aborts = True, False
    async with fake.session() as s:
        request = asyncio.ensure_future(s.post("/v1/completions", json={"prompt": "hi"}))
        rid = await held_request(fake)
        request.cancel()  # a non-streaming client hangs up: the handler is cancelled
    assert await fake.engine.until(lambda: len(fake.engine.aborts) == 3, 10)  # max_abort_tries, abort_timeout_s = 0.3
    assert {(a.request_id, a.reason) for a in fake.engine.aborts} == {(rid, "client")}
    await fake.wait_metrics({key("sluice:num_tombstones", actor="http"): 0})  # given up: nothing re-sends
    fake.engine.hold = False  # a later request on the same FIFO link: any Abort sent before it is in
    later = await fake.client().completions.create(model=None, prompt="hi", max_tokens=2)
    assert later.choices[0].finish_reason == "length"
    assert len(fake.engine.aborts) == 3
    assert (await fake.idle())["http"] == {"live": 0, "tombstones": 0, "responses": 0}


async def test_duplicate_outputs_are_dropped(fake):
    fake.engine.hold = True
    duplicates = key("sluice:protocol_violations_total", actor="http", kind="duplicate")
    before = (await fake.metrics()).get(duplicates, 0.0)
    async with fake.session() as s:
        request = asyncio.ensure_future(s.post("/v1/completions", json={"prompt": "hi"}))
        rid = await held_request(fake)
        for seq, text in ((0, "a"), (0, "a"), (1, "b"), (0, "a")):
            fake.engine.emit(rid, text, [100 + seq], seq=seq)
        fake.engine.finish(rid, "length", "c", [102])
        resp = await request
        assert (await resp.json())["choices"][0]["text"] == "abc"
    assert (await fake.metrics())[duplicates] == before + 2


async def test_a_gap_is_repaired_by_resuming_the_request_from_what_it_has(fake):
    """DESIGN I6 with I8: a lost delta makes the HTTP party re-submit the request as its next copy (attempt 1)
    with the tokens and text it has; the old copy's outputs still in flight are stale; the new copy's stream on."""
    fake.engine.hold = True
    stale = key("sluice:stale_outputs_dropped_total", actor="http")
    before = (await fake.metrics()).get(stale, 0.0)
    async with fake.session() as s, s.post("/v1/completions", json=STREAM) as resp:
        rid = await held_request(fake)
        fake.engine.emit(rid, "a", [100])
        fake.engine.emit(rid, "c", [102], seq=2)  # seq 1 was lost
        await held_request(fake, 1)  # the copy
        resumed = fake.engine.added[1]
        assert (resumed.request_id, resumed.attempt, resumed.resume_token_ids, resumed.resume_chars) == (
            rid,
            1,
            [100],
            1,
        )
        fake.engine.emit(rid, "x", [999], seq=3, attempt=0)  # the old copy ran on: stale
        fake.engine.emit(rid, "b", [101])
        fake.engine.finish(rid, "length", "c", [102])
        got = events(await resp.read())
    assert "".join(e["choices"][0]["text"] for e in got) == "abc" and not any("error" in e for e in got)
    assert (await fake.metrics())[stale] == before + 1
    assert (await fake.metrics())[key("sluice:request_resumes_total", actor="http", cause="lost_output")] >= 1


@pytest.mark.parametrize("dead", ["scheduler", "detokenizer"])
async def test_a_dead_actor_pauses_in_flight_requests_and_they_resume_from_their_record(fake, dead):
    """DESIGN I8 at the HTTP party: while an actor of the request path is down, in-flight streams wait (new
    requests and /health get 503); once it is back,
    every live request is re-submitted with the tokens and characters it has, and its stream goes on from there
    to a normal end: no error, nothing repeated, nothing missing."""
    fake.engine.hold, fake.engine.ack_aborts = True, False
    supervisor = fake.server.supervisor
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 50}
    async with fake.session() as s:
        stream = asyncio.ensure_future(s.post("/v1/completions", json=STREAM))
        plain = asyncio.ensure_future(s.post("/v1/chat/completions", json=chat))
        ids = [await held_request(fake, i) for i in range(2)]
        for rid in ids:
            fake.engine.emit(rid, "w0", [100])
            fake.engine.emit(rid, " w1", [101])
        supervisor.tell("http", ActorDown(actor=dead, reason="test"))
        await wait_for_status(s, "/health", 503)
        async with s.post("/v1/completions", json={"prompt": "x"}) as new:
            assert new.status == 503
        fake.engine.live.clear()  # the engine side forgets every request
        supervisor.tell("http", ActorUp(actor=dead))
        resumed = [(await held_request(fake, i)) for i in (2, 3)]
        assert sorted(resumed) == sorted(ids)
        assert all(r.resume_token_ids == [100, 101] and r.resume_chars == 5 for r in fake.engine.added[2:])
        for rid in resumed:
            fake.engine.emit(rid, " w2", [102])
            fake.engine.finish(rid, "length", text=" w3", token_ids=[103])
        got = events(await (await stream).read())
        assert "".join(e["choices"][0]["text"] for e in got if e["choices"]) == "w0 w1 w2 w3"
        assert got[-1]["choices"][0]["finish_reason"] == "length" and not any("error" in e for e in got)
        body = await (await plain).json()
        assert body["choices"][0]["message"]["content"] == "w0 w1 w2 w3"
        assert body["usage"]["completion_tokens"] == 4
    assert (await fake.metrics())[key("sluice:request_resumes_total", actor="http", cause="death")] >= 2


async def test_engine_deaths_fail_no_request_and_one_live_at_every_detokenizer_death_fails(fake):
    """The engine judges its own deaths (its flight record blames the requests of the steps it died in, and fails
    a poison alone): the HTTP party resumes a request through any number of them. One live at more than max_resumes
    (2) deaths of the detokenizer fails (a 503, to retry: the detokenizer blames nobody, so an innocent request
    fails with a poison); a request that arrived later is resumed and served."""
    fake.engine.hold = True
    supervisor = fake.server.supervisor

    async def die_and_return(actor: str) -> None:
        supervisor.tell("http", ActorDown(actor=actor, reason="test"))
        async with fake.session() as s:
            await wait_for_status(s, "/health", 503)
            fake.engine.live.clear()
            supervisor.tell("http", ActorUp(actor=actor))
            await wait_for_status(s, "/health", 200)

    async with fake.session() as s:
        poison = asyncio.ensure_future(s.post("/v1/completions", json={"prompt": "hi", "max_tokens": 50}))
        rid = await held_request(fake, 0)
        for _ in range(3):
            await die_and_return("scheduler")
        await die_and_return("detokenizer")
        await die_and_return("detokenizer")
        later = asyncio.ensure_future(s.post("/v1/completions", json=STREAM))
        assert await fake.engine.until(lambda: len(fake.engine.added) == 7, 10)
        survivor = fake.engine.added[6].request_id
        assert not poison.done()
        await die_and_return("detokenizer")
        resp = await poison
        assert resp.status == 503 and "after 2 restarts of the detokenizer" in (await resp.json())["error"]["message"]
        assert await fake.engine.until(lambda: len(fake.engine.added) == 8, 10)
        assert [a.request_id for a in fake.engine.added] == [rid] * 6 + [survivor] * 2
        fake.engine.finish(survivor, "length", text="w0", token_ids=[100])
        got = events(await (await later).read())
        assert got[-1]["choices"][0]["finish_reason"] == "length"


async def wait_for_status(session, path: str, status: int, timeout: float = 10.0) -> None:
    async def answers() -> bool:
        async with session.get(path) as resp:
            return resp.status == status

    await eventually(answers, f"{path} answering {status}", timeout, every=0.05)


async def test_shutdown_aborts_in_flight_requests_and_waits_for_them(tiny_model_dir):
    from actors.engine.config import EngineConfig
    from frontend.http_base import HttpConfig
    from frontend.launch import Server, pick_port
    from frontend.preflight import http_processes, resolve_model
    from tests.fake_engine import FakeEngine

    engine = FakeEngine()
    engine.hold = True
    http = pick_port(HttpConfig(port=0))
    model = resolve_model(str(tiny_model_dir))
    server = Server(http_processes(model, EngineConfig(model=str(model.path)), http), http, local=[engine])
    async with server, aiohttp.ClientSession(server.url) as s, s.post("/v1/completions", json=STREAM) as resp:
        assert await engine.until(lambda: engine.live, 10)
        rid = next(iter(engine.live))
        engine.emit(rid, "w0", [100])
        first = await resp.content.readuntil(b"\n\n")  # on the wire before the stop, so not coalesced with it
        stopping = asyncio.ensure_future(server.stop())
        got = events(first + await resp.read())
        await stopping
    assert [(a.request_id, a.reason) for a in engine.aborts] == [(rid, "shutdown")]
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in got] == [("w0", None), ("", "abort")]
    assert server.children["http"].exitcode == 0


async def test_a_slow_client_stalls_no_one_and_gets_its_text_coalesced(fake):
    fake.engine.hold = True
    piece = "x" * 65536
    # a client with small socket buffers that sends its request and reads nothing until the end
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    sock.connect(("127.0.0.1", fake.server.http.port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 16)
    body = json.dumps(STREAM).encode()
    head = (
        f"POST /v1/completions HTTP/1.0\r\nAuthorization: Bearer {fake.api_key}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body)
    slow_id = await held_request(fake, 0)
    for i in range(60):  # 40 MB in 60 steps: far more than the socket buffers hold, so the writer blocks
        for j in range(10):
            fake.engine.emit(slow_id, piece, [i * 10 + j])
        await asyncio.sleep(0.005)
    async with fake.session() as s:
        fast = asyncio.ensure_future(s.post("/v1/completions", json={"prompt": "hi"}))
        fast_id = await held_request(fake, 1)
        fake.engine.finish(fast_id, "length", "done", [1])
        assert (await (await fast).json())["choices"][0]["text"] == "done"
    fake.engine.finish(slow_id, "length")
    got = events((await reader.read()).split(b"\r\n\r\n", 1)[1])
    writer.close()
    texts = [e["choices"][0]["text"] for e in got]
    assert "".join(texts) == piece * 600
    assert max(map(len, texts)) > len(piece) * 300  # what piled up behind the blocked write: one event

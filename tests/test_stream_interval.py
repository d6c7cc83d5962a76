"""--stream-interval: a stream's first output goes out at once, then an SSE event only once a choice holds that many
tokens unwritten, and its end at once with the rest; a request's stream_interval (vLLM's field) overrides it. The real HTTP process over a held fake engine (tests.fake_engine),
which emits each token when the test says; the request table's wake rule without processes is below it."""

from __future__ import annotations

import json

import aiohttp

from actors.engine.config import EngineConfig
from frontend.http_base import HttpConfig
from frontend.launch import Server, pick_port
from frontend.preflight import http_processes, resolve_model
from messages.wire import Finished
from tests.fake_engine import FakeEngine
from tests.http_table_harness import delta, make_table, parsed


def text(event: bytes) -> tuple[str, str | None]:
    choice = json.loads(event.removeprefix(b"data: "))["choices"][0]
    return choice["text"], choice["finish_reason"]


async def test_events_carry_the_interval_s_tokens_after_the_first(tiny_model_dir):  # (the server's: 4, then 2)
    engine = FakeEngine()
    engine.hold = True
    http = pick_port(HttpConfig(port=0, stream_interval=4))
    model = resolve_model(str(tiny_model_dir))
    server = Server(http_processes(model, EngineConfig(model=str(model.path)), http), http, local=[engine])
    async with server, aiohttp.ClientSession(server.url) as s:
        for i, interval in enumerate((None, 2)):
            body = {"prompt": "hi", "max_tokens": 50, "stream": True, "stream_interval": interval}
            async with s.post("/v1/completions", json=body) as resp:
                await stream_in_intervals(engine, i, resp, interval or 4)


async def stream_in_intervals(engine: FakeEngine, i: int, resp: aiohttp.ClientResponse, interval: int) -> None:
    rid = (await engine.wait_added(i)).request_id
    engine.emit(rid, "w0", [100])
    assert text(await resp.content.readuntil(b"\n\n")) == ("w0", None)  # the first: at once
    for k in range(1, interval + 1):  # (fewer tokens buffered wake no one: the event holds them all)
        engine.emit(rid, f" w{k}", [100 + k])
    assert text(await resp.content.readuntil(b"\n\n")) == ("".join(f" w{k}" for k in range(1, interval + 1)), None)
    engine.emit(rid, " x", [200])
    engine.finish(rid, "length", " y", [201])  # the end: at once, with what is buffered
    assert text(await resp.content.readuntil(b"\n\n")) == (" x y", "length")
    assert await resp.content.read() == b"data: [DONE]\n\n"


def test_a_choice_wakes_its_writer_at_its_first_output_then_every_interval():
    for interval, woken in ((4, [True, False, False, False, True, False]), (1, [True] * 6)):
        table, _, _ = make_table(stream_interval=interval)
        req = table.add(parsed(n=1), "http")
        c = req.choices[0]
        seen = []
        for i in range(6):
            table.on_outputs(delta(c.engine_id, i, f"t{i}"))
            seen.append(req.wake.is_set())
            if req.wake.is_set():  # the writer runs: it takes what is buffered
                req.wake.clear()
                c.take()
        assert seen == woken, interval
        table.on_finished(Finished(request_id=c.engine_id, finish_reason="length", num_output_tokens=6))
        assert req.wake.is_set() and req.done


def test_each_choice_s_first_output_wakes_the_writer_and_held_text_counts():
    """n = 2: the second choice's first token wakes the writer too (it is not the request's first); tokens whose text
    is held back (empty deltas, never taken) count toward the interval as received."""
    table, _, _ = make_table(stream_interval=4)
    req = table.add(parsed(n=2), "http")
    a, b = req.choices
    table.on_outputs(delta(a.engine_id, 0, "t0"))
    assert req.wake.is_set()
    req.wake.clear()
    table.on_outputs(delta(b.engine_id, 0, "u0"))
    assert req.wake.is_set()
    req.wake.clear()
    a.take(), b.take()
    seen = []
    for i in range(1, 9):  # a's text held back: nothing is taken, yet it wakes the writer each 4 tokens only
        table.on_outputs(delta(a.engine_id, i, ""))
        seen.append(req.wake.is_set())
        req.wake.clear()
    assert seen == [False, False, False, True] * 2

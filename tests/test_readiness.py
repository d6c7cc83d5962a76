"""The HTTP front over the real processes while the engine cannot serve (frontend/readiness.py): it listens while
the engine loads its model and answers /health and requests 503 with Retry-After until every replica is ready (not a
queue); past the engine's restart intensity the server stays up, answers 503 with Retry-After through the back-off,
fails the requests waiting for the engine, and serves again once the engine is back; an engine SIGKILLed while it
starts is explained as the out-of-memory death it most likely is. The engine's start is held at a gate
(tests/gated_engine.py)."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import pytest

from actors.engine.config import EngineConfig
from actors.runtime import RestartPolicy, StartupError
from frontend.http_base import HttpConfig
from frontend.launch import Server, build_processes, pick_port
from frontend.readiness import LOADING_RETRY_S
from messages.names import ENGINE, HTTP
from messages.wire import Ping
from tests.cancel_harness import wait_for
from tests.conftest import ServerHandle
from tests.gated_engine import Gate

BACKOFF_S = 0.2
BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "ignore_eos": True}


def held_server(tiny_model_dir, tmp_path, gate: Gate, **kwargs) -> Server:
    engine = EngineConfig(model=str(tiny_model_dir), max_model_len=512, num_kv_blocks=64, engine_threads=1)
    http = pick_port(HttpConfig(port=0, served_model_name=["tiny"], responses_db=str(tmp_path / "r.sqlite3")))
    processes, need = build_processes(engine, http)
    gate.hold()  # (its first start)
    return Server(gate.gated(processes), http, need, **kwargs)


@pytest.fixture(scope="module")
async def loading(tiny_model_dir, tmp_path_factory):
    """A server whose engine's first start is held; its start() runs in a task."""
    tmp = tmp_path_factory.mktemp("readiness")
    gate = Gate(tmp)
    policy = RestartPolicy(max_restarts=1, window_s=60, backoff_s=BACKOFF_S, max_backoff_s=2 * BACKOFF_S)
    server = held_server(tiny_model_dir, tmp, gate, policy=policy, log_level="INFO")
    start = asyncio.ensure_future(server.start())
    yield server, start, gate
    gate.open()  # (a start still held)
    await asyncio.gather(start, return_exceptions=True)
    await server.stop()
    gate.close()


async def unavailable(s: aiohttp.ClientSession, method: str, path: str, **kw) -> tuple[int, str]:
    """A 503 with Retry-After: (its seconds, its message)."""
    async with s.request(method, path, **kw) as resp:
        assert resp.status == 503, await resp.text()
        return int(resp.headers["Retry-After"]), (await resp.json())["error"]["message"]


async def test_health_and_requests_are_503_with_retry_after_until_the_engine_has_loaded(loading, capfd):
    server, start, gate = loading
    await server.supervisor.ready[HTTP].wait()  # (the front listens; the engine is held in its start)
    assert server.state[ENGINE] == "starting" and not start.done()
    async with aiohttp.ClientSession(server.url) as s:
        for method, path, kw in [("GET", "/health", {}), ("POST", "/v1/completions", {"json": BODY})]:
            retry, message = await unavailable(s, method, path, **kw)
            assert retry == LOADING_RETRY_S and "loading the model" in message
        gate.open()
        await start
        async with s.get("/health") as resp:
            assert resp.status == 200
        async with s.post("/v1/completions", json=BODY) as resp:
            assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 3
    log = capfd.readouterr().err
    assert log.count(f"serving tiny at {server.url}") == 1
    assert log.index("listening at") < log.index("serving tiny at")


async def events(resp: aiohttp.ClientResponse) -> list[dict]:
    return [json.loads(line[6:]) async for line in resp.content if line.startswith(b"data: {")]


async def test_past_the_restart_intensity_the_front_stays_up_and_serves_once_the_engine_is_back(loading):
    """max_restarts 1: the second death of the engine is past it; its restart waits BACKOFF_S and is then held at the
    gate: meanwhile /health and requests get 503 with Retry-After, the stream in flight fails (it would wait out the
    back-off), the metrics say so; once it is Ready, it serves."""
    server, start, gate = loading
    if not start.done():  # (this test alone)
        gate.open()
    await start
    handle = ServerHandle(server, None)
    server.kill(ENGINE)  # within the intensity: restarted at once
    await wait_for(lambda: server.state[ENGINE] == "up" and ENGINE not in server.retry_at, 60, "the engine back")
    await server.supervisor.ask(HTTP, Ping())  # (its ActorUp, sent before, has been handled)
    async with aiohttp.ClientSession(server.url) as s:
        body = {**BODY, "max_tokens": 400, "stream": True}
        async with s.post("/v1/completions", json=body) as resp:
            assert (await resp.content.readline()).startswith(b"data: {")  # (in flight)
            gate.hold()
            server.kill(ENGINE)  # past the intensity
            streamed = await events(resp)
        assert "keeps failing" in streamed[-1]["error"]["message"]
        await wait_for(lambda: ENGINE in server.retry_at, 30, "the back-off planned")
        await server.supervisor.ask(HTTP, Ping())  # (its ActorDown has been handled)
        for method, path, kw in [("GET", "/health", {}), ("POST", "/v1/completions", {"json": BODY})]:
            retry, message = await unavailable(s, method, path, **kw)
            assert retry >= 1 and re.search(r"the scheduler (keeps failing|is down)", message)
        assert await handle.metric("sluice:engine_restarts_total") == 2
        assert await handle.metric("sluice:engine_restart_backoff_seconds") == BACKOFF_S
        assert not server.done.is_set()
        gate.open()
        await wait_for(lambda: server.state[ENGINE] == "up" and ENGINE not in server.retry_at, 60, "the engine back")
        await server.supervisor.ask(HTTP, Ping())
        async with s.get("/health") as resp:
            assert resp.status == 200
        async with s.post("/v1/completions", json=BODY) as resp:
            assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 3
        assert await handle.metric("sluice:engine_restart_backoff_seconds") == 0


async def test_an_engine_sigkilled_while_it_starts_is_explained_as_out_of_memory(tiny_model_dir, tmp_path):
    gate = Gate(tmp_path)
    server = held_server(tiny_model_dir, tmp_path, gate, log_level="WARNING")
    start = asyncio.ensure_future(server.start())
    try:
        await wait_for(lambda: ENGINE in server.children, 60, "the engine spawned")
        server.kill(ENGINE)
        with pytest.raises(StartupError) as e:
            await start
    finally:
        gate.close()
    text = str(e.value)
    assert "process engine was killed by SIGKILL during startup: most likely out of memory" in text
    assert re.search(r"weights take at least \d+\.\d GiB of host memory \(float32\), its KV cache \d+\.\d GiB", text)
    assert "available (MemAvailable" in text and "--dtype bfloat16" in text and "--quantization int8" in text


async def test_a_restarted_http_process_serves_once_told_the_start_has_ended(loading):
    """A new HTTP incarnation starts unready (it knows nothing yet); the supervisor tells it, once Ready, which actors
    are down and that the start has ended (ActorUp(SUPERVISOR)): it serves at once, not 503 for ever."""
    server, start, gate = loading
    if not start.done():  # (this test alone)
        gate.open()
    await start
    pid = server.pids()[HTTP]
    server.kill(HTTP)
    await wait_for(lambda: server.state[HTTP] == "up" and server.pids().get(HTTP) not in (None, pid), 60, "http back")
    await server.supervisor.ask(HTTP, Ping())  # (what it was told once Ready has been handled)
    async with aiohttp.ClientSession(server.url) as s:
        async with s.get("/health") as resp:
            assert resp.status == 200
        async with s.post("/v1/completions", json=BODY) as resp:
            assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 3

"""The HTTP front over the real processes while the engine cannot serve (frontend/readiness.py): it listens while
the engine loads its model and answers /health and requests 503 with Retry-After until every replica is ready (not a
queue); past the engine's restart intensity the server stays up, answers 503 with Retry-After through the back-off,
fails the requests waiting for the engine, and serves again once the engine is back; an engine SIGKILLed while it
starts is explained as the out-of-memory death it most likely is. The engine's start is held at a gate
(tests/gated_engine.py). Without processes, at a clock of the test's: a worker in back-off fails what its engine holds
and is routed nothing, the gauge counts the back-off down, Retry-After after it is the loading one; a front holds the
replicas of other nodes down until the door (which tells a restarted front again) says they are up."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import pytest

from actors.engine.config import EngineConfig
from actors.replica_link import Door
from actors.runtime import RestartPolicy, StartupError
from frontend.http_base import HttpConfig
from frontend.launch import Server, pick_port
from frontend.preflight import build_processes
from frontend.readiness import LOADING_RETRY_S, RESTART_RETRY_S, Readiness
from frontend.requests import RequestTable
from messages.names import ENGINE, HTTP, SUPERVISOR, replica
from messages.wire import ActorDown, ActorUp, Ping
from tests.cancel_harness import wait_for
from tests.conftest import ServerHandle
from tests.gated_engine import Gate
from tests.http_table_harness import aborts, make_table, parsed
from tests.test_routing import add

BACKOFF_S = 0.2
BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "ignore_eos": True}


def held_server(tiny_model_dir, tmp_path, gate: Gate, **kwargs) -> Server:
    cpu = {"device": "cpu", "engine_threads": 1}  # (on a GPU host too: the memory explanation's figures are the host's)
    engine = EngineConfig(model=str(tiny_model_dir), max_model_len=512, num_kv_blocks=64, **cpu)
    http = pick_port(HttpConfig(port=0, served_model_name=["tiny"], responses_db=str(tmp_path / "r.sqlite3")))
    processes, need = build_processes(engine, http)
    gate.hold()  # (its first start)
    return Server(gate.gated(processes), http, need.explanation(), **kwargs)


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


def engine_up(server: Server, dead: int | None = None) -> bool:
    """The engine is up, not waiting out a back-off, and (`dead`: the pid of one killed) a new incarnation (until the
    death is noticed the state still says up)."""
    return (
        server.state[ENGINE] == "up" and ENGINE not in server.retry_at and server.pids().get(ENGINE) not in (None, dead)
    )


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
    pid = server.pids()[ENGINE]
    server.kill(ENGINE)  # within the intensity: restarted at once
    await wait_for(lambda: engine_up(server, pid), 60, "the engine back")
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
        assert 0 <= await handle.metric("sluice:engine_restart_backoff_seconds") <= BACKOFF_S  # (the time left)
        assert not server.done.is_set()
        gate.open()
        await wait_for(lambda: engine_up(server), 60, "the engine back")
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
    assert "available (MemAvailable" in text and "--dtype bfloat16" in text and "--quantization q4_k" in text


async def test_a_restarted_http_process_serves_once_told_the_start_has_ended(loading):
    """A new HTTP incarnation starts unready (it knows nothing yet); the supervisor tells it, once Ready, which actors
    are down and that the start has ended (ActorUp(SUPERVISOR)): it serves at once, not 503 for ever."""
    server, start, gate = loading
    if not start.done():  # (this test alone)
        gate.open()
    await start
    await wait_for(lambda: engine_up(server), 60, "the engine up")  # (a test before may have left it restarting)
    pid = server.pids()[HTTP]
    server.kill(HTTP)
    await wait_for(lambda: server.state[HTTP] == "up" and server.pids().get(HTTP) not in (None, pid), 60, "http back")
    await server.supervisor.ask(HTTP, Ping())  # (what it was told once Ready has been handled)
    async with aiohttp.ClientSession(server.url) as s:
        async with s.get("/health") as resp:
            assert resp.status == 200
        async with s.post("/v1/completions", json=BODY) as resp:
            assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 3


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def readiness(replicas: int = 1, local: int | None = None) -> tuple[Readiness, RequestTable, list, Clock]:
    """A front's readiness over a request table (its sent messages recorded), started, at a clock of the test's."""
    table, _, sent = make_table(replicas=replicas)
    table.replicas.clock = clock = Clock()
    ready = Readiness(table, "http://front", ["tiny"], local)
    ready.on_up(ActorUp(actor=SUPERVISOR))
    return ready, table, sent, clock


def test_a_worker_past_its_intensity_fails_what_its_engine_holds_and_takes_nothing_until_its_back_off_ends():
    """Its worker down, a lone replica's engine holds its requests; once that worker backs off they fail (503, aborted
    in the engine), the router sends it nothing, and the gauge counts the back-off down."""
    ready, table, sent, clock = readiness()
    held = table.add(parsed(rid="cmpl-held"), "http")
    ready.on_down(ActorDown(actor="worker", retry_in_s=4.0, restarts=4))
    assert held.done and held.error.status == 503 and held.error.retry_after_s == 4
    assert aborts(sent) == [(held.choices[0].engine_id, "error")]
    assert table.replicas.route(add([1])) is None and not table.replicas.taking()
    refusal = ready.refusal()
    assert (refusal.retry_after_s, refusal.message) == (4, "the worker keeps failing: restarting in 4 s; retry later")
    assert ready.rows() == [(0, 4, 4.0)]
    clock.now = 3.0
    assert ready.rows() == [(0, 4, 1.0)] and ready.refusal().retry_after_s == 1
    clock.now = 4.5  # (restarted: the requests wait in its engine while the worker loads, as after a death at once)
    assert ready.rows() == [(0, 4, 0.0)] and ready.refusal() is None and table.replicas.route(add([1])).index == 0


def test_once_a_back_off_has_ended_a_client_is_told_to_come_back_as_while_loading():
    ready, table, _, clock = readiness()
    ready.on_down(ActorDown(actor="scheduler", retry_in_s=2.0, restarts=5))
    assert ready.refusal(health=True).retry_after_s == 2
    clock.now = 2.5  # (the scheduler's process restarted: loading the model)
    refusal = ready.refusal(health=True)
    assert refusal.retry_after_s == LOADING_RETRY_S and "loading" in refusal.message
    ready.on_down(ActorDown(actor="scheduler", reason="its restart failed", retry_in_s=0.0, restarts=6))
    assert ready.refusal().retry_after_s == RESTART_RETRY_S  # (tried again at once: not a back-off)
    ready.on_up(ActorUp(actor="scheduler"))
    assert ready.refusal(health=True) is None and not table.replicas[0].restart_at


def test_a_front_holds_remote_replicas_down_until_the_door_says_and_the_door_tells_a_restarted_front():
    """A (restarted) front starts with the replicas of other nodes down; the door tells it each one's state again when
    it is back (up ones too: it would otherwise hold them down)."""
    ready, table, _, _ = readiness(replicas=3, local=1)
    assert [r.index for r in table.replicas.serving()] == [0]
    door = Door([1, 2], HTTP, "tcp://127.0.0.1:1")
    told = []
    door.tell = lambda dst, msg: told.append((dst, msg))
    door.remote[1].up = True
    door.on_actor_up(ActorUp(actor=HTTP))
    assert {(dst, type(m).__name__, m.actor) for dst, m in told} == {
        *((HTTP, "ActorUp", a) for a in replica(1).actors),
        *((HTTP, "ActorDown", a) for a in replica(2).actors),
    }
    for _, msg in told:
        (ready.on_up if isinstance(msg, ActorUp) else ready.on_down)(msg)
    assert [r.index for r in table.replicas.serving()] == [0, 1]

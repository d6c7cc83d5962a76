"""--api-server-count 2 (frontend/http_servers.py) over the fake engine: each server serves the port's requests with
its own ledger, /metrics sums what both observed (each call counted once, proxied or not; a dead server's counts
carried on), a live Response is answered by the server running it, and server 0 alone loads LoRA adapters, the other
told what is served before the load is answered. Each server is reached through its own socket in the run
directory (what the servers proxy to each other over), so which server a call lands on is chosen, not the kernel's."""

from __future__ import annotations

import json

import aiohttp
import pytest

from messages.names import http_servers
from tests.conftest import fake_server_of
from tests.waits import eventually

COMPLETIONS = ("sluice:http_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))


@pytest.fixture(scope="module")
async def servers(tiny_model_dir, responses_db):
    async with fake_server_of(tiny_model_dir, responses_db=responses_db, api_server_count=2,
                              lora_runtime_updates=True, max_background_responses=3) as handle:  # fmt: skip
        sockets = [aiohttp.UnixConnector(path=f"{handle.server.rundir}/{name}.sock") for name in http_servers(2)]
        sessions = [aiohttp.ClientSession("http://localhost", headers=handle.headers, connector=c) for c in sockets]
        yield handle, sessions
        for s in sessions:
            await s.close()


@pytest.fixture
def fake(servers):
    handle, _ = servers
    yield servers
    handle.engine.hold = False


async def metrics_of(session: aiohttp.ClientSession) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    from frontend.metrics import BASE_LABELS

    async with session.get("/metrics") as resp:
        text = await resp.text()
    return {
        (x.name, tuple(sorted((k, v) for k, v in x.labels.items() if k not in BASE_LABELS))): x.value
        for family in text_string_to_metric_families(text)
        for x in family.samples
    }


async def complete(session: aiohttp.ClientSession, model: str) -> str:
    body = {"model": model, "prompt": "hello", "max_tokens": 3}
    async with session.post("/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return (await resp.json())["choices"][0]["text"]


async def test_each_server_serves_and_metrics_sum_both(fake):
    handle, sessions = fake
    before = [await metrics_of(s) for s in sessions]
    assert before[0].get(COMPLETIONS, 0) == before[1].get(COMPLETIONS, 0)  # (the same sum, whoever is scraped)
    added = len(handle.engine.added)
    model = handle.model_dir.name
    assert [await complete(s, model) for s in (sessions[1], sessions[0], sessions[1])] == ["w0 w1 w2"] * 3
    assert [m.client for m in handle.engine.added[added:]] == ["http.1", "http", "http.1"]
    for s in sessions:  # both servers' calls, whichever answers /metrics
        await counted(s, before[0].get(COMPLETIONS, 0) + 3)
    async with handle.session() as port:  # (the shared port)
        assert [await complete(port, model) for _ in range(2)] == ["w0 w1 w2"] * 2
    await counted(sessions[1], before[0].get(COMPLETIONS, 0) + 5)


async def counted(session: aiohttp.ClientSession, calls: float) -> None:
    """/metrics says `calls` completions (a server late to report, past ASK_S, counts as before: asked again)."""

    async def reached() -> bool:
        return (await metrics_of(session)).get(COMPLETIONS) == calls

    await eventually(reached, f"{calls} completions counted")


async def test_a_dead_server_cuts_its_proxied_streams_short_and_its_counts_are_carried_on(fake):
    handle, (zero, one) = fake
    await complete(one, handle.model_dir.name)
    calls = (await metrics_of(zero))[COMPLETIONS]  # (server 0 has server 1's report now)
    handle.engine.hold = True
    body = {"model": handle.model_dir.name, "input": "hi", "background": True, "max_output_tokens": 8}
    async with one.post("/v1/responses", json=body) as resp:
        rid = (await resp.json())["id"]
    system, old = handle.server, handle.server.pids()["http.1"]
    async with zero.get(f"/v1/responses/{rid}", params={"stream": "true"}) as resp:
        assert await resp.content.readline() == b"event: response.created\n"  # (server 1's stream, through 0)
        system.kill("http.1")
        with pytest.raises(aiohttp.ClientPayloadError):  # (cut short, as server 1's own would be: not ended)
            await resp.read()
    handle.engine.hold = False
    await eventually(lambda: system.state.get("http.1") == "up" and system.pids().get("http.1") not in (None, old),
                     "http.1 restarted")  # fmt: skip
    await eventually(lambda: _serves(one), "http.1 serving again")
    assert (await metrics_of(zero))[COMPLETIONS] == calls  # (its counts from zero again, its last ones carried)
    await complete(one, handle.model_dir.name)
    await counted(zero, calls + 1)  # (once server 0 has heard that http.1 is back: it asks it again)


async def _serves(session: aiohttp.ClientSession) -> bool:
    try:
        async with session.get("/health") as resp:
            return resp.status == 200
    except aiohttp.ClientError:
        return False


async def test_a_live_response_is_answered_by_the_server_running_it(fake):
    handle, (zero, one) = fake
    handle.engine.hold = True
    body = {"model": handle.model_dir.name, "input": "hi", "background": True, "max_output_tokens": 8}
    added = len(handle.engine.added)
    async with one.post("/v1/responses", json=body) as resp:
        assert resp.status == 200, await resp.text()
        rid = (await resp.json())["id"]
    assert rid.startswith("resp_01")  # (made by server 1)
    add = await handle.engine.wait_added(added)
    handle.engine.emit(add.request_id, "w0", [100])
    async with zero.post("/v1/responses", json={**body, "previous_response_id": rid}) as resp:
        assert resp.status == 400 and "has not ended" in (await resp.json())["error"]["message"]  # (server 1's answer)

    async def live_text() -> bool:
        async with zero.get(f"/v1/responses/{rid}") as resp:
            got = await resp.json()
        return got["status"] == "in_progress" and got["output"] and got["output"][0]["content"][0]["text"] == "w0"

    await eventually(live_text, "the live output through server 0")
    retrieved = ("sluice:http_requests_total", (("endpoint", "/v1/responses/{id}"), ("status", "200")))
    before = (await metrics_of(zero))[retrieved]
    async with zero.get(f"/v1/responses/{rid}") as resp:
        assert resp.status == 200 and (await resp.json())["id"] == rid
    assert (await metrics_of(zero))[retrieved] == before + 1  # (counted by server 0, which took it, not by 1 too)
    async with zero.post(f"/v1/responses/{rid}/cancel") as resp:
        assert resp.status == 200 and (await resp.json())["status"] == "cancelled"
    aborted = [add.request_id]  # (the Abort may reach the engine after the answer)
    await eventually(lambda: [a.request_id for a in handle.engine.aborts if a.request_id in aborted], "the abort")
    for malformed in ("resp_-1" + "0" * 30, "resp_+1" + "0" * 30, rid[:-1]):  # (answered here: unknown, not proxied)
        async with zero.get(f"/v1/responses/{malformed}") as resp:
            assert resp.status == 404
    async with zero.get(f"/v1/responses/{rid}", params={"stream": "true"}) as resp:
        events = [json.loads(line[6:]) for line in (await resp.text()).splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.cancelled" and events[-1]["response"]["id"] == rid
    async with zero.get(f"/v1/responses/{rid}/input_items") as resp:
        assert resp.status == 200 and (await resp.json())["data"][0]["content"][0]["text"] == "hi"


async def test_server_zero_loads_adapters_and_tells_the_other(fake):
    handle, (zero, one) = fake

    async def listed(session, name: str) -> bool:
        async with session.get("/v1/models") as resp:
            return name in [m["id"] for m in (await resp.json())["data"]]

    async with one.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/adapters/sql"}) as resp:
        assert resp.status == 200, await resp.text()
    assert await listed(zero, "sql") and await listed(one, "sql")  # (loaded by server 0, which told server 1 first)
    async with one.post("/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 2}) as resp:
        assert resp.status == 200, await resp.text()
    assert handle.engine.added[-1].params.lora == "digest-/adapters/sql"
    async with one.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}) as resp:
        assert resp.status == 200, await resp.text()
    assert not await listed(one, "sql")  # (told before the unload was answered)
    async with zero.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}) as resp:
        assert resp.status == 404 and (await resp.json())["error"]["param"] == "lora_name"


async def test_each_server_runs_its_share_of_the_background_responses(fake):
    handle, (zero, one) = fake
    handle.engine.hold = True
    body = {"model": handle.model_dir.name, "input": "hi", "background": True, "max_output_tokens": 8}

    async def create(session) -> tuple[int, str | None]:
        async with session.post("/v1/responses", json=body) as resp:
            return resp.status, (await resp.json()).get("id")

    made = [await create(one), await create(one)]  # (3 in all, shared out: 2 a server, rounded up)
    assert [status for status, _ in made] == [200, 200]
    assert (await create(one))[0] == 429
    made.append(await create(zero))
    assert made[-1][0] == 200
    for session, (_, rid) in zip((one, one, zero), made, strict=True):
        async with session.post(f"/v1/responses/{rid}/cancel") as resp:
            assert resp.status == 200

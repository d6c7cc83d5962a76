"""Background responses, driven token by token by the fake engine (`hold`): create returns at once `queued`; polls
see the output grow; a stream resumed from a sequence number gets exactly the events after it, live; cancel ends the
run `cancelled` through Abort (reason client) -> AbortAck with its output kept, the resumed stream ends with it, and
the stored run replays the same events; a foreground stream whose client goes away is aborted, a background one is
not. And on the real engine (tiny model): a background run cancelled mid-generation leaves every actor idle."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.test_http_faults import held_request
from tests.waits import eventually


async def until(check, timeout: float = 10.0):
    """Poll the API (the only way a client sees a background run) until `check()` returns something truthy."""
    return await eventually(check, "the background response's state", timeout)


async def test_poll_resume_cancel(fake):
    fake.engine.hold = True
    client = fake.client()
    queued = await client.responses.create(model="", input="hi", background=True, max_output_tokens=50)
    assert queued.status == "queued" and queued.background and queued.output == []
    rid = await held_request(fake)
    assert rid.startswith(queued.id)
    for i, text in enumerate(["w0", " w1"]):  # one delta event each: the next is sent once a poll saw this one
        fake.engine.emit(rid, text, [100 + i])
        polled = await until(lambda n=i: _shows(client, queued.id, f"w{n}"))
    assert polled.status == "in_progress"
    everything = []
    async with await client.responses.retrieve(queued.id, stream=True) as stream:  # from the start
        async for event in stream:
            everything.append(event)
            if event.type == "response.output_text.delta" and event.delta == " w1":
                break
    after = everything[-3].sequence_number  # resume two events back
    resumed = await client.responses.retrieve(queued.id, stream=True, starting_after=after)
    tail = []
    async for event in resumed:
        tail.append(event)
        if event.type == "response.output_text.delta" and event.delta == " w1":
            fake.engine.emit(rid, " w2", [102])
        if event.type == "response.output_text.delta" and event.delta == " w2":
            cancelled = await client.responses.cancel(queued.id)
    assert [e.sequence_number for e in tail] == list(range(after + 1, after + 1 + len(tail)))
    assert [(e.sequence_number, e.type) for e in tail[:2]] == [(e.sequence_number, e.type) for e in everything[-2:]]
    assert tail[-1].type == "response.cancelled"
    assert cancelled.status == "cancelled" and cancelled.output_text == "w0 w1 w2"
    assert cancelled.output[0].status == "incomplete"
    assert [(a.request_id, a.reason) for a in fake.engine.aborts] == [(rid, "client")]
    stored = await client.responses.retrieve(queued.id)
    assert stored.status == "cancelled" and stored.output_text == "w0 w1 w2"
    replay = [e async for e in await client.responses.retrieve(queued.id, stream=True)]
    assert [e.type for e in replay[: len(everything)]] == [e.type for e in everything]
    assert replay[-1].type == "response.cancelled" and len(replay) == after + 1 + len(tail)
    again = await client.responses.cancel(queued.id)  # ended: as it is
    assert again.status == "cancelled"


async def test_background_outlives_its_client_and_foreground_does_not(fake):
    fake.engine.hold = True
    async with fake.session() as s:
        body = {"input": "hi", "background": True, "stream": True, "max_output_tokens": 5}
        async with s.post("/v1/responses", json=body) as resp:
            assert resp.status == 200
            await resp.content.readline()  # the stream started: then the client goes
        background = await held_request(fake, 0)
        async with s.post("/v1/responses", json={**body, "background": False}) as resp:
            await resp.content.readline()
        foreground = await held_request(fake, 1)
    await until(lambda: asyncio.sleep(0, [a.request_id for a in fake.engine.aborts] == [foreground]))
    fake.engine.finish(background, "length", text="w0", token_ids=[100])
    rid = background.rsplit("-", 1)[0]
    done = await until(lambda: _ended(fake.client(), rid))
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    with pytest.raises(openai.NotFoundError):  # the foreground run whose client left is not stored
        await fake.client().responses.retrieve(foreground.rsplit("-", 1)[0])


async def _shows(client, rid: str, text: str):
    r = await client.responses.retrieve(rid)
    return r if r.output_text.endswith(text) else None


async def _ended(client, rid):
    r = await client.responses.retrieve(rid)
    return r if r.status not in ("queued", "in_progress") else None


async def test_cancel_and_stream_need_a_background_run(fake):
    client = fake.client()
    r = await client.responses.create(model="", input="hi", max_output_tokens=3)
    with pytest.raises(openai.BadRequestError) as e:
        await client.responses.cancel(r.id)
    assert e.value.body["param"] == "background"
    with pytest.raises(openai.BadRequestError):
        await client.responses.retrieve(r.id, stream=True)
    for call in (client.responses.retrieve, client.responses.cancel, client.responses.delete):
        with pytest.raises(openai.NotFoundError) as e:
            await call("resp_unknown")
        assert e.value.body["type"] == "invalid_request_error" and "not found" in e.value.body["message"]


async def test_cancel_mid_generation_leaves_the_engine_idle(server):
    client = server.client()
    r = await client.responses.create(model="", input="Count.", background=True, max_output_tokens=400,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    async with await client.responses.retrieve(r.id, stream=True) as stream:
        async for event in stream:
            if event.type == "response.output_text.delta":
                break  # generating
    cancelled = await client.responses.cancel(r.id)
    assert cancelled.status == "cancelled" and 0 < cancelled.usage.output_tokens < 400
    assert cancelled.output_text and cancelled.output[0].status == "incomplete"

    async def idle():
        details = await server.idle()
        return not any(v for d in details.values() for v in d.values())

    await until(idle, timeout=30)

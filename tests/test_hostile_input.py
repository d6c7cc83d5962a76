"""Hostile requests against the real server (issue 11): each gets a 4xx naming the field within a
bounded time, the HTTP process is not restarted, and a canary stream in flight meanwhile finishes
with exactly its undisturbed output.

BOUND_S is a liveness bound, not a performance claim: the failure it catches is an HTTP process
that tokenizes a 15 MB prompt for ~18 s while holding the GIL, misses its heartbeats and is
killed with every stream on it (scripts/bench_hostile.py measures the real times).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.canary import Canary, undisturbed

BOUND_S = 10.0
WORDS = "the quick brown fox jumps over the lazy dog "


def _chat(content: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], **fields}


# (endpoint, body, expected param); a body given as bytes is sent as is
CASES = {
    "15 MB prompt": ("completions", {"prompt": "x" * (15 << 20), "max_tokens": 4}, "prompt"),
    "12 MB of messages": ("chat/completions", _chat(WORDS * ((12 << 20) // len(WORDS))), "messages"),
    "100k messages": ("chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 100_000}, "messages"),
    "2000 prompts": ("completions", {"prompt": ["hi"] * 2000, "max_tokens": 1}, "prompt"),
    "invalid UTF-8 in a string": ("completions", b'{"prompt": "caf\xc3\x28", "max_tokens": 1}', None),
    "lone surrogate": ("completions", b'{"prompt": "a\\ud800b", "max_tokens": 1}', None),
    "50,000-deep prompt": ("completions", b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", None),
    "duplicate keys": ("completions", b'{"prompt": "hi", "max_tokens": 1, "max_tokens": 2}', None),
    "5000-digit number": ("completions", b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", None),
    "NaN": ("completions", b'{"prompt": "hi", "temperature": NaN}', None),
    "1000 stop strings of 1000 chars": ("completions", {"prompt": "hi", "stop": ["s" * 1000] * 1000}, "stop"),
    "a 5000-char stop string": ("completions", {"prompt": "hi", "stop": ["s" * 5000]}, "stop"),
    "20,000 bad words": ("completions", {"prompt": "hi", "bad_words": [f"w{i}" for i in range(20_000)]}, "bad_words"),
    "5000 logit_bias entries": ("completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(5000)}}, "logit_bias"),
    "max_tokens 10^12": ("completions", {"prompt": "hi", "max_tokens": 10**12}, "max_tokens"),
}  # fmt: skip


@pytest.fixture(scope="module")
async def baseline(server):
    return await undisturbed(server.url)


@pytest.mark.parametrize("case", list(CASES))
async def test_hostile_request_is_4xx_in_bounded_time_and_the_canary_is_intact(server, baseline, case):
    endpoint, body, param = CASES[case]
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    http_pid = server.server.pids()["http"]
    canary = Canary(server.url).start()
    await asyncio.wait_for(canary.started.wait(), BOUND_S)
    loop = asyncio.get_running_loop()
    start = loop.time()
    async with server.session() as s, s.post(f"/v1/{endpoint}", data=data) as resp:
        status, error = resp.status, (await resp.json())["error"]
    elapsed = loop.time() - start
    assert status == 400, error
    assert error["param"] == param and error["message"], error
    assert elapsed < BOUND_S
    assert await asyncio.wait_for(canary.task, 60) == baseline
    assert server.server.pids()["http"] == http_pid  # not restarted


async def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(server):
    """The length bound (characters / longest token) names the minimum token count, not the exact one."""
    async with server.session() as s, s.post("/v1/completions", json={"prompt": "x" * (1 << 20)}) as resp:
        error = (await resp.json())["error"]
    assert resp.status == 400 and "at least" in error["message"] and "characters" in error["message"]


async def test_a_non_utf8_header_is_refused_not_500(fake):
    """aiohttp hands undecodable header bytes over as surrogate escapes: the API key check must not choke."""
    reader, writer = await asyncio.open_connection(fake.server.http.host, fake.server.http.port)
    body = b'{"prompt": "hi"}'
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
    )
    status_line = await asyncio.wait_for(reader.readline(), BOUND_S)
    writer.close()
    assert status_line.split()[1] == b"401"


async def test_responses_are_counted_by_status(server):
    before = await server.metric("sluice:http_requests_total", endpoint="/v1/completions", status="400")
    async with server.session() as s, s.post("/v1/completions", data=b"{") as resp:
        assert resp.status == 400
    after = await server.metric("sluice:http_requests_total", endpoint="/v1/completions", status="400")
    assert after == before + 1


async def test_stalled_bodies_get_a_408_and_block_no_one(fake):
    """Clients that send headers and stop: each gets a 408 after body_timeout_s (2 s on this server), and while they
    hang, another large body is still read and answered (they used to hold every large-body place)."""
    host, port = fake.server.http.host, fake.server.http.port
    stalled = []
    for _ in range(5):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{" % fake.api_key.encode()
        )
        stalled.append((reader, writer))
    big = json.dumps({"prompt": "x" * 20_000, "temperature": "hot"}).encode()  # over 16 KiB: the large-body path
    async with fake.session() as s, s.post("/v1/completions", data=big) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "temperature"
    for reader, writer in stalled:
        status_line = await asyncio.wait_for(reader.readline(), BOUND_S)
        writer.close()
        assert status_line.split()[1] == b"408"

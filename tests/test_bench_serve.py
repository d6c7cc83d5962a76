"""The serving load generator against a fake OpenAI SSE server with known delays."""

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from aiohttp import web
from scipy import stats

from frontend.bench_serve import WORDS, RequestOutput, add_arguments, arrival_times, random_prompts, run, summarize
from frontend.process_cpu import cpu_report, tree_cpu

PREFILL_S = 0.02  # fake server: wait before the first token
GAP_S = 0.01  # fake server: wait between tokens


class FakeServer:
    """Streams max_tokens one-token chunks. With `faulty`, request 4k+1 gets a 500, 4k+2 an error chunk after two
    tokens, and 4k+3 a stream cut after two tokens (no [DONE])."""

    def __init__(self, faulty: bool = False, usage: bool = True):
        self.faulty, self.usage = faulty, usage
        self.requests: list[tuple[dict, dict]] = []
        self.in_flight = self.peak = 0

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        index = len(self.requests)
        self.requests.append((dict(request.headers), body))
        if self.faulty and index % 4 == 1:
            return web.json_response({"error": {"message": "engine exploded", "type": "server_error"}}, status=500)
        chat = "messages" in body
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def event(obj: dict) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await resp.write(b": keep-alive comment\n\n")
            if chat:  # role-only chunk before prefill: must not count as the first token
                await event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            await asyncio.sleep(PREFILL_S)
            for i in range(body["max_tokens"]):
                if self.faulty and index % 4 in (2, 3) and i == 2:
                    if index % 4 == 2:
                        await event({"error": {"message": "stream aborted", "type": "server_error"}})
                    return resp
                await event({"choices": [{"index": 0, "delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}]})
                await asyncio.sleep(GAP_S)
            if self.usage:
                usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": body["max_tokens"]}
                await event({"choices": [], "usage": usage})
            await resp.write(b"data: [DONE]\n\n")
        finally:
            self.in_flight -= 1
        return resp


@contextlib.asynccontextmanager
async def serve(fake: FakeServer):
    app = web.Application()
    app.router.add_get("/v1/models", fake.models)
    app.router.add_post("/v1/completions", fake.generate)
    app.router.add_post("/v1/chat/completions", fake.generate)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def bench_args(base_url: str, *extra: str) -> argparse.Namespace:
    argv = ["--base-url", base_url, "--input-len", "8", "--output-len", "5", *extra]
    return add_arguments(argparse.ArgumentParser()).parse_args(argv)


async def test_closed_loop_counts_and_latencies(tmp_path):
    fake = FakeServer()
    out_file = tmp_path / "result.json"
    async with serve(fake) as url:
        flags = ["--num-prompts", "16", "--concurrency", "4", "--warmup", "2", "--api-key", "sk-test"]
        flags += ["--server-pid", str(os.getpid())]  # (the fake serves from this process)
        result = await run(bench_args(url, *flags, "--json", str(out_file)))
    assert result["completed"] == 16 and result["failed"] == 0 and result["errors"] == []
    assert result["total_output_tokens"] == 16 * 5 and result["total_input_tokens"] == 16 * 8
    assert len(fake.requests) == 18 and fake.peak <= 4 and result["peak_concurrency"] <= 4
    for headers, body in fake.requests:
        assert headers["Authorization"] == "Bearer sk-test"
        assert body["model"] == "fake-model" and body["max_tokens"] == 5 and body["ignore_eos"] is True
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert len(body["prompt"].split()) == 8 and set(body["prompt"].split()) <= set(WORDS)
    # Generous bounds from the fake's sleeps: 20 ms prefill, 10 ms between tokens.
    assert result["ttft_ms"]["p50"] >= 10 and result["itl_ms"]["p50"] >= 5 and result["tpot_ms"]["p50"] >= 5
    assert result["e2el_ms"]["mean"] >= result["ttft_ms"]["mean"] + 4 * 5
    assert json.loads(out_file.read_text()) == result
    assert sum(v["cpu_s"] for v in result["server_cpu"].values()) > 0  # (frontend/process_cpu.py: tested below)


async def test_poisson_rate_spans_the_schedule():
    fake = FakeServer()
    async with serve(fake) as url:
        result = await run(bench_args(url, "--num-prompts", "20", "--request-rate", "100", "--seed", "3"))
    assert result["completed"] == 20 and result["total_output_tokens"] == 100
    assert result["config"]["request_rate"] == 100.0
    assert result["duration_s"] >= 20 / 100  # the last request is sent at exactly num/rate


async def test_failures_are_counted_and_reported():
    fake = FakeServer(faulty=True)
    async with serve(fake) as url:
        result = await run(bench_args(url, "--num-prompts", "8", "--concurrency", "8"))
    assert result["completed"] == 2 and result["failed"] == 6
    assert result["total_output_tokens"] == 2 * 5
    assert any("HTTP 500" in e and "engine exploded" in e for e in result["errors"])
    assert {"stream aborted", "stream ended before [DONE]"} <= set(result["errors"])

    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{s.getsockname()[1]}"
    result = await run(bench_args(dead_url, "--num-prompts", "3", "--model", "m"))
    assert result["completed"] == 0 and result["failed"] == 3 and "Connect" in result["errors"][0]


async def test_chat_endpoint_without_usage_counts_chunks():
    fake = FakeServer(usage=False)
    async with serve(fake) as url:
        result = await run(bench_args(url, "--endpoint", "/v1/chat/completions", "--num-prompts", "4"))
    assert result["completed"] == 4 and result["total_output_tokens"] == 4 * 5
    assert result["total_input_tokens"] == 4 * 8  # falls back to --input-len
    assert fake.requests[0][1]["messages"][0]["role"] == "user"
    assert result["ttft_ms"]["p50"] >= 10  # the early role-only chunk is not the first token


def test_same_seed_same_schedule_and_prompts():
    a, b = arrival_times(50, 10.0, 1.0, seed=7), arrival_times(50, 10.0, 1.0, seed=7)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, arrival_times(50, 10.0, 1.0, seed=8))
    assert np.all(np.diff(a) > 0) and a[-1] == pytest.approx(50 / 10.0)
    np.testing.assert_array_equal(arrival_times(5, float("inf"), 1.0, seed=0), np.zeros(5))
    assert random_prompts(3, 16, seed=1) == random_prompts(3, 16, seed=1) != random_prompts(3, 16, seed=2)


def test_poisson_gaps_are_exponential():
    # KS test at significance 0.01; seeded, so the outcome is fixed.
    rate, n = 20.0, 2000
    gaps = np.diff(arrival_times(n, rate, 1.0, seed=0), prepend=0.0) * rate
    assert stats.kstest(gaps, "expon").pvalue > 0.01
    bursty = np.diff(arrival_times(n, rate, 0.5, seed=0), prepend=0.0) * rate
    assert stats.kstest(bursty, "expon").pvalue < 0.01  # Gamma(0.5) arrivals are rejected as Poisson


def test_summarize_follows_vllm_definitions():
    outputs = [
        RequestOutput(success=True, ttft=0.1, latency=0.5, itl=[0.1] * 4, prompt_tokens=10, output_tokens=5),
        RequestOutput(success=True, ttft=0.2, latency=0.2, prompt_tokens=10, output_tokens=1),
        RequestOutput(error="boom"),
    ]
    result = summarize(outputs, duration=2.0, input_len=10)
    assert (result["completed"], result["failed"], result["errors"]) == (2, 1, ["boom"])
    assert result["request_throughput"] == 1.0 and result["output_throughput"] == 3.0
    assert result["total_token_throughput"] == (20 + 6) / 2.0
    assert result["tpot_ms"]["mean"] == pytest.approx(100.0)  # (500 - 100) / (5 - 1); 1-token request excluded
    assert result["itl_ms"]["p50"] == pytest.approx(100.0) and result["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert result["e2el_ms"]["p99"] == pytest.approx(500.0, rel=0.01)


LEAF = """import resource, sys
while resource.getrusage(resource.RUSAGE_SELF).ru_utime < 0.2:
    pass
u = resource.getrusage(resource.RUSAGE_SELF)
print(u.ru_utime + u.ru_stime, flush=True)
sys.stdin.read()
"""
ROOT = """import resource, subprocess, sys
leaf = subprocess.Popen(["spin-leaf", "-c", sys.argv[1]], executable=sys.argv[2], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, text=True)  # (argv[0] is a title: sys.executable is unknown)
leaf_s = leaf.stdout.readline().strip()
u = resource.getrusage(resource.RUSAGE_SELF)
print(leaf_s, u.ru_utime + u.ru_stime, flush=True)
sys.stdin.read()
leaf.stdin.close()
leaf.wait()
"""


def test_server_cpu_matches_each_process_own_count():
    """A root process and its child (a spinner), titled by argv[0]: /proc's CPU per process is what each counts itself
    (getrusage), within /proc's 10 ms ticks; a report counts each process's own difference."""
    argv = ["spin-root", "-c", ROOT, LEAF, sys.executable]
    root = subprocess.Popen(argv, executable=sys.executable, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        leaf_s, root_s = map(float, root.stdout.readline().split())
        reading = tree_cpu(root.pid)
    finally:
        root.stdin.close()
        root.wait()
    cpu = dict(reading.values())
    assert len(reading) == 2 and set(cpu) == {"spin-root", "spin-leaf"}
    assert cpu["spin-leaf"] == pytest.approx(leaf_s, abs=0.03) and cpu["spin-root"] == pytest.approx(root_s, abs=0.03)
    leaf = next(key for key, (title, _) in reading.items() if title == "spin-leaf")
    before = {leaf: ("spin-leaf", 0.1), (1, 0): ("spin-root", 9.0)}  # (a spin-root since gone: counts no more)
    report = cpu_report(before, reading, seconds=2.0, tokens=1000)
    assert list(report) == ["spin-leaf", "spin-root"]  # busiest first; the new spin-root counts from 0
    assert report["spin-leaf"]["cpu_s"] == pytest.approx(cpu["spin-leaf"] - 0.1)
    assert report["spin-leaf"]["cores"] == pytest.approx((cpu["spin-leaf"] - 0.1) / 2.0)
    assert report["spin-root"]["us_per_token"] == pytest.approx(cpu["spin-root"] * 1e3)

"""A gang across two "nodes" on loopback (actors/engine/gang_nodes.py): node 0 serves with --nnodes 2 and its
leader, a second launcher runs `sluice serve --headless --node-rank 1` with rank 1; the openai client's greedy
completions equal the one-device server's (the `server` fixture: the same checkpoint). A headless node with the wrong
cluster secret is refused (its handshake fails: it exits with code 2 saying so), and the gang serves on, both ranks
up in /metrics."""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import pytest

from actors.engine.config import EngineConfig
from actors.runtime.curve import SECRET_ENV
from frontend.http_base import HttpConfig
from frontend.launch import start_server
from tests.conftest import ServerHandle

PROMPTS = ["The capital of France is", "def fib(n):", "1, 2, 3, 4,"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def headless(model_dir, port: int, secret: str) -> asyncio.subprocess.Process:
    argv = [
        "-m",
        "frontend.cli",
        "serve",
        str(model_dir),
        "--headless",
        "-tp",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
    ]
    argv += ["--master-port", str(port), "--engine-threads", "1", "--log-level", "INFO"]
    env = {**os.environ, SECRET_ENV: secret}
    return await asyncio.create_subprocess_exec(sys.executable, *argv, env=env, stderr=asyncio.subprocess.PIPE)


async def completions(handle: ServerHandle) -> list[str]:
    client = handle.client()
    outs = [await client.completions.create(model=handle.model_dir.name, prompt=p, max_tokens=12, temperature=0)
            for p in PROMPTS]  # fmt: skip
    return [o.choices[0].text for o in outs]


@pytest.fixture
async def two_nodes(tiny_model_dir, monkeypatch):
    port = free_port()
    monkeypatch.setenv(SECRET_ENV, "the right secret")  # (the server's processes inherit it)
    node1 = await headless(tiny_model_dir, port, "the right secret")
    engine = EngineConfig(
        model=str(tiny_model_dir), max_model_len=512, max_num_seqs=16, num_kv_blocks=256, engine_threads=1,
        worker="process", tensor_parallel_size=2, nnodes=2, master_port=port,
    )  # fmt: skip
    srv = await start_server(engine, HttpConfig(port=0), log_level="WARNING")
    try:
        yield ServerHandle(srv, tiny_model_dir), port
    finally:
        await srv.stop()
        node1.terminate()
        await node1.wait()


async def test_two_nodes_serve_and_refuse_a_wrong_secret(two_nodes, server, tiny_model_dir):
    handle, port = two_nodes
    reference = await completions(server)
    assert await completions(handle) == reference
    intruder = await headless(tiny_model_dir, port, "a wrong secret")
    _, stderr = await asyncio.wait_for(intruder.communicate(), 120)
    assert intruder.returncode == 2
    assert b"refused the handshake" in stderr
    assert await completions(handle) == reference  # (the gang serves on)
    await handle.wait_metrics({("sluice:worker_rank_up", (("rank", str(rank)),)): 1.0 for rank in range(2)})
    await handle.close_clients()

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
from actors.engine.gang_nodes import STALE_S, Nodes
from actors.runtime.curve import SECRET_ENV
from frontend.http_base import HttpConfig
from frontend.launch import start_server
from messages.step import NodeHello
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


def test_the_door_spawns_a_node_once_and_ends_the_gang_when_the_node_loses_its_ranks():
    """gang_nodes.Nodes, the door's table: hellos before the node runs the gang are answered with SpawnRanks (again,
    until it runs it); a hello without the gang after one with it means the node lost its ranks; a second launcher
    claiming a node that is heard is ignored, one that replaces a silent launcher is taken."""
    nodes = Nodes("g1")
    hello = lambda gang="", k=1: NodeHello(node_rank=k, gang=gang)  # noqa: E731
    assert [nodes.on_hello(hello(), b"a", t) for t in (0.0, 0.5)] == ["spawn", "spawn"]
    assert nodes.on_hello(hello("g0"), b"a", 0.7) == "spawn"  # (its ranks of an older gang: restarted into this one)
    assert nodes.on_hello(hello("g1"), b"a", 1.0) == "ignore"
    assert nodes.on_hello(hello(), b"b", 2.0) == "ignore"  # a second launcher for node 1, while the first is heard
    assert nodes.on_hello(hello("g1"), b"a", 3.0) == "ignore"
    assert nodes.on_hello(hello(k=2), b"c", 3.0) == "spawn"  # (another node)
    assert nodes.on_hello(hello(), b"b", 3.0 + STALE_S + 0.1) == "over"  # the first went silent: node 1 lost its ranks

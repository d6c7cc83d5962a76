"""How long `sluice serve` takes to serve, from a cold start and after its engine process dies, measured from
outside: the real CLI in a fresh process (this checkout's), the bundled model (or --model) on CPU with the default
settings, a free port, a temporary runtime directory and responses database; and, given --peer, another server's
start in the same run (llama.cpp's `llama-server`, vLLM: any OpenAI-compatible server with a /health):

    python scripts/bench_startup.py [--runs 3] [--model DIR] [--streams 4] [--log FILE]
        [--peer "llama-server -m SmolLM2.gguf --port {port}"]

Per run (a fresh server each):
  (a) start: process start -> the first /health 200 (polled every POLL_S);
  (b) first token: process start -> the first streamed token of a short chat completion sent once healthy;
  (c) restart: with --streams streaming completions in flight, kill -9 of the engine process (`sluice:engine`: the
      scheduler and its inline worker; the supervisor restarts it) -> the first streamed token of a new chat
      completion sent at the kill (sent again every POLL_S while the front answers 503); also when every stream in
      flight had its next token.
The peer's (a) and (b) are measured alike, alternating with Sluice's runs. The table prints each run and the median
against the targets (start to the first token <= 3 s, restart <= 5 s), and Sluice's over the peer's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.02
FIRST_TOKEN_TARGET_S, RESTART_TARGET_S = 3.0, 5.0
START_LIMIT_S = 300  # a server not healthy by then fails the run
CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "stream": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cmd: list[str], tmp: str, log) -> subprocess.Popen:
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])  # (this checkout first)
    env = dict(os.environ, SLUICE_RUNTIME_DIR=tmp, PYTHONPATH=path)
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp)


def sluice_cmd(args: argparse.Namespace, tmp: str, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "frontend.cli", "serve", *([args.model] if args.model else []), "--port", str(port)]
    return [*cmd, "--device", "cpu", "--responses-db", f"{tmp}/responses.sqlite3"]


async def first_token(session: aiohttp.ClientSession, url: str, path: str, body: dict, seen: list[float]) -> float:
    """Stream `body` to `path`; the time of its first token (every token's time appended to `seen`). Raises
    aiohttp.ClientResponseError on a refusal (503 while the engine loads)."""
    async with session.post(url + path, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                seen.append(time.monotonic())
    return seen[0] if seen else float("nan")


async def served(session: aiohttp.ClientSession, url: str) -> float:
    """The first token of a short chat completion, re-sent every POLL_S while refused (503)."""
    while True:
        seen: list[float] = []
        try:
            return await first_token(session, url, "/v1/chat/completions", CHAT, seen)
        except aiohttp.ClientResponseError as e:
            if e.status != 503:
                raise
        await asyncio.sleep(POLL_S)


async def healthy(session: aiohttp.ClientSession, url: str, server: subprocess.Popen) -> float:
    deadline = time.monotonic() + START_LIMIT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"sluice serve exited with code {server.returncode} (see its log)")
        try:
            async with session.get(url + "/health") as resp:
                if resp.status == 200:
                    return time.monotonic()
        except aiohttp.ClientConnectionError:
            pass  # (not listening yet)
        await asyncio.sleep(POLL_S)
    raise RuntimeError(f"sluice serve not healthy within {START_LIMIT_S} s")


def engine_pid(server: subprocess.Popen) -> int:
    """The engine process: the one of the server's session titled `sluice:engine` (actors/runtime/process.py)."""
    for proc in Path("/proc").iterdir():
        try:
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].strip()
            if proc.name.isdigit() and title == b"sluice:engine" and os.getsid(int(proc.name)) == server.pid:
                return int(proc.name)
        except OSError:  # (gone meanwhile)
            continue
    raise RuntimeError("no sluice:engine process found")


async def restart(session: aiohttp.ClientSession, url: str, server: subprocess.Popen, streams: int):
    """(c): seconds from the kill to a new request's first token, and to every in-flight stream's next token."""
    seen: list[list[float]] = [[] for _ in range(streams)]
    body = {"prompt": "Tell me a long story about a lighthouse.", "max_tokens": 512, "stream": True, "ignore_eos": True}
    tasks = [asyncio.ensure_future(first_token(session, url, "/v1/completions", body, s)) for s in seen]
    while not all(seen):  # every stream under way
        await asyncio.sleep(POLL_S)
    pid = engine_pid(server)
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    served_at = await served(session, url)
    while any(not [t for t in s if t > killed] for s in seen) and not all(t.done() for t in tasks):
        await asyncio.sleep(POLL_S)
    resumed = max((min((t for t in s if t > killed), default=float("nan")) for s in seen), default=float("nan"))
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return served_at - killed, resumed - killed


async def one_run(args: argparse.Namespace, peer: bool = False) -> tuple[float, ...]:
    """Sluice's (a), (b), (c) and the streams' resumption; the peer's (a) and (b)."""
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
        log = open(args.log, "ab") if args.log else open(f"{tmp}/serve.log", "wb")  # noqa: SIM115 (closed below)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = shlex.split(args.peer.format(port=port)) if peer else sluice_cmd(args, tmp, port)
        t0 = time.monotonic()
        server = launch(cmd, tmp, log)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
                health = await healthy(session, url, server) - t0
                first = await served(session, url) - t0
                if peer:
                    return health, first
                return health, first, *await restart(session, url, server, args.streams)
        except BaseException:
            if not args.log:
                log.flush()
                print(Path(f"{tmp}/serve.log").read_text()[-4000:], file=sys.stderr)
            raise
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
            log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh servers measured (the median is reported)")
    parser.add_argument("--model", help="an HF-style model directory (default: the bundled SmolLM2)")
    parser.add_argument("--streams", type=int, default=4, help="streams in flight at the engine's kill")
    parser.add_argument("--log", help="append the servers' output to FILE (default: shown only on a failure)")
    parser.add_argument("--peer", help="another server's command line, {port} its port, measured in the same runs")
    args = parser.parse_args()
    runs, peers = [], []
    for i in range(args.runs):
        runs.append(asyncio.run(one_run(args)))
        print(f"run {i + 1}: " + ", ".join(f"{v:.2f} s" for v in runs[-1]), flush=True)
        if args.peer:
            peers.append(asyncio.run(one_run(args, peer=True)))
            print(f"peer run {i + 1}: " + ", ".join(f"{v:.2f} s" for v in peers[-1]), flush=True)
    rows = [
        ("(a) start -> /health 200", None),
        ("(b) start -> first token", FIRST_TOKEN_TARGET_S),
        ("(c) kill -9 engine -> a new request's first token", RESTART_TARGET_S),
        (f"    kill -9 engine -> each of the {args.streams} streams' next token", None),
    ]
    print(f"\n{'seconds':58} {'median':>7}  {'runs':<{7 * len(runs)}} target")
    for k, (name, target) in enumerate(rows):
        values = [r[k] for r in runs]
        med = statistics.median(values)
        verdict = f"<= {target:g} {'ok' if med <= target else 'MISSED'}" if target else ""
        print(f"{name:58} {med:7.2f}  {''.join(f'{v:<7.2f}' for v in values)} {verdict}")
        if k < 2 and peers:
            theirs = statistics.median(p[k] for p in peers)
            print(f"{'    the peer':58} {theirs:7.2f}  {''.join(f'{p[k]:<7.2f}' for p in peers)} "
                  f"Sluice / peer {med / theirs:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()

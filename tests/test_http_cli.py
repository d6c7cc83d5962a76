"""The `sluice` command: help, `serve` (URL line, serving, SIGTERM -> exit 0), fast failures, `generate`."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from frontend.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--engine-threads", "1", "--num-kv-blocks", "64", "--max-model-len", "256", "--log-level", "WARNING"]


@pytest.mark.parametrize("argv", [[], ["serve"], ["generate"], ["bench", "serve"]])
def test_every_command_has_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*argv, "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: sluice {' '.join(argv)}".rstrip())


async def sluice(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "frontend.cli",
        *args,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_serve_prints_its_url_serves_and_exits_0_on_sigterm(tiny_model_dir):
    proc = await sluice("serve", str(tiny_model_dir), "--port", "0", "--served-model-name", "tiny", *SMALL)
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 180)).decode()
        assert line.startswith("Sluice is serving tiny at http://127.0.0.1:"), line
        # the launcher checked the model in a child of its fork server (frontend/preflight.py) and holds no torch
        assert "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text()
        url = line.split()[-1]
        async with aiohttp.ClientSession(url) as s:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "ignore_eos": True}
            async with s.post("/v1/completions", json=body) as resp:
                assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_bad_input_fails_fast_before_any_process_starts(tiny_model_dir, capsys, monkeypatch):
    assert main(["serve", "/no/such/model"]) == 1
    assert "model directory not found" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert main(["serve", str(tiny_model_dir), "--port", str(busy.getsockname()[1])]) == 1
    assert "cannot listen on" in capsys.readouterr().err
    assert main(["generate", str(tiny_model_dir), "Hello", "--top-p", "2"]) == 2
    assert "--top-p" in capsys.readouterr().err
    monkeypatch.setenv("SLUICE_CLUSTER_SECRET", "s" * 32)
    remote = ["--data-parallel-size", "2", "--data-parallel-size-local", "1"]
    assert main(["serve", str(tiny_model_dir), "--api-server-count", "2", *remote]) == 1
    assert "--api-server-count > 1: engine replicas on other nodes" in capsys.readouterr().err


async def test_generate_streams_text_to_stdout(tiny_model_dir):
    args = ["--max-tokens", "6", "--temperature", "0", "--ignore-eos", "--seed", "1"]
    proc = await sluice("generate", str(tiny_model_dir), "Hello", *args, *SMALL)
    out, err = await asyncio.wait_for(proc.communicate(), 180)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert out.endswith(b"\n") and len(out.strip()) > 0


def test_a_forked_call_that_dies_before_answering_says_how():
    """(actors/runtime/process.py `call_forked`: the launcher's checks run so; the child here exits at once)"""
    from actors.runtime import call_forked

    with pytest.raises(ChildProcessError, match="sluice:test exited with code 1 before it answered"):
        call_forked("sys:exit", b"bye", "sluice:test")


def test_children_do_not_import_torch_through_the_cli():
    """Every actor process re-imports the main module (spawn): `sluice`'s must stay light."""
    code = "import sys, frontend.cli, frontend.server; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(("flag", "caching"), [([], True), (["--no-enable-prefix-caching"], False)])
def test_prefix_caching_is_on_unless_turned_off(flag, caching):
    from frontend.cli_engine import engine_config

    args = build_parser().parse_args(["serve", "m", *flag])
    assert engine_config(args, "m").enable_prefix_caching is caching


@pytest.mark.parametrize(
    ("flags", "seqs"),
    [(["--device", "cpu"], 64), (["--device", "cuda"], 256), (["--device", "cuda", "--max-num-seqs", "8"], 8)],
)
def test_a_batch_is_64_sequences_but_256_on_cuda_as_vllms(flags, seqs):
    """(The launch resolves the CLI's default, 0, as the engine's processes get their config: EngineConfig.placed.)"""
    from frontend.cli_engine import engine_config

    assert engine_config(build_parser().parse_args(["serve", "m", *flags]), "m").placed().max_num_seqs == seqs


@pytest.mark.parametrize(
    ("flags", "cores", "servers"),
    [
        (["--device", "cpu"], 16, 1),
        (["--device", "cuda"], 16, 4),  # a server per 4 host cores on a card
        (["--device", "cuda"], 64, 4),  # ... 4 at most
        (["--device", "cuda"], 2, 1),
        (["--device", "cuda", "--data-parallel-size", "2", "--data-parallel-size-local", "1"], 16, 1),  # (remote ones)
        (["--device", "cuda", "--api-server-count", "2"], 16, 2),  # as asked
    ],
)
def test_the_http_servers_by_default_are_one_but_a_server_per_4_cores_on_cuda(flags, cores, servers, monkeypatch):
    from frontend.cli_engine import engine_config
    from frontend.http_base import HttpConfig
    from frontend.preflight import server_count

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setenv("SLUICE_CLUSTER_SECRET", "s" * 32)  # (replicas on other nodes authenticate)
    args = build_parser().parse_args(["serve", "m", *flags])
    http = HttpConfig(api_server_count=args.api_server_count or 0)
    assert server_count(engine_config(args, "m"), http).api_server_count == servers


def test_the_launch_chooses_the_http_servers_count_left_to_it(tiny_model_dir):
    """(0: the CLI's default) prepare() serves the chosen count, a process each, never none."""
    from actors.engine.config import EngineConfig
    from frontend.http_base import HttpConfig
    from frontend.preflight import prepare

    launch = prepare(EngineConfig(model=str(tiny_model_dir), device="cpu"), HttpConfig(port=0, api_server_count=0),
                     memory_check=False)  # fmt: skip
    assert launch["http"].api_server_count == 1
    assert [p.name for p in launch["processes"] if p.name.startswith("http")] == ["http"]

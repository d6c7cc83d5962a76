"""Sluice against vLLM's CPU build: the same random workload, the same client, one run, ratios printed.

    python scripts/bench_peers.py [--vllm ~/peers/vllm/bin/vllm] [--concurrency 1 16] [--sluice-args "..."]

Each server is started alone (the other is stopped: both would share these few cores), timed from launch to
/health 200, warmed up, then measured at each concurrency with `frontend.bench_serve` (streaming completions,
random prompts of --input-len words, --output-len tokens with ignore_eos, greedy). vLLM is served as
../shared/notes/peers.md says (fp32, one core for the model, prefix caching off); without it Sluice runs alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from frontend import bench_serve
from gpu.convert import default_model_dir

METRICS = (  # (label, result key, stat, higher is better)
    ("output tok/s", "output_throughput", None, True),
    ("median TTFT ms", "ttft_ms", "p50", False),
    ("median TPOT ms", "tpot_ms", "p50", False),
    ("median ITL ms", "itl_ms", "p50", False),
    ("p99 ITL ms", "itl_ms", "p99", False),
)


NO_VLLM = "# no vLLM at {}: Sluice alone (see ../shared/notes/peers.md to install it)"


def server_arguments(ap: argparse.ArgumentParser) -> None:
    """The servers' flags, shared by the peer benchmarks."""
    ap.add_argument("--vllm", default="~/peers/vllm/bin/vllm", help="vLLM's CLI (skipped when absent)")
    ap.add_argument("--port", type=int, default=8137)
    ap.add_argument("--startup-timeout", type=float, default=400.0)
    ap.add_argument("--sluice-args", default="", help="extra `sluice serve` flags, quoted")
    ap.add_argument("--logs", default="/tmp", help="where the servers' logs go")


def sluice_command(args) -> list[str]:
    return [sys.executable, "-m", "frontend.cli", "serve", "--port", str(args.port), "--log-level", "WARNING",
            *shlex.split(args.sluice_args)]  # fmt: skip


def commands(args, model_dir: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    servers = {"sluice": (sluice_command(args), {})}
    if vllm := vllm_command(args, model_dir, prefix_caching=False):
        servers["vllm"] = vllm
    else:
        print(NO_VLLM.format(args.vllm))
    return servers


def vllm_command(args, model_dir: Path, prefix_caching: bool) -> tuple[list[str], dict[str, str]] | None:
    """vLLM's CPU build served as ../shared/notes/peers.md says (None when it is not installed)."""
    vllm = Path(args.vllm).expanduser()
    if not vllm.is_file():
        return None
    cmd = [str(vllm), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(args.port),
           "--served-model-name", "smollm2", "--dtype", "float32", "--max-model-len", "2048"]  # fmt: skip
    cmd.append("--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching")
    env = dict(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", VLLM_CPU_KVCACHE_SPACE="2",
               VLLM_CPU_OMP_THREADS_BIND="auto")  # fmt: skip
    return cmd, env


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def serving(name: str, cmd: list[str], env: dict[str, str], args) -> Iterator[float]:
    """Start a server alone, wait for /health 200 and yield its startup seconds; stop it (SIGINT, then SIGKILL)."""
    log = open(Path(args.logs) / f"{name}.log", "w")  # noqa: SIM115 (closed below)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=os.environ | env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = start + args.startup_timeout
        while not healthy(args.port):
            if proc.poll() is not None or time.perf_counter() > deadline:
                raise RuntimeError(f"{name} did not become healthy; see {log.name}")
            time.sleep(0.2)
        yield time.perf_counter() - start
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def measure(name: str, cmd: list[str], env: dict[str, str], args) -> dict:
    """Start the server, time its startup, run the workload at each concurrency, stop it."""
    with serving(name, cmd, env, args) as startup_s:
        results = {"startup_s": startup_s}
        base = ["--base-url", f"http://127.0.0.1:{args.port}", "--input-len", str(args.input_len),
                "--output-len", str(args.output_len), "--seed", "0"]  # fmt: skip
        for c in args.concurrency:
            n = max(args.min_prompts, args.prompts_per_slot * c)
            ns = bench_serve.add_arguments(argparse.ArgumentParser()).parse_args(
                [*base, "--concurrency", str(c), "--num-prompts", str(n), "--warmup", str(min(c, 4))]
            )
            print(f"\n### {name}, concurrency {c}", flush=True)
            results[c] = asyncio.run(bench_serve.run(ns))
        return results


def machine() -> str:
    """The date, CPU model, core count and load: written beside every figure."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "?")
    load = Path("/proc/loadavg").read_text().split()[0]
    return f"{time.strftime('%Y-%m-%d %H:%M')}, {cpu}, {os.cpu_count()} cores, load {load}"


def value(result: dict, key: str, stat: str | None) -> float:
    return result[key] if stat is None else result[key][stat]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    server_arguments(ap)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompts-per-slot", type=int, default=2, help="prompts = this x concurrency (at least 8)")
    ap.add_argument("--min-prompts", type=int, default=8)
    args = ap.parse_args()
    model_dir = default_model_dir()
    print(f"# bench_peers {machine()}: {model_dir.name} fp32, {args.input_len} in / {args.output_len} out, greedy")
    results = {name: measure(name, cmd, env, args) for name, (cmd, env) in commands(args, model_dir).items()}
    names = list(results)
    print("\n" + f"{'':24s}" + "".join(f"{n:>12s}" for n in names) + ("   sluice/vllm" if len(names) > 1 else ""))
    print(f"{'startup to /health s':24s}" + "".join(f"{results[n]['startup_s']:12.1f}" for n in names))
    for c in args.concurrency:
        for label, key, stat, higher in METRICS:
            vals = [value(results[n][c], key, stat) for n in names]
            ratio = f"{vals[0] / vals[1]:11.2f}x {'(higher is better)' if higher else ''}" if len(vals) > 1 else ""
            print(f"{f'c={c} {label}':24s}" + "".join(f"{v:12.1f}" for v in vals) + "   " + ratio)


if __name__ == "__main__":
    main()

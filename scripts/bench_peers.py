"""Sluice against vLLM's CPU build and llama.cpp: the same random workload, the same client, one run, ratios printed.

    python scripts/bench_peers.py [--vllm ~/peers/vllm/bin/vllm] [--concurrency 1 16] [--sluice-args "..."]
                                  [--also "--quantization q4_k" ...] [--llama-cpp PYTHON --gguf F32.gguf Q4_1.gguf]
                                  [--llama-server BIN --gguf FILE.gguf --llama-threads 1 2 --llama-slots 8 --llama-args "..."]

Each server is started alone (the others are stopped: they would share these few cores), timed from launch to
ready (/health 200; llama.cpp's /v1/models), warmed up, then measured at each concurrency with
`frontend.bench_serve` (streaming completions, random prompts of --input-len words, --output-len tokens with
ignore_eos, greedy). vLLM is served as ../shared/notes/peers.md says (fp32, one core for the model, prefix caching
off); llama.cpp by its own `llama-server` where `--llama-server` names one (built as peers.md says: the server CPU users
run, with --llama-slots parallel slots), else by llama-cpp-python's server (`--llama-cpp`: a Python with
`llama-cpp-python[server]`, one request at a time), one server per `--gguf` file and --llama-threads count; peers
that are not installed are skipped. Sluice serves the bundled model unless --sluice-args names another (a GGUF path).
`--also` adds Sluice servers with further flags (e.g. a quantized one beside llama.cpp's Q4_1).
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
from gpu.loading.convert import default_model_dir

METRICS = (  # (label, result key, stat, higher is better)
    ("output tok/s", "output_throughput", None, True),
    ("median TTFT ms", "ttft_ms", "p50", False),
    ("median TPOT ms", "tpot_ms", "p50", False),
    ("median ITL ms", "itl_ms", "p50", False),
    ("p99 ITL ms", "itl_ms", "p99", False),
)
RATIOS = (("output_throughput", None), ("ttft_ms", "p50"), ("tpot_ms", "p50"))  # (the figures set side by side)


NO_VLLM = "# no vLLM at {}: Sluice alone (see ../shared/notes/peers.md to install it)"


def server_arguments(ap: argparse.ArgumentParser) -> None:
    """The servers' flags, shared by the peer benchmarks."""
    ap.add_argument("--vllm", default="~/peers/vllm/bin/vllm", help="vLLM's CLI (skipped when absent)")
    ap.add_argument("--port", type=int, default=8137)
    ap.add_argument("--startup-timeout", type=float, default=400.0)
    ap.add_argument("--sluice-args", default="", help="extra `sluice serve` flags, quoted")
    ap.add_argument("--logs", default="/tmp", help="where the servers' logs go")


def sluice_command(args, extra: str = "") -> list[str]:
    return [sys.executable, "-m", "frontend.cli", "serve", "--port", str(args.port), "--log-level", "WARNING",
            *shlex.split(args.sluice_args), *shlex.split(extra)]  # fmt: skip


def commands(args, model_dir: Path) -> dict[str, tuple[list[str], dict[str, str], str]]:
    """name -> (command, environment, the path that answers 200 once the server is ready)"""
    servers = {} if args.peers_only else {"sluice": (sluice_command(args), {}, "/health")}
    servers |= {f"sluice {extra}": (sluice_command(args, extra), {}, "/health") for extra in args.also}
    if vllm := vllm_command(args, model_dir, prefix_caching=False):
        servers["vllm"] = (*vllm, "/health")
    else:
        print(NO_VLLM.format(args.vllm))
    python, server = Path(args.llama_cpp).expanduser(), Path(args.llama_server or "/nonexistent").expanduser()
    if args.llama_server and not server.is_file():
        raise SystemExit(f"--llama-server {server}: no such file")
    for gguf, threads in [(g, t) for g in args.gguf for t in args.llama_threads]:
        common = ["--host", "127.0.0.1", "--port", str(args.port)]
        if server.is_file():  # (a context of 2048 tokens a slot)
            cmd = [str(server), "-m", gguf, *common, "-t", str(threads), "-np", str(args.llama_slots),
                   "-c", str(2048 * args.llama_slots), "--alias", "smollm2", *shlex.split(args.llama_args)]  # fmt: skip
        elif python.is_file():
            cmd = [str(python), "-m", "llama_cpp.server", "--model", gguf, *common, "--n_threads", str(threads),
                   "--n_ctx", "2048", "--model_alias", "smollm2"]  # fmt: skip
        else:
            print(f"# no llama-server or llama-cpp-python at {server}, {python}: llama.cpp skipped (peers.md)")
            break
        name = f"llama.cpp {Path(gguf).stem.rsplit('.', 1)[-1]} t{threads}"
        servers[name] = (cmd, {}, "/health" if server.is_file() else "/v1/models")
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


def healthy(port: int, path: str = "/health") -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def serving(name: str, cmd: list[str], env: dict[str, str], args, health: str = "/health") -> Iterator[tuple]:
    """Start a server alone, wait for `health` 200 and yield (its startup seconds, its pid); stop it (SIGINT, then
    SIGKILL)."""
    log = open(Path(args.logs) / f"{name}.log", "w")  # noqa: SIM115 (closed below)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=os.environ | env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = start + args.startup_timeout
        while not healthy(args.port, health):
            if proc.poll() is not None or time.perf_counter() > deadline:
                raise RuntimeError(f"{name} did not become healthy; see {log.name}")
            time.sleep(0.2)
        yield time.perf_counter() - start, proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):  # (one that died starting: its log says why)
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def tree_memory(pid: int) -> tuple[int, int, int]:
    """(resident bytes, proportional bytes, the sum of each process's peak) over a process and its descendants, from
    /proc. Resident counts a page every process of the tree maps once per process (the fork server's torch libraries
    and modules, in each of Sluice's actor processes); proportional (Pss, smaps_rollup) splits it among them: the
    memory the tree holds. A single process's are equal but for pages it shares with processes outside it."""
    rss = pss = peak = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            status = dict(line.split(":", 1) for line in Path(f"/proc/{p}/status").read_text().splitlines())
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # (a process that ended meanwhile)
            continue
        rss += int(status.get("VmRSS", "0 kB").split()[0]) * 1024
        peak += int(status.get("VmHWM", "0 kB").split()[0]) * 1024
        with contextlib.suppress(OSError):
            rollup = Path(f"/proc/{p}/smaps_rollup").read_text().splitlines()
            pss += next(int(ln.split()[1]) for ln in rollup if ln.startswith("Pss:")) * 1024
    return rss, pss, peak


def measure(name: str, cmd: list[str], env: dict[str, str], health: str, args) -> dict:
    """Start the server, time its startup and its processes' memory once ready, run the workload at each
    concurrency, stop it."""
    with serving(name.replace(" ", "-"), cmd, env, args, health) as (startup_s, pid):
        results = {"startup_s": startup_s}
        results["rss_mib"], results["pss_mib"], results["peak_mib"] = (n / (1 << 20) for n in tree_memory(pid))
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


def tok_ttft_tpot(result: dict) -> tuple[float, float, float]:
    return tuple(value(result, key, stat) for key, stat in RATIOS)


def over(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"  # (a TPOT of 0: one output token)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    server_arguments(ap)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompts-per-slot", type=int, default=2, help="prompts = this x concurrency (at least 8)")
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--also", nargs="*", default=[], help="more Sluice servers: each one's extra flags, quoted")
    ap.add_argument("--peers-only", action="store_true", help="no Sluice server (but --also's): the peers alone")
    ap.add_argument("--llama-cpp", default="~/peers/llama/bin/python", help="a Python with llama-cpp-python[server]")
    ap.add_argument("--gguf", nargs="*", default=[], help="GGUF files for llama.cpp: one server each")
    ap.add_argument("--llama-server", help="llama.cpp's own llama-server binary (else llama-cpp-python's server)")
    ap.add_argument("--llama-slots", type=int, default=8, help="llama-server's parallel slots (-np)")
    ap.add_argument("--llama-args", default="", help="extra llama-server flags, quoted (e.g. --llama-args=--no-repack)")
    ap.add_argument("--llama-threads", type=int, nargs="+", default=[1], help="llama.cpp's threads: one server each")
    args = ap.parse_args()
    model_dir = default_model_dir()
    served = args.sluice_args or f"{model_dir.name} fp32"
    print(f"# bench_peers {machine()}: {served}, {args.input_len} in / {args.output_len} out, greedy")
    servers = commands(args, model_dir)
    results = {name: measure(name, cmd, env, health, args) for name, (cmd, env, health) in servers.items()}
    names = list(results)
    print("\n" + f"{'':24s}" + "".join(f"{n:>22s}" for n in names))
    print(f"{'startup to ready s':24s}" + "".join(f"{results[n]['startup_s']:22.1f}" for n in names))
    print(f"{'resident MiB, ready':24s}" + "".join(f"{results[n]['rss_mib']:22.0f}" for n in names))
    print(f"{'proportional MiB, ready':24s}" + "".join(f"{results[n]['pss_mib']:22.0f}" for n in names))
    print(f"{'peaks MiB (summed)':24s}" + "".join(f"{results[n]['peak_mib']:22.0f}" for n in names))
    for c in args.concurrency:
        for label, key, stat, higher in METRICS:
            vals = [value(results[n][c], key, stat) for n in names]
            print(f"{f'c={c} {label}':24s}" + "".join(f"{v:22.1f}" for v in vals) + ("  (higher is better)" * higher))
    print("\nratios, each Sluice server over each peer (output tok/s: higher is better; TPOT: lower is better)")
    for s in (n for n in names if n.startswith("sluice")):
        for peer in (n for n in names if not n.startswith("sluice")):
            ratio = {k: results[s][k] / results[peer][k] for k in ("startup_s", "rss_mib", "pss_mib")}
            print(f"{s} / {peer}: startup {ratio['startup_s']:.2f}x, resident {ratio['rss_mib']:.2f}x, "
                  f"proportional {ratio['pss_mib']:.2f}x")  # fmt: skip
            for c in args.concurrency:
                (a, t, x), (b, u, y) = (tok_ttft_tpot(results[n][c]) for n in (s, peer))
                print(f"{s} / {peer}, c={c}: output tok/s {over(a, b)}, median TTFT {over(t, u)}, "
                      f"median TPOT {over(x, y)}")  # fmt: skip


if __name__ == "__main__":
    main()

"""The GPU runbook: one command that checks and measures Sluice on a GPU machine within ~10 minutes, and writes a
markdown report (docs/GPU.md says how to set up a machine without network access).

    python scripts/gpu_check.py --out DIR [--bundle .gpu] [--only PART ...] [--skip PART ...] [--serve SETTING ...]
                                [--model DIR] [--quick]

--bundle: what scripts/gpu_bundle.sh packed; without the converted SmolLM2 in the cache, random weights of its shape
are built from the bundle's config and tokenizer for every part: speed is the real model's; outputs are not.

Parts (docs/GPU.md's table says what each measures and its limits), each a subprocess with its own time limit (a part
that fails or runs out is reported and the next one runs), by default in this order, the timings first: env, step,
serving (a server per setting: --serve picks them), sampler, tests, spec, big. --only runs the parts named, in the
order given; --quick runs env, step, serving (its default setting) and big. DIR gets three files (a GPU machine
returns at most 8): report.md (the tables), gpu_check.log (every part's output, in order) and results.json (every
benchmark's JSON), written after each part and when a SIGTERM (an outer `timeout`) cuts one off; the report is
printed last, with a line per part.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
# the GPU path's own tests (on the card: compiled kernels, captured graphs), run whole; then every `cuda`-marked test
GPU_PATH_TESTS = ["graphs", "launch_budget", "attention_backends", "sampler_fused", "sampler_distribution"]
GPU_PATH_TESTS = [f"tests/test_{name}.py" for name in [*GPU_PATH_TESTS, "triton_engine", "memory", "cuda"]]
SERVE_RUNS = [  # (label, extra serve flags, concurrencies)
    ("async", [], [1, 16, 64, 256]),
    ("sync", ["--no-async-scheduling"], [64]),
    ("inline-worker", ["--worker", "inline"], [64]),  # (the default on CUDA is the worker in its own process)
    ("inline-sync", ["--worker", "inline", "--no-async-scheduling"], [64]),
    ("eager", ["--enforce-eager"], [64]),  # no graphs: what the graphs of every step kind buy
    ("stream4", ["--stream-interval", "4"], [256]),  # 4 tokens an SSE event: the HTTP process's headroom
    ("asc1", ["--api-server-count", "1"], [64, 256]),  # one HTTP server (the default on CUDA: one per 4 host cores)
]


def run(cmd: list[str], log: Path, timeout: float) -> tuple[int | str, float]:
    """Run `cmd` from the repo root, its output appended to `log`: (exit code or "timeout", seconds)."""
    start = time.monotonic()
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        except OSError as exc:  # no such program
            out.write(f"{exc}\n")
            rc = "missing"
    return rc, time.monotonic() - start


def part_env(out: Path, model: str) -> list[str]:
    log, lines = out / "env.log", []
    code = "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,"
    code += " 'transformers', transformers.__version__)"
    gpu = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    for cmd in (gpu, [PY, "-c", code]):
        before = log.read_text() if log.exists() else ""
        run(cmd, log, 60)
        lines += [f"- {line}" for line in log.read_text()[len(before) :].splitlines()[1:]]
    return lines


def part_tests(out: Path, model: str) -> list[str]:
    lines, log = [], out / "tests.log"
    others = ["-m", "cuda", "tests", *(f"--ignore={t}" for t in GPU_PATH_TESTS)]  # (each test runs once)
    pytest = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors"]  # (a module
    for label, args, limit in (("GPU path", GPU_PATH_TESTS, 240), ("other cuda-marked", others, 150)):  # that can't
        rc, secs = run([*pytest, *args], log, limit)  # import, a test package missing, costs only its own tests)
        tail = log.read_text().strip().splitlines()[-1:]
        lines.append(f"- {label} tests ({secs:.0f} s, exit {rc}): {tail[0] if tail else ''}")
    return lines


def part_step(out: Path, model: str) -> list[str]:
    data = out / "step.json"
    cmd = [PY, "scripts/bench_step.py", "--json", str(data), *(["--model", model] if model else [])]
    rc, secs = run(cmd, out / "step.log", 200)
    if not data.exists():
        return [f"- bench_step failed ({rc}, {secs:.0f} s): see step.log"]
    r = json.loads(data.read_text())
    lines = [
        f"- {r['device']}: weight-read floor {r['floor_ms']:.3f} ms/step",
        "",
        "| mode | batch | ms/step | tok/s |",
    ]
    lines += ["|---|---:|---:|---:|"] + [
        f"| {x['mode']} | {x['batch']} | {x['ms']:.2f} | {x['tok_s']:.0f} |" for x in r["results"]
    ]
    return lines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def part_serving(out: Path, model: str, settings: list[str]) -> list[str]:
    return serve_rows(out, model, [r for r in SERVE_RUNS if r[0] in settings])


def serve_rows(out: Path, model: str, runs: list[tuple[str, list[str], list[int]]]) -> list[str]:
    """A server per run (label, its flags, the concurrencies measured), bench_serving against it: the table."""
    head = "| setting | concurrency | output tok/s | median TTFT ms | median TPOT ms | p99 ITL ms | host CPU, cores |"
    lines = [head, "|---|---:|---:|---:|---:|---:|---|"]  # (stream4's ITL and TPOT: between its 4-token events)
    log = out / "serving.log"
    for label, flags, concurrencies in runs:
        port = free_port()
        serve = [PY, "-m", "frontend.cli", "serve", *([model] if model else []), "--port", str(port), *flags]
        with log.open("a") as sink:
            server = subprocess.Popen(serve, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
        try:
            if not wait_healthy(port, server, 120):
                lines.append(f"| {label} | - | server did not start: see serving.log | | | | |")
                continue
            for c in concurrencies:
                data = out / f"serve-{label}-{c}.json"
                bench = [PY, "scripts/bench_serving.py", "--base-url", f"http://127.0.0.1:{port}", "--concurrency"]
                bench += [str(c), "--num-prompts", str(max(8, 2 * c)), "--output-len", "64", "--warmup", str(c)]
                bench += ["--server-pid", str(server.pid)]  # (each actor's CPU: one near 1.0 core bounds the row)
                run([*bench, "--json", str(data)], log, 90)
                lines.append(serving_row(label, c, data))
                with log.open("a") as sink:  # (the table so far, for a part cut off)
                    sink.write(f"{lines[-1]}\n")
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    return lines


def wait_healthy(port: int, server: subprocess.Popen, timeout: float) -> bool:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            time.sleep(1)  # (a polled external process: no event to wait on)
    return False


def serving_row(label: str, c: int, data: Path) -> str:
    if not data.exists():
        return f"| {label} | {c} | failed: see serving.log | | | | |"
    r = json.loads(data.read_text())
    stats = (r["ttft_ms"]["p50"], r["tpot_ms"]["p50"], r["itl_ms"]["p99"])
    cpu = [f"{t.removeprefix('sluice:')} {v['cores']:.2f}" for t, v in r.get("server_cpu", {}).items()]
    row = f"| {label} | {c} | {r['output_throughput']:.0f} | " + " | ".join(f"{s:.1f}" for s in stats)
    return f"{row} | {', '.join(cpu[:4])} |"  # (busiest first: the launcher's and fork server's idle ones last)


def part_sampler(out: Path, model: str) -> list[str]:
    cmd = [PY, "scripts/bench_sampler.py", "--device", "cuda", "--batches", "1", "64", "256", "--vocabs", "49152"]
    rc, secs = run([*cmd, "--no-reference"], out / "sampler.log", 90)
    return [f"- bench_sampler ({secs:.0f} s, exit {rc}): table in sampler.log"]


def part_spec(out: Path, model: str) -> list[str]:
    cmd = [PY, "scripts/bench_spec.py", "--requests", "2", "--max-tokens", "64", *(["--model", model] if model else [])]
    rc, secs = run(cmd, out / "spec.log", 120)
    return [f"- bench_spec ({secs:.0f} s, exit {rc}): table in spec.log"]


# Llama-3.1-8B's shape (SmolLM2's vocabulary, whose tokenizer the machine has: 49,152 rows, not 128,256), bf16
BIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
       "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 49152,
       "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
       "torch_dtype": "bfloat16", "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip


def part_big(out: Path, _: str) -> list[str]:
    """The 8B-class shape with random weights drawn on the card (--load-format dummy: no checkpoint file): its step
    at batch 1 and 64 against the weight-read floor, and served at concurrency 1 and 64."""
    from gpu.loading.convert import DEFAULT_MODEL_NAME, cache_dir
    from gpu.loading.random_weights import random_copy

    big = out / "llama-8b-shape"
    big.mkdir(exist_ok=True)
    (big / "config.json").write_text(json.dumps(BIG))
    tokenizer = cache_dir() / "models" / DEFAULT_MODEL_NAME  # (its vocabulary BIG's, whatever --model is)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer / name).is_file():
            (big / name).write_bytes((tokenizer / name).read_bytes())
    drawn = str(random_copy(big))
    data = out / "big-step.json"
    cmd = [PY, "scripts/bench_step.py", "--model", drawn, "--no-hf", "--batches", "1", "64", "--json", str(data)]
    rc, secs = run(cmd, out / "big.log", 240)
    if not data.exists():
        return [f"- bench_step on the 8B shape failed ({rc}, {secs:.0f} s): see big.log"]
    r = json.loads(data.read_text())
    lines = [f"- 8B shape (random bf16): weight-read floor {r['floor_ms']:.2f} ms/step (c1 TPOT target <= 1.3x)", ""]
    lines += ["| mode | batch | ms/step | / floor |", "|---|---:|---:|---:|"]
    lines += [f"| {x['mode']} | {x['batch']} | {x['ms']:.2f} | {x['ms'] / r['floor_ms']:.2f} |" for x in r["results"]]
    return [*lines, "", *serve_rows(out, drawn, [("8B shape", ["--max-model-len", "2048"], [1, 64])])]


def prepare_model(bundle: Path) -> str:
    """The default model's directory in the cache, built from the bundle with random weights where it is missing."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from gpu.loading.convert import DEFAULT_MODEL_NAME, cache_dir

    out = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if out.is_dir():
        return f"model: {out} (as found)"
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(bundle / "smollm2"))
        model.save_pretrained(tmp)
        for f in (bundle / "smollm2").iterdir():
            shutil.copy(f, tmp)
        Path(tmp).rename(out)
    return f"model: {out} (random weights of SmolLM2-135M-Instruct's shape)"


PARTS = {"env": part_env, "step": part_step, "serving": part_serving, "sampler": part_sampler}
PARTS |= {"tests": part_tests, "spec": part_spec, "big": part_big}
QUICK = ["env", "step", "serving", "big"]  # (--quick: these, serving at its default settings only)


def gather(work: Path, out: Path) -> None:
    """The parts' logs, in the order they were written, into gpu_check.log; their JSON files into results.json."""
    logs = sorted(work.glob("*.log"), key=lambda f: f.stat().st_mtime_ns)
    (out / "gpu_check.log").write_text("".join(f"===== {f.name}\n{f.read_text()}" for f in logs))
    data = {}
    for f in sorted(work.glob("*.json")):
        try:
            data[f.stem] = json.loads(f.read_text())
        except ValueError as exc:  # a part cut off while writing
            data[f.stem] = {"unreadable": repr(exc)}
    (out / "results.json").write_text(json.dumps(data, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="directory for the logs and report.md")
    ap.add_argument("--only", nargs="+", choices=list(PARTS), default=list(PARTS))
    ap.add_argument("--skip", nargs="+", choices=list(PARTS), default=[])
    ap.add_argument("--serve", nargs="+", choices=[r[0] for r in SERVE_RUNS], default=[r[0] for r in SERVE_RUNS])
    ap.add_argument("--model", default="", help="an HF-style directory (default: the bundled SmolLM2)")
    ap.add_argument("--bundle", type=Path, default=None, help="scripts/gpu_bundle.sh's directory (.gpu)")
    ap.add_argument("--commit", default="", help="the commit checked (a copied tree may have no .git)")
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}, serving with the defaults only")
    args = ap.parse_args()
    if args.quick:
        args.only, args.serve = [p for p in args.only if p in QUICK], ["async"]
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="sluice-gpu-check-"))  # each part's files, gathered into --out
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    report, summary = [f"# Sluice GPU check {args.commit}".rstrip(), ""], []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("gpu_check: terminated (SIGTERM)"))  # (raised in this thread)
    if args.bundle:
        report += [f"- {prepare_model(args.bundle)}", ""]
    parts = PARTS | {"serving": functools.partial(part_serving, settings=args.serve)}
    for name in [p for p in dict.fromkeys(args.only) if p not in args.skip]:  # in the order given
        start, lines = time.monotonic(), ["- cut off: its output so far is in gpu_check.log"]
        try:
            lines = parts[name](work, args.model)
        except Exception as exc:  # a part's own failure is reported; the next part runs
            lines = [f"- failed: {exc!r}"]
        finally:  # (also as a SIGTERM's SystemExit or an interrupt leaves: the part's output so far is kept)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # (one arriving now waits for the writes)
            secs = time.monotonic() - start
            report += [f"## {name} ({secs:.0f} s)", "", *lines, ""]
            (args.out / "report.md").write_text("\n".join(report))
            gather(work, args.out)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        summary.append(f"{name:>8} {secs:>5.0f} s  {lines[0] if lines else ''}")
    print("\n".join(report))
    print("\n".join(summary))


if __name__ == "__main__":
    main()

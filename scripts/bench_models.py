"""Model families (issue 29), measured against a baseline from the same run.

    python scripts/bench_models.py [--part load steps] [--repeats 3] [--rounds 3] [--threads 2 1] [--quick]
                                   [--profile FAMILY]

load:  a random-weight Qwen3 of ~1.1B parameters (hidden 2048, 16 layers, intermediate 6144, vocab 151936, tied
       embeddings; built once by HF transformers into ~/.cache/sluice/bench, bf16, `save_pretrained` shards of
       500 MB) is loaded in a fresh subprocess per measurement: Sluice's `load_model(ModelConfig.from_path(dir),
       cpu, dtype)` against HF's `AutoModelForCausalLM.from_pretrained(dir, dtype=dtype)`, for bfloat16 and
       float32. Wall time of the call (imports excluded, printed apart), peak RSS (getrusage ru_maxrss, imports
       included), RSS after the load (anonymous and file-backed, /proc/self/status) and after every weight has been
       read once (HF maps same-dtype weights lazily); Sluice's time in `Linear.pack`; ratio Sluice / HF, median over
       --repeats (Sluice and HF alternate). The shards are read once before, so both load from the page cache.
steps: every family's checkpoint of one size (tests/family_models.py's `make_family_dir`, quirks on: sliding window
       128 where the family has one, soft-caps, q/k norm, partial rotary; hidden 512, 8 layers, intermediate 1536,
       8 heads of 64, 4 KV heads, vocab 49152; the MoEs have 8 experts of intermediate 768, top 2, so a token's
       expert FLOPs equal Llama's MLP), fp32 through `ModelRunner.execute` on CPU: a decode step at batch 1 (context
       256) and 16 (contexts 136-256), and a 256-token prefill, at each --threads. Each family's runner (a fresh
       one per round, families in rotated order) is paired with one Llama runner, their steps alternating ABBA, so
       both see the same machine load; per round the family's median wall (and process CPU) time over Llama's, and
       the ratio printed is the median over rounds. "llama" is a second Llama runner: the noise floor.
--profile FAMILY: torch.profiler's top ops of that family's and Llama's steps, to explain a ratio.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CACHE = Path(os.environ.get("SLUICE_BENCH_CACHE", "~/.cache/sluice/bench")).expanduser()
BIG = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16, head_dim=128)
BIG |= dict(num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096, tie_word_embeddings=True)
DIMS = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, head_dim=64)
DIMS |= dict(num_key_value_heads=4, max_position_embeddings=1024)
WINDOW = 128
GEMMA = {"sliding_window": WINDOW, "query_pre_attn_scalar": 64}
STEP_OVERRIDES = {
    "llama": {},
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {"sliding_window": WINDOW},
    "qwen3": {"sliding_window": WINDOW},
    "gemma2": GEMMA,
    "gemma3": {**GEMMA, "layer_types": ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(8)]},
    "phi3": {},
    "mixtral": {"sliding_window": WINDOW, "num_local_experts": 8, "intermediate_size": 768},
    "qwen3_moe": {"num_experts": 8, "moe_intermediate_size": 768, "mlp_only_layers": []},
}
CONTEXT, PREFILL, BLOCK, ROWS = 256, 256, 16, 16


def cpu_name() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), "unknown CPU")


def load_avg() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def built(path: Path, build) -> Path:
    """`path`, built by `build(tmp)` into a temporary directory first if it is not there yet."""
    if not (path / "config.json").exists():
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        build(tmp)
        tmp.rename(path)
    return path


def build_big(tmp: Path) -> None:
    import torch
    import transformers

    from gpu.loading.convert import default_model_dir
    from tests.tiny_model import TOKENIZER_FILES

    torch.manual_seed(0)
    config = transformers.Qwen3Config(**BIG)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp, max_shard_size="500MB")
    for name in TOKENIZER_FILES:  # (the SmolLM2 tokenizer: ModelConfig wants one; loading never reads it)
        shutil.copy(default_model_dir() / name, tmp / name)


def child(kind: str, dtype_name: str, path: str) -> None:
    """One load in this fresh process; prints a JSON line."""
    t0 = time.perf_counter()
    import torch

    dtype = getattr(torch, dtype_name)
    pack = [0.0]
    if kind == "sluice":
        from gpu.layers.linear import Linear
        from gpu.loading.config import ModelConfig
        from gpu.loading.weights import load_model

        original = Linear.pack

        def timed_pack(self, *args, **kwargs):
            t = time.perf_counter()
            original(self, *args, **kwargs)
            pack[0] += time.perf_counter() - t

        Linear.pack = timed_pack
        load = lambda: load_model(ModelConfig.from_path(path), torch.device("cpu"), dtype)  # noqa: E731
    else:
        from transformers import AutoModelForCausalLM

        load = lambda: AutoModelForCausalLM.from_pretrained(path, dtype=dtype)  # noqa: E731
    imports, before = time.perf_counter() - t0, rss()
    t = time.perf_counter()
    model = load()
    wall = time.perf_counter() - t
    gc.collect()
    params = sum(p.numel() for p in model.parameters())
    peak, after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, rss()
    for p in model.parameters():  # every weight read once, as a forward would (a lazily mapped one faults in)
        p.float().sum()
    out = dict(wall=wall, imports=imports, pack=pack[0], peak=peak, before=before, params=params, **after)
    print(json.dumps(out | {f"touched {k}": v for k, v in rss().items()}))


def rss() -> dict[str, float]:
    """VmRSS, RssAnon and RssFile in GiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) / 2**20 for k in ("VmRSS", "RssAnon", "RssFile")}


def bench_load(repeats: int) -> None:
    path = built(CACHE / "qwen3-1b-bf16", build_big)
    files = sorted(path.glob("*.safetensors"))
    for f in files:  # into the page cache, for every measurement alike
        f.read_bytes()
    size = sum(f.stat().st_size for f in files) / 2**30
    print(f"\n## load: {path} ({len(files)} shards, {size:.2f} GiB), {cpu_name()}, load avg {load_avg()}")
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in range(repeats):
        for dtype in ("bfloat16", "float32"):
            for kind in ("sluice", "hf") if r % 2 == 0 else ("hf", "sluice"):
                cmd = [sys.executable, __file__, "--child", kind, dtype, str(path)]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
                runs.setdefault((kind, dtype), []).append(json.loads(out))
                print(f"  repeat {r} {dtype:8} {kind:6} {out}  (load avg {load_avg()})", flush=True)
    print(f"\nmedians of {repeats}, {cpu_name()}, load avg {load_avg()}")
    print("| dtype | | load s | peak RSS | RSS after (anon + file) | RSS, weights touched | imports s | pack s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    med = lambda kind, dtype, key: statistics.median(x[key] for x in runs[kind, dtype])  # noqa: E731
    keys = ("wall", "peak", "VmRSS", "touched VmRSS")
    for dtype in ("bfloat16", "float32"):
        for kind in ("sluice", "hf"):
            m = {k: med(kind, dtype, k) for k in (*keys, "RssAnon", "RssFile", "imports", "pack")}
            after = f"{m['VmRSS']:.2f} ({m['RssAnon']:.2f} + {m['RssFile']:.2f})"
            row = f"{m['wall']:.2f} | {m['peak']:.2f} | {after} | {m['touched VmRSS']:.2f} | {m['imports']:.2f}"
            print(f"| {dtype} | {kind} | {row} | {m['pack']:.2f} |")
        ratio = " | ".join(f"{med('sluice', dtype, k) / med('hf', dtype, k):.2f}x" for k in keys)
        print(f"| {dtype} | Sluice/HF | {ratio} | | |")
    print(f"(GiB; {runs['sluice', 'float32'][0]['params'] / 1e9:.3f}B parameters)")


def family_dir(family: str) -> Path:
    from tests.family_models import make_family_dir

    make = lambda tmp: make_family_dir(tmp, family, **(DIMS | STEP_OVERRIDES[family]))  # noqa: E731
    return built(CACHE / "families" / f"{family}-h{DIMS['hidden_size']}l{DIMS['num_hidden_layers']}w{WINDOW}", make)


class Steps:
    """A family's runner with 16 contexts in its cache, and the three step shapes to time."""

    def __init__(self, family: str) -> None:
        import torch

        from gpu.batch import BatchSpec, ScheduledRow
        from gpu.loading.config import ModelConfig
        from gpu.runner.model_runner import ModelRunner

        per_row = CONTEXT // BLOCK + 1
        self.runner = ModelRunner(
            ModelConfig.from_path(family_dir(family)), "cpu", torch.float32, num_blocks=ROWS * per_row, block_size=BLOCK
        )
        self.params = sum(p.numel() for p in self.runner.model.parameters())
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(3, 49152, (ROWS, CONTEXT + 1), generator=g).tolist()
        blocks = [list(range(i * per_row, (i + 1) * per_row)) for i in range(ROWS)]
        ctx = [CONTEXT - 8 * i for i in range(ROWS)]  # 256 .. 136: unequal, as in a served batch
        for i in range(ROWS):
            self.runner.execute(BatchSpec(0, [ScheduledRow(f"r{i}", i, tokens[i][: ctx[i]], 0, blocks[i], True)]))
        row = lambda i: ScheduledRow(f"r{i}", i, [tokens[i][ctx[i]]], ctx[i], blocks[i], True)  # noqa: E731
        self.shapes = {
            "decode b1": BatchSpec(1, [row(0)]),
            "decode b16": BatchSpec(1, [row(i) for i in range(ROWS)]),
            "prefill 256": BatchSpec(1, [ScheduledRow("r0", 0, tokens[0][:PREFILL], 0, blocks[0], True)]),
        }
        for batch in self.shapes.values():
            assert torch.isfinite(self.runner.execute(batch)).all()

    def once(self, shape: str) -> tuple[float, float]:
        """(wall ms, process CPU ms) of one step."""
        t, c = time.perf_counter(), time.process_time()
        self.runner.execute(self.shapes[shape])
        return (time.perf_counter() - t) * 1e3, (time.process_time() - c) * 1e3


def bench_steps(rounds: int, threads: list[int], quick: bool) -> None:
    """Each family paired with one Llama runner, their steps alternating (ABBA), so both see the same load."""
    import torch

    families = list(STEP_OVERRIDES)  # llama first: its second copy is the control (the noise floor)
    reps = {"decode b1": 10 if quick else 30, "decode b16": 6 if quick else 16, "prefill 256": 2 if quick else 6}
    for family in families:
        family_dir(family)
    print(f"\n## steps: {DIMS}, window {WINDOW}, fp32, {cpu_name()}, torch {torch.__version__}")
    base, params = Steps("llama"), {}
    ratios: dict[tuple[str, int, str], list[tuple[float, ...]]] = {}  # per round: (ms, x wall, x cpu)
    for r in range(rounds):
        print(f"round {r}: load avg {load_avg()}", flush=True)
        for family in families[r % len(families) :] + families[: r % len(families)]:
            other = Steps(family)
            params[family] = other.params
            for n in threads:
                torch.set_num_threads(n)
                for shape, k in reps.items():
                    mine, llama = [], []
                    for i in range(k + 1):  # the first pair is a warm-up
                        for steps, out in ((base, llama), (other, mine))[:: 1 if i % 2 else -1]:
                            out.append(steps.once(shape))
                    mine, llama = mine[1:], llama[1:]
                    m = [statistics.median(t[j] for t in mine) for j in (0, 1)]
                    b = [statistics.median(t[j] for t in llama) for j in (0, 1)]
                    ratios.setdefault((family, n, shape), []).append((m[0], m[0] / b[0], m[1] / b[1]))
            del other
            gc.collect()
        print(f"round {r} done: load avg {load_avg()}", flush=True)
    for n in threads:
        print(f"\n{n} thread(s): ms per step, x Llama in wall time, x Llama in CPU time (medians over {rounds} rounds)")
        print(f"{cpu_name()}; llama = a second Llama runner against the first (the noise floor)")
        print("| family | params (M) | " + " | ".join(reps) + " |")
        print("|---|---:|" + "---:|" * len(reps))
        for family in families:
            cells = []
            for shape in reps:
                ms, wall, cpu = (statistics.median(x[j] for x in ratios[family, n, shape]) for j in (0, 1, 2))
                cells.append(f"{ms:.1f} ({wall:.2f}x, {cpu:.2f}x)")
            print(f"| {family} | {params[family] / 1e6:.1f} | " + " | ".join(cells) + " |")
    print(f"\nload avg at the end: {load_avg()}")


def profile(family: str, threads: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for name in ("llama", family):
        steps = Steps(name)
        torch.set_num_threads(threads)
        for shape in steps.shapes:
            steps.once(shape)
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(6):
                    steps.once(shape)
            print(f"\n### {name} {shape} ({threads} threads, 6 steps), load avg {load_avg()}")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", nargs="+", choices=["load", "steps"], default=["load", "steps"])
    p.add_argument("--repeats", type=int, default=3, help="load: subprocess loads per (library, dtype)")
    p.add_argument("--rounds", type=int, default=3, help="steps: rounds over the families")
    p.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    p.add_argument("--quick", action="store_true", help="fewer reps and rounds")
    p.add_argument("--profile", metavar="FAMILY", choices=list(STEP_OVERRIDES), help="at --threads' first")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(*args.child)
    if args.profile:
        return profile(args.profile, args.threads[0])
    print(f"{cpu_name()}, {os.cpu_count()} CPUs, load avg {load_avg()}")
    if "load" in args.part:
        bench_load(1 if args.quick else args.repeats)
    if "steps" in args.part:
        bench_steps(1 if args.quick else args.rounds, args.threads, args.quick)


if __name__ == "__main__":
    main()

"""Engine throughput: the bare engine loop vs HF `generate`, its step-time breakdown, and async vs sync scheduling.

    python scripts/bench_engine.py [--quick] [--threads 1] [--tokens 32] [--repeats 2] [--skip loop|actors|mixed]
                                   [--device cpu|cuda] [--dtype auto|float32|bfloat16] [--batches 1 8 32]

1. Bare engine loop (Scheduler + BlockManager + StepExecutor in this process, no actors) vs HF transformers
   `generate` on the same weights, threads, batch and prompts (greedy, fixed output length, left-padded batch),
   and the bare loop run one step ahead (planning step N+1 on the main thread while step N runs on a device thread).
2. The sync loop's step time split into schedule / prepare / model / sample / postprocess; overhead = all but model.
3. async vs sync scheduling through the real actors (AsyncLLM): tokens/s, wall ms per step, engine CPU ms per step.
4. What one request whose sampling reads its output (a repetition penalty) costs an async batch: the whole batch
   then steps synchronously while it runs.
Tokens/s count output tokens over the whole run (prefill included) for every method alike. On a shared machine wall
time swings with the load, so the single-threaded methods are also timed in CPU time (`cpu`: the process's
CPU seconds, which other processes' load inflates far less); the stage breakdown is in thread CPU time.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine.block_manager import BlockManager
from actors.engine.config import EngineConfig
from actors.engine.executor import StepExecutor, num_kv_blocks
from actors.engine.request import EngineRequest
from actors.engine.scheduler import Scheduler
from actors.engine.scheduler_actor import needs_history
from frontend.offline import AsyncLLM
from frontend.tokenizer import Tokenizer
from gpu.loading.config import ModelConfig
from gpu.loading.convert import default_model_dir
from gpu.sampling import SamplingRow
from messages.sampling_params import SamplingParams

TEXT = (
    "The history of the Roman Empire spans many centuries. It began with the founding of the city of Rome and grew "
    "through conquest and diplomacy into one of the largest empires of the ancient world. Its legacy includes law. "
)
STAGES = ("schedule", "prepare", "model", "sample", "postprocess")


def load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def make_prompts(tokenizer: Tokenizer, batch: int) -> list[list[int]]:
    """~32-token prompts of slightly different lengths (28..32) and contents: the HF batch needs padding."""
    ids = tokenizer.encode(TEXT * 12)
    return [ids[(7 * i) % 200 : (7 * i) % 200 + 28 + i % 5] for i in range(batch)]


def make_scheduler(config: EngineConfig, model: ModelConfig, prompts: list[list[int]], n: int, num_blocks: int):
    blocks = BlockManager(num_blocks, config.block_size)
    sched = Scheduler(blocks, config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len,
                      model.eos_token_ids)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for i, p in enumerate(prompts):
        sched.add_request(EngineRequest(str(i), list(p), params))
    return sched


def count_steps(config: EngineConfig, model: ModelConfig, prompts: list[list[int]], n: int) -> int:
    """Steps the engine takes for this workload (the schedule does not depend on the sampled ids here)."""
    # (enough blocks: on CUDA the engine sizes its cache to the device, which only a runner can profile)
    sched, steps = make_scheduler(config, model, prompts, n, num_kv_blocks(config, model) or 1 << 16), 0
    while sched.has_unfinished():
        batch = sched.schedule()
        sched.update(batch, [0] * len(batch.sampling_rows))
        steps += 1
    return steps


def timed(fn, *args) -> tuple[float, float, object]:
    """(wall seconds, process CPU seconds, result)."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args)
    return time.perf_counter() - wall, time.process_time() - cpu, out


class BareEngine:
    """The engine's step loop without actors. The runner is wrapped to time its parts in thread CPU time."""

    def __init__(self, config: EngineConfig, model: ModelConfig):
        self.config, self.model = config, model
        self.executor = StepExecutor(config, model, num_kv_blocks(config, model))
        self.times = collections.Counter()
        runner = self.executor.runner
        runner.execute = self._timed(runner.execute, "forward")
        runner._prepare = self._timed(runner._prepare, "prepare")

    def _timed(self, fn, key: str):
        def wrapper(*args):
            t = time.thread_time()
            out = fn(*args)
            self.times[key] += time.thread_time() - t
            return out

        return wrapper

    def _start(self, prompts: list[list[int]], n: int) -> Scheduler:
        self.times.clear()
        self.steps = 0
        return make_scheduler(self.config, self.model, prompts, n, self.executor.runner.num_blocks)

    def _rows(self, sched: Scheduler, batch) -> list[SamplingRow]:
        reqs = [sched.requests[r.request_id] for r in batch.rows if r.sample]
        return [SamplingRow(q.params, q.prompt_token_ids, q.output_token_ids if needs_history(q) else [], None,
                            list(self.model.eos_token_ids)) for q in reqs]  # fmt: skip

    def _update(self, sched: Scheduler, batch, result, out: dict[str, list[int]]) -> None:
        sampled = result.host()[0]
        for o in sched.update(batch, sampled):
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        self.steps += 1

    def run_sync(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        """schedule -> execute -> postprocess, each stage timed."""
        sched, out, t = self._start(prompts, n), {}, self.times
        while sched.has_unfinished():
            t0 = time.thread_time()
            batch = sched.schedule()
            rows = self._rows(sched, batch)
            t1 = time.thread_time()
            result = self.executor.run(batch, rows)
            t2 = time.thread_time()
            self._update(sched, batch, result, out)
            t["schedule"] += t1 - t0
            t["run"] += t2 - t1
            t["postprocess"] += time.thread_time() - t2
        return [out[str(i)] for i in range(len(prompts))]

    def run_ahead(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        """One step ahead, as the actor does: plan step N+1 while step N runs on a device thread."""
        sched, out = self._start(prompts, n), {}
        inflight = collections.deque()
        with concurrent.futures.ThreadPoolExecutor(1) as device:
            while sched.has_unfinished() or inflight:
                batch = None
                if len(inflight) < 2 and not (inflight and any(needs_history(r) for r in sched.running)):
                    batch = sched.schedule()
                    if batch.rows:
                        inflight.append((batch, device.submit(self.executor.run, batch, self._rows(sched, batch))))
                if inflight and (len(inflight) == 2 or batch is None or not batch.rows):
                    done, future = inflight.popleft()
                    self._update(sched, done, future.result(), out)
        return [out[str(i)] for i in range(len(prompts))]

    def breakdown(self) -> dict[str, float]:
        """Mean CPU ms per step of each stage of the last sync run."""
        t = self.times
        s = dict(schedule=t["schedule"], prepare=t["prepare"], model=t["forward"] - t["prepare"],
                 sample=t["run"] - t["forward"], postprocess=t["postprocess"])  # fmt: skip
        return {k: 1e3 * v / self.steps for k, v in s.items()}


def hf_generate(model, prompts: list[list[int]], n: int, pad: int) -> list[list[int]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad
    )
    return out[:, width:].tolist()


def bench_vs_hf(args, engine: BareEngine, tokenizer: Tokenizer, model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    dtype = engine.executor.runner.dtype
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    pad, n = engine.model.eos_token_ids[0], args.tokens
    warm = make_prompts(tokenizer, 2)
    engine.run_sync(warm, 4), hf_generate(hf, warm, 4, pad)
    print(f"\n## 1. bare engine loop vs HF generate (greedy, {n} output tokens, prompts 28-32 tokens; output tok/s)")
    print("batch rep  engine    HF  ratio | engine cpu  HF cpu  ratio | ahead  ahead/sync | HF match  load")
    stages = {}
    for b in args.batches:
        prompts, ratios = make_prompts(tokenizer, b), []
        for rep in range(args.repeats):
            e_wall, e_cpu, got = timed(engine.run_sync, prompts, n)
            stages[b] = engine.breakdown()
            h_wall, h_cpu, ref = timed(hf_generate, hf, prompts, n, pad)
            a_wall, _, ahead = timed(engine.run_ahead, prompts, n)
            assert ahead == got, "the one-step-ahead loop's output differs from the sync loop's"
            match = sum(g == r for g, r in zip(got, ref, strict=True)) / b
            ratios.append((h_wall / e_wall, h_cpu / e_cpu))
            k = b * n
            print(f"{b:5d} {rep:3d} {k / e_wall:7.1f} {k / h_wall:5.1f} {h_wall / e_wall:5.2f}x | "
                  f"{k / e_cpu:10.1f} {k / h_cpu:7.1f} {h_cpu / e_cpu:5.2f}x | "
                  f"{k / a_wall:5.1f} {e_wall / a_wall:10.2f}x | {match:8.0%}  {load()}")  # fmt: skip
        wall, cpu = (statistics.median(r[i] for r in ratios) for i in (0, 1))
        print(f"batch {b}: engine/HF {wall:.2f}x wall, {cpu:.2f}x cpu (median of {args.repeats})")
    print("\n## 2. step-time breakdown of the sync loop (CPU ms per step, mean over the last run)")
    print("batch " + " ".join(f"{s:>11s}" for s in STAGES) + "    step  overhead (all but model)")
    for b, ms in stages.items():
        step = sum(ms.values())
        print(f"{b:5d} " + " ".join(f"{ms[s]:11.3f}" for s in STAGES)
              + f" {step:7.2f}  {100 * (step - ms['model']) / step:6.2f}%")  # fmt: skip


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def serve(
    config: EngineConfig, prompts: dict[int, list[list[int]]], n: int, first: SamplingParams | None = None
) -> dict[int, tuple]:
    """Per batch: output tokens/s, wall seconds, engine-process CPU seconds, load, through the real actors.
    first: the first request's own sampling parameters (the others are greedy)."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    results = {}
    async with AsyncLLM(config) as llm:
        engine = llm.system.pids()["engine"]
        await llm.generate(next(iter(prompts.values()))[:1], params)  # warm-up
        for b, batch in prompts.items():
            wall, cpu = time.perf_counter(), cpu_seconds(engine)
            if first is None:
                outs = await llm.generate(batch, params)
            else:
                one, rest = await asyncio.gather(llm.generate(batch[:1], first), llm.generate(batch[1:], params))
                outs = one + rest
            wall, cpu = time.perf_counter() - wall, cpu_seconds(engine) - cpu
            assert all(len(o.token_ids) == n for o in outs)
            results[b] = (b * n / wall, wall, cpu, load())
    return results


def bench_async(args, model_dir: Path, model: ModelConfig, tokenizer: Tokenizer) -> None:
    n = args.tokens
    prompts = {b: make_prompts(tokenizer, b) for b in args.async_batches}
    configs = {m: engine_config(args, model_dir, async_scheduling=m) for m in (True, False)}
    runs = collections.defaultdict(list)
    for mode in [True, False] + [False, True] * (args.repeats - 1):  # ABBA: drift in the load hits both alike
        for b, r in asyncio.run(serve(configs[mode], prompts, n)).items():
            runs[b, mode].append(r)
    print(f"\n## 3. async vs sync scheduling through the actors (AsyncLLM, {n} output tokens; medians)")
    print("batch steps | tok/s async  sync  ratio | ms/step async   sync | engine cpu ms/step async  sync | loads")
    for b in args.async_batches:
        steps = count_steps(configs[True], model, prompts[b], n)
        (tok_a, wall_a, cpu_a), (tok_s, wall_s, cpu_s) = (
            [statistics.median(r[i] for r in runs[b, m]) for i in (0, 1, 2)] for m in (True, False)
        )
        loads = " ".join(r[3] for m in (True, False) for r in runs[b, m])
        print(f"{b:5d} {steps:5d} | {tok_a:11.1f} {tok_s:5.1f} {tok_a / tok_s:5.2f}x | "
              f"{1e3 * wall_a / steps:13.1f} {1e3 * wall_s / steps:6.1f} | "
              f"{1e3 * cpu_a / steps:24.1f} {1e3 * cpu_s / steps:5.1f} | {loads}")  # fmt: skip


def engine_config(args, model_dir: Path, **kw) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir), engine_threads=args.threads, device=args.device, dtype=args.dtype, max_num_seqs=64, **kw
    )


def bench_mixed(args, model_dir: Path, tokenizer: Tokenizer) -> None:
    b, n = max(args.async_batches), args.tokens
    prompts = {b: make_prompts(tokenizer, b)}
    penalty = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, repetition_penalty=1.1)
    runs = collections.defaultdict(list)
    for _ in range(args.repeats):
        for name, mode, first in (("async", True, None), ("async+1", True, penalty), ("sync", False, None)):
            runs[name].append(
                asyncio.run(serve(engine_config(args, model_dir, async_scheduling=mode), prompts, n, first))[b][0]
            )
    tok = {name: statistics.median(r) for name, r in runs.items()}
    print(
        f"\n## 4. batch {b}, {n} output tokens: one request with a repetition penalty (the batch steps synchronously)"
    )
    print(
        f"tok/s all greedy async {tok['async']:.1f}, with the penalty request {tok['async+1']:.1f} "
        f"({tok['async+1'] / tok['async']:.3f}x), all greedy sync {tok['sync']:.1f} ({tok['sync'] / tok['async']:.3f}x)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer tokens and batch sizes (~90 s on a quiet machine)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for every method (default 1)")
    ap.add_argument("--tokens", type=int, help="output tokens per request (default 32, quick 16)")
    ap.add_argument("--repeats", type=int, help="repetitions of each measurement (default 2, quick 1)")
    ap.add_argument("--skip", choices=["loop", "actors", "mixed"], action="append", default=[])
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32 or bfloat16")
    ap.add_argument("--batches", type=int, nargs="*", help="batch sizes of the bare loop (default 1 8 32)")
    args = ap.parse_args()
    args.tokens = args.tokens or (16 if args.quick else 32)
    args.repeats = args.repeats or (1 if args.quick else 2)
    args.batches = args.batches or ([1, 8] if args.quick else [1, 8, 32])
    args.async_batches = [1, 16] if args.quick else [1, 16, 64]
    torch.set_num_threads(args.threads)
    model_dir = default_model_dir()
    model = ModelConfig.from_path(model_dir)
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(f"# bench_engine {time.strftime('%Y-%m-%d %H:%M')}: {model_dir.name} {args.dtype} on {where}, "
          f"torch threads {args.threads} for every method (more threads than free cores was measured to cut decode "
          f"5x), load {load()}")  # fmt: skip
    tokenizer = Tokenizer.from_model_dir(model_dir)
    if "loop" not in args.skip:
        bench_vs_hf(args, BareEngine(engine_config(args, model_dir), model), tokenizer, model_dir)
    if "actors" not in args.skip:
        bench_async(args, model_dir, model, tokenizer)
    if "mixed" not in args.skip:
        bench_mixed(args, model_dir, tokenizer)


if __name__ == "__main__":
    main()

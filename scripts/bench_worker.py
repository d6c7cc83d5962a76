"""The worker link's cost (issue 17): what one ExecuteStep -> StepResult round costs per step, against a batch-1 step.

    python scripts/bench_worker.py [--quick] [--batches 1 16 64] [--tokens 64] [--threads N] [--blocks 64]
                                   [--link-only | --no-served]

1. Per decode step at batch B, in this process (thread CPU time, median of many): the scheduler's schedule + update
   (rows of --blocks blocks of random tokens, prefix caching on, steady decoding), building the ExecuteStep from the
   scheduler's requests, encoding and decoding it (the process placement only), the worker's persistent-batch
   update and SamplingRows, the runner's block tables (gpu/runner/slot_tables.py), building the StepResult lists and
   encoding and decoding them (process only); printed as a ratio to the same run's batch-1 decode step of the model
   (forward + sampling, StepExecutor.run). Each row's context holds --blocks KV blocks, its row sending none (steady
   decoding: the scheduler's rows) or, for comparison, its whole table.
2. The intake's latency while a step runs: how late an event loop in this process wakes from 1 ms sleeps while decode
   steps at batch B run on another thread (the inline worker's device thread beside the scheduler's loop), with the
   native layer loop (the GIL released through a forward) and the Python one.
3. Through the actors (AsyncLLM, greedy, B requests of --tokens tokens): output tokens/s with the worker inline vs
   in its own process, async and sync scheduling; the ratio process / inline.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine.block_manager import BlockManager
from actors.engine.config import EngineConfig
from actors.engine.executor import num_kv_blocks
from actors.engine.request import EngineRequest
from actors.engine.scheduler import Scheduler
from actors.engine.worker import Worker
from actors.engine.worker_link import execute_step
from frontend.offline import AsyncLLM
from frontend.tokenizer import Tokenizer
from gpu.batch import BatchSpec, ScheduledRow
from gpu.loading.config import ModelConfig
from gpu.loading.convert import default_model_dir
from gpu.runner.slot_tables import SlotTables
from gpu.sampling import SamplingRow
from messages.codec import Codec
from messages.sampling_params import SamplingParams
from messages.step import StepResult
from messages.wire import TokenLogprobs
from scripts.bench_engine import load, make_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def cpu_us(fn, repeats: int) -> float:
    """Median thread CPU microseconds of fn()."""
    times = []
    for _ in range(repeats):
        t = time.thread_time()
        fn()
        times.append(time.thread_time() - t)
    return 1e6 * statistics.median(times)


def decode_batch(batch: int, blocks: int, whole: bool, prompt_len: int = 32) -> tuple[BatchSpec, dict]:
    """A decode step of `batch` requests, each 32 prompt + 16 output tokens in, `blocks` blocks of its own (the
    row sends them all, or, `whole` false, none: its slot holds them)."""
    rows, reqs = [], {}
    for i in range(batch):
        req = EngineRequest(f"r{i}", list(range(100, 100 + prompt_len)), GREEDY, output_token_ids=list(range(16)))
        req.worker_outputs = 15  # the worker holds all but the last (a delta only if its sampling read its output)
        reqs[req.request_id] = req
        table, sent = list(range(blocks * i, blocks * (i + 1))), 0 if whole else blocks
        rows.append(ScheduledRow(req.request_id, i, [7], req.num_tokens - 1, table[sent:], True, output_position=16,
                                 blocks_from=sent))  # fmt: skip
    return BatchSpec(step=1, rows=rows), reqs


def message_costs(worker: Worker, batch: int, blocks: int, whole: bool, repeats: int) -> dict[str, float]:
    codec, spec = Codec(), decode_batch(batch, blocks, whole)
    msg, _ = execute_step(spec[0], spec[1], 1, 0, [])
    tables = SlotTables()
    tables.resolve(0, decode_batch(batch, blocks, True)[0].rows)  # (the slots hold their tables)

    def build():  # (greedy rows: no deltas, as in steady decoding)
        execute_step(spec[0], spec[1], 1, 0, [])

    def persistent():  # the worker's side: its persistent batch after the deltas, and the step's SamplingRows
        worker.update_batch(msg)
        worker.sampling_rows(spec[0])

    worker.requests = {}
    worker.update_batch(execute_step(spec[0], {k: EngineRequest(k, v.prompt_token_ids, GREEDY, output_token_ids=list(range(16)))
                                               for k, v in spec[1].items()}, 1, 0, [])[0])  # fmt: skip
    result = StepResult(epoch=1, seq=0, step=1, sampled=list(range(batch)),
                        logprobs=TokenLogprobs([-0.1] * batch, [1] * batch))  # fmt: skip
    sampled = torch.arange(batch)
    out = {
        "build ExecuteStep": cpu_us(build, repeats),
        "persistent batch + rows": cpu_us(persistent, repeats),
        "block tables": cpu_us(lambda: tables.resolve(1, spec[0].rows), repeats),
        "StepResult lists": cpu_us(lambda: sampled.tolist(), repeats),
        "codec ExecuteStep": cpu_us(lambda: codec.decode(codec.encode(msg)), repeats),
        "codec StepResult": cpu_us(lambda: codec.decode(codec.encode(result)), repeats),
    }
    out["inline total"] = sum(out[k] for k in ("build ExecuteStep", "persistent batch + rows", "block tables",
                                                "StepResult lists"))  # fmt: skip
    out["process total"] = out["inline total"] + out["codec ExecuteStep"] + out["codec StepResult"]
    return out


def scheduler_us(batch: int, blocks: int, repeats: int) -> float:
    """Median thread CPU us of a decode step's schedule() + update() with `batch` requests of `blocks` blocks' worth of
    random prompt tokens (distinct: every block registers), prefix caching on, after their prefill."""
    rng = random.Random(0)
    longest = 16 * (blocks + 2) + repeats  # (tokens: a request's prompt and every step's output)
    manager = BlockManager((batch + 1) * (longest // 16 + 1), 16, enable_caching=True)
    scheduler = Scheduler(manager, batch, 8192, longest, [2])
    for i in range(batch):
        prompt = [rng.randrange(3, 40000) for _ in range(16 * blocks)]
        scheduler.add_request(EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=repeats + 8, ignore_eos=True)))

    def step():
        batch = scheduler.schedule()
        scheduler.update(batch, [rng.randrange(3, 40000) for _ in range(batch.num_samples)])

    while not all(r.output_token_ids for r in scheduler.requests.values()):
        step()
    return cpu_us(step, repeats)


def step_ms(worker: Worker, repeats: int) -> float:
    """Median wall ms of a batch-1 decode step of the model (StepExecutor.run), after a 32-token prefill."""
    ex, row = worker.executor, SamplingRow(GREEDY, [], [], 0, [])
    ex.run(BatchSpec(0, [ScheduledRow("a", 0, list(range(100, 132)), 0, [0, 1, 2], True)]), [row])
    times = []
    for i in range(repeats):
        batch = BatchSpec(1 + i, [ScheduledRow("a", 0, [7], 32, [0, 1, 2], True)])
        t = time.perf_counter()
        ex.run(batch, [row])
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def decode_steps(worker: Worker, batch: int, steps: int) -> None:
    """`steps` decode steps of `batch` rows through StepExecutor.run (0: their 32-token prefills, a row a step)."""
    ex, rows = worker.executor, [SamplingRow(GREEDY, [], [], 0, []) for _ in range(batch)]

    def row(i: int, tokens: list[int], computed: int) -> ScheduledRow:
        return ScheduledRow(f"r{i}", i, tokens, computed, [3 * i, 3 * i + 1, 3 * i + 2], True)

    for i in range(batch if steps == 0 else 0):
        ex.run(BatchSpec(i, [row(i, list(range(100, 132)), 0)]), rows[i : i + 1])
    for s in range(steps):
        ex.run(BatchSpec(batch + s, [row(i, [7], 32) for i in range(batch)]), rows)


async def intake_lateness(worker: Worker, batch: int, steps: int) -> list[float]:
    """How late (ms) this event loop wakes from 1 ms sleeps while decode steps run on another thread, as the inline
    worker's device thread runs them beside the scheduler's loop and its intake (their prefills before): sorted."""
    decode_steps(worker, batch, 0)
    running, late = asyncio.get_running_loop().run_in_executor(None, decode_steps, worker, batch, steps), []
    while not running.done():
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        late.append(1e3 * (time.perf_counter() - t) - 1.0)
    await running
    return sorted(late)


async def served(config: EngineConfig, prompts: list[list[int]], tokens: int) -> float:
    """Output tokens/s of the whole batch through the actors."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    async with AsyncLLM(config) as llm:
        await llm.generate(prompts[:1], params)  # warm-up
        t = time.perf_counter()
        await llm.generate(prompts, params)
        return len(prompts) * tokens / (time.perf_counter() - t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--blocks", type=int, default=64, help="KV blocks per row in part 1 (64: 1,024 tokens)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--link-only", action="store_true", help="part 1 only")
    parser.add_argument("--no-served", action="store_true", help="parts 1 and 2 only")
    args = parser.parse_args()
    model_dir = default_model_dir()
    # (1 GiB of KV cache: sized to a GPU, it would leave part 2's engines no room beside it)
    config = EngineConfig(
        model=str(model_dir), engine_threads=args.threads, max_num_seqs=max(args.batches), kv_cache_memory_gb=1.0
    )
    torch.set_num_threads(config.threads())
    model = ModelConfig.from_path(str(model_dir))
    worker = Worker(config, model, num_kv_blocks(config, model))
    repeats = 50 if args.quick else 200
    base = step_ms(worker, 20 if args.quick else 60)
    print(f"load {load()}; {torch.get_num_threads()} threads; batch-1 decode step {base:.2f} ms (model + sampling)")
    print("\n1. per-step cost of the scheduler and the link (us, thread CPU; % of the batch-1 step)")
    for b, whole in ((b, whole) for b in args.batches for whole in (False, True)):
        if not whole:
            us = scheduler_us(b, args.blocks, repeats)
            print(f"  B={b:3d}: scheduler (schedule + update) {us:.1f} us = {us / (10 * base):.2f} %")
        costs = message_costs(worker, b, args.blocks, whole, repeats)
        parts = ", ".join(f"{k} {v:.1f}" for k, v in costs.items() if "total" not in k)
        print(f"  B={b:3d}, {'whole tables' if whole else 'new blocks only (the scheduler rows)'}: {parts}")
        for k in ("inline total", "process total"):
            print(f"         {k}: {costs[k]:.1f} us = {costs[k] / (10 * base):.2f} %")
    if args.link_only:
        return
    print("\n2. the intake's latency while steps run (ms late waking from a 1 ms sleep; inline: the same process)")
    model_loop = worker.executor.runner.model.model
    for name, loop in (("native layer loop", model_loop.native_loop), ("Python layer loop", None)):
        model_loop.native_loop = loop
        for b in args.batches:
            late = asyncio.run(intake_lateness(worker, b, 10 if args.quick else 40))
            print(f"  {name}, B={b:3d}: p50 {late[len(late) // 2]:.2f}, p99 {late[int(0.99 * len(late))]:.2f}, "
                  f"max {late[-1]:.2f} ms")  # fmt: skip
    if args.no_served:
        return
    print("\n3. served through the actors: output tokens/s (process / inline)")
    tokenizer = Tokenizer.from_model_dir(model_dir)
    for b in args.batches:
        prompts = make_prompts(tokenizer, b)
        for sync in (False, True):
            rates = {}
            for placement in ("inline", "process"):
                cfg = EngineConfig(model=str(model_dir), engine_threads=args.threads, max_num_seqs=max(b, 1),
                                   worker=placement, async_scheduling=not sync)  # fmt: skip
                rates[placement] = asyncio.run(served(cfg, prompts, args.tokens))
            mode = "sync " if sync else "async"
            print(f"  B={b:3d} {mode}: inline {rates['inline']:7.1f}, process {rates['process']:7.1f} tok/s "
                  f"(ratio {rates['process'] / rates['inline']:.3f})")  # fmt: skip


if __name__ == "__main__":
    main()

"""CUDA-only checks of the device paths (skipped without a GPU; the sampler's exactness on CUDA is in
test_sampler_distribution, greedy parity with HF on CUDA in test_model_parity):

- the step (planning, upload, forward, sampling, the relay of sampled ids, the host copy's enqueue) never
  synchronizes the host with the device: `torch.cuda.set_sync_debug_mode("error")` around every step makes any
  `.item()`, `.tolist()`, `nonzero()`, blocking copy or device-wide synchronize raise; only the host copy
  (`Launched.result()`) waits, on its own event;
- one step ahead (placeholders filled on the device from the relay buffer) gives the same greedy and seeded
  tokens as synchronous steps, in bf16 and fp32, through the bare loop and through the real actors;
- a seeded request's tokens do not depend on its batch.
"""

from __future__ import annotations

import collections
import itertools
from pathlib import Path

import pytest
import torch

from actors.engine import kv_sizing
from actors.engine.block_manager import BlockManager
from actors.engine.config import EngineConfig, SpeculativeConfig
from actors.engine.request import EngineRequest
from actors.engine.scheduler import Scheduler
from actors.engine.scheduler_actor import needs_history
from actors.engine.speculative import NgramProposer
from actors.engine.worker import Worker
from actors.engine.worker_link import execute_step
from frontend.offline import AsyncLLM
from gpu.loading.config import ModelConfig
from messages.sampling_params import SamplingParams as SP
from tests.cancel_harness import wait_for

pytestmark = pytest.mark.cuda

MIX = [
    SP(temperature=0.0, max_tokens=12),
    SP(temperature=0.8, top_p=0.9, seed=21, max_tokens=12, logprobs=3),
    SP(temperature=0.7, top_k=20, seed=11, max_tokens=12),
    SP(temperature=1.0, min_p=0.05, seed=5, max_tokens=12, prompt_logprobs=2),
    SP(temperature=0.0, max_tokens=12, logit_bias={5: 3.0}, min_tokens=4),
    SP(temperature=0.9, top_k=500, top_p=0.99, max_tokens=12, seed=3),
]
HISTORY = [  # sampling that reads the output: the loop steps synchronously while these run
    SP(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.4, seed=2, max_tokens=10),
    SP(temperature=0.0, bad_words_token_ids=[[7], [9, 10]], max_tokens=10),
]
UNSEEDED = SP(temperature=0.8, top_k=40, top_p=0.9, max_tokens=12)  # FlashInfer's rows, when it is installed
PROMPTS = [[1, *range(100 + 7 * i, 100 + 7 * i + 5 + 3 * i)] for i in range(8)]


def run_loop(worker: Worker, model: ModelConfig, params: list[SP], depth: int, proposer=None) -> dict:
    """The engine's step loop in one thread (as the scheduler actor drives the inline worker), every step planned and
    launched under sync-debug mode "error"; results are read back (the step's one wait) outside it."""
    sched = Scheduler(BlockManager(256, 16), 16, 64, 512, model.eos_token_ids)
    for i, p in enumerate(params):
        sched.add_request(EngineRequest(str(i), list(PROMPTS[i % len(PROMPTS)]), p))
    inflight, out, epoch = collections.deque(), collections.defaultdict(list), worker.epoch + 1
    seqs = itertools.count()  # the launched steps' numbers: consecutive, as the worker requires
    while sched.has_unfinished() or inflight:
        batch = None
        if len(inflight) < depth and not (inflight and any(needs_history(r) for r in sched.running)):
            drafts = proposer.propose(sched.speculation_candidates()) if proposer and not inflight else None
            torch.cuda.set_sync_debug_mode("error")
            try:
                batch = sched.schedule(drafts)
                if batch.rows:
                    inflight.append(
                        (batch, worker.launch(execute_step(batch, sched.requests, epoch, next(seqs), [])[0]))
                    )
            finally:
                torch.cuda.set_sync_debug_mode("default")
        if inflight and (len(inflight) >= depth or batch is None or not batch.rows):
            done, launched = inflight.popleft()
            result = launched.result()
            assert result.error is None, result.error
            for o in sched.update(done, result.sampled, result.num_emitted):
                out[o.request_id] += o.new_token_ids
    return dict(out)


@pytest.fixture(scope="module")
def executors(tiny_model_dir):
    """A Worker per dtype on the tiny model (built once: loading is the slow part)."""
    model = ModelConfig.from_path(tiny_model_dir)

    def make(dtype: str) -> Worker:
        config = EngineConfig(model=str(tiny_model_dir), device="cuda", dtype=dtype, max_num_seqs=16)
        return Worker(config, model, 256)

    return model, {dtype: make(dtype) for dtype in ("bfloat16", "float32")}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_steps_never_sync_and_one_ahead_equals_sync(executors, dtype):
    model, by_dtype = executors
    worker, params = by_dtype[dtype], [*MIX, *HISTORY, UNSEEDED]
    ahead, sync = (run_loop(worker, model, params, depth) for depth in (2, 1))
    assert all(len(ahead[str(i)]) == p.max_tokens for i, p in enumerate(params))
    unseeded = str(len(params) - 1)  # drawn afresh each run: only its length is compared
    del ahead[unseeded], sync[unseeded]
    assert ahead == sync


def test_speculative_steps_never_sync(executors):
    """ngram drafts verified on the device (multi-token rows, num_emitted, the relay of each row's last token)."""
    model, by_dtype = executors
    worker = by_dtype["float32"]
    params = [SP(temperature=0.0, max_tokens=24), SP(temperature=0.7, seed=4, max_tokens=24)]
    proposer = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1))
    spec = run_loop(worker, model, params, depth=1, proposer=proposer)
    assert spec == run_loop(worker, model, params, depth=1)


def test_seeded_tokens_do_not_depend_on_the_batch(executors):
    """In float32: a seeded row's draws do not depend on the batch, and the id-order CDF absorbs the last-bit
    differences of batch-shaped GEMMs. bfloat16 logits of one row differ across batch shapes by far more (the first
    GPU run: the first token differed), which moves seeded draws over this near-flat random model."""
    model, by_dtype = executors
    seeded = SP(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16)
    alone = run_loop(by_dtype["float32"], model, [seeded], depth=2)["0"]
    crowd = run_loop(by_dtype["float32"], model, [*MIX, seeded], depth=2)[str(len(MIX))]
    assert alone == crowd


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
async def test_actors_async_equals_sync(tiny_model_dir, dtype):
    """Through the real engine process on CUDA: async and sync scheduling give the same greedy and seeded tokens."""
    params = [SP(temperature=0.0, max_tokens=16, ignore_eos=True), SP(temperature=0.9, seed=9, max_tokens=16)]
    results = []
    for mode in (True, False):
        config = EngineConfig(
            model=str(tiny_model_dir), device="cuda", dtype=dtype, async_scheduling=mode, num_kv_blocks=256
        )
        async with AsyncLLM(config) as llm:
            outs = [await llm.generate(PROMPTS, p) for p in params]
        results.append([[o.token_ids for o in batch] for batch in outs])
    assert results[0] == results[1]


async def test_the_worker_process_sizes_the_cache_to_the_card(tiny_model_dir):
    """The default on CUDA: the worker in its own process profiles the card (a fraction of it) and publishes the
    count; the scheduler, started after it, holds as many blocks; a restarted worker allocates the same."""
    config = EngineConfig(  # (no graphs: nothing to capture at each of its two starts)
        model=str(tiny_model_dir), device="cuda", gpu_memory_utilization=0.3, max_num_seqs=16, enforce_eager=True
    )
    assert config.placed().worker == "process"
    params = SP(temperature=0.0, max_tokens=8, ignore_eos=True)
    async with AsyncLLM(config) as llm:
        first = [o.token_ids for o in await llm.generate(PROMPTS, params)]
        published = kv_sizing.published(llm.system.rundir, config.replica.worker)
        engine, _ = await llm.fresh_stats()
        assert published is not None and int(engine.cache_config["num_gpu_blocks"]) == published
        worker, path = config.replica.worker, Path(llm.system.rundir) / f"{config.replica.worker}.kv-blocks"
        written, old = (path.stat().st_ino, path.stat().st_mtime_ns), llm.system.pids()[worker]
        llm.system.kill(worker)  # a restart reads the count (not written again): the same blocks, the same tokens
        await wait_for(lambda: llm.system.pids().get(worker, old) != old and llm.system.state[worker] == "up", 120)
        assert [o.token_ids for o in await llm.generate(PROMPTS, params)] == first
        assert (path.stat().st_ino, path.stat().st_mtime_ns) == written

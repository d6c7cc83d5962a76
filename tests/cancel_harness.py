"""Shared by the cancellation tests: engines on the tiny random Llama, the step gate, the idle invariant.

Engines are expensive to start (a process importing torch), so the fault-free gated engine is
session-scoped and shared by the modules that import its fixture.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import msgspec
import pytest

from actors.engine.config import EngineConfig
from frontend.offline import AsyncLLM
from messages.names import SCHEDULER
from messages.sampling_params import SamplingParams
from messages.wire import CheckIdle, Finished, Probe
from scripts.chaos_check import Outcome
from tests.tiny_model import make_tiny_model_dir
from tests.waits import eventually

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
LONG_PROMPT = list(range(1000, 1100))  # 100 tokens: four chunked-prefill steps at a 32-token budget
STOP_PROMPT = [11, 12, 13]
STOP_BASE = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


async def abort_once_decoding(llm: AsyncLLM, prompt: list[int], params: SamplingParams) -> Finished:
    """Stream a request and abort it when its first tokens arrive (mid-decode, driven by its own output)."""
    rid, aborted = llm.new_id(), False
    async for item in llm.stream(prompt, params, rid):
        if isinstance(item, Finished):
            return item
        if item.token_ids and not aborted:
            llm.abort(rid)
            aborted = True
    raise AssertionError("a stream ends with Finished")


def engine_config(model_dir, **overrides) -> EngineConfig:
    options = {
        "model": str(model_dir),
        "num_kv_blocks": 64,
        "block_size": 16,
        "max_model_len": 256,
        "max_num_batched_tokens": 32,
        "max_num_seqs": 8,
        "engine_threads": 1,
        "dtype": "float32",  # outputs are compared with HF's fp32 (bf16 on CUDA: the server fixture, test_cuda)
        "step_gate": True,
        "stats_interval_s": 0.05,
        "worker": "inline",  # (as on CPU, on a GPU host too, where "auto" would place it in a process)
        **overrides,
    }
    return EngineConfig(**options)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-cancel") / "model", seed=0)


@pytest.fixture(scope="session")
async def clean_llm(model_dir):
    """A fault-free engine (async scheduling, step gate available): the reference for faulty runs."""
    async with AsyncLLM(engine_config(model_dir)) as llm:
        yield llm


async def wait_for(cond, timeout: float = 20.0, what: str = "condition") -> None:
    await eventually(cond, what, timeout, every=0.005)


def gate(llm: AsyncLLM, steps: int | None) -> None:
    """Let `steps` more engine steps finish (None: all of them)."""
    llm.client.tell(SCHEDULER, Probe(seq=-1 if steps is None else steps))


async def scheduler_state(llm: AsyncLLM) -> dict[str, int]:
    return (await llm.client.ask(SCHEDULER, CheckIdle(), timeout=10)).details


async def wait_state(llm: AsyncLLM, timeout: float = 20.0, **expected: int) -> dict[str, int]:
    """Poll the scheduler until its state has every `expected` value (a barrier: the asks queue behind
    every message the client sent before, on the same FIFO link)."""

    async def reached() -> dict[str, int] | None:
        state = await scheduler_state(llm)
        return state if all(state[k] == v for k, v in expected.items()) else None

    return await eventually(reached, f"the scheduler's {expected}", timeout, every=0.005)


async def assert_idle(llm: AsyncLLM, timeout: float = 15.0) -> None:
    """The idle invariant: no per-request state anywhere, every KV block free, no pending asks."""
    reports = {}

    async def idle() -> bool:
        reports.update(await llm.idle_reports())
        return not any(v for details in reports.values() for v in details.values())

    try:
        await eventually(idle, "the idle invariant", timeout)
    except AssertionError:
        streams = {rid: (s.record.attempt, s.record.num_tokens) for rid, s in llm.client.streams.live.items()}
        pytest.fail(f"not idle: {reports}; the client's streams (copy, tokens): {streams}")


@dataclass
class Run(Outcome):
    """One request consumed in the background: what its stream delivered."""

    task: asyncio.Task | None = None

    async def wait_tokens(self, n: int) -> None:
        await wait_for(lambda: len(self.token_ids) >= n or self.finished is not None, what=f"{n} tokens")

    async def done(self, timeout: float = 20.0) -> Finished:
        await asyncio.wait_for(asyncio.shield(self.task), timeout)
        return self.finished


def start(llm: AsyncLLM, prompt, params: SamplingParams, request_id: str | None = None) -> Run:
    run = Run(request_id or llm.new_id())

    async def consume():
        async for item in llm.stream(prompt, params, run.request_id):
            assert run.finished is None, "output after Finished"
            run.add(item)

    run.task = asyncio.create_task(consume())
    return run


async def start_held(llm: AsyncLLM, prompt, params: SamplingParams) -> Run:
    """Start a request with the gate closed: returns once its first step has executed and is held."""
    gate(llm, 0)
    run = start(llm, prompt, params)
    await wait_state(llm, held_steps=1)
    return run


async def stop_case(llm: AsyncLLM) -> tuple[Run, SamplingParams, int]:
    """(free, params, j): STOP_PROMPT's fault-free run, and STOP_BASE with a stop string that first
    matches inside the text of its token j."""
    free = start(llm, STOP_PROMPT, STOP_BASE)
    await free.done()
    stop, j = stop_string_at(llm.tokenizer, free.token_ids)
    return free, msgspec.structs.replace(STOP_BASE, stop=[stop]), j


def stop_string_at(tokenizer, token_ids: list[int], first: int = 3) -> tuple[str, int]:
    """(stop, j): a stop string whose first match in the decoded output ends inside the text of
    token j, the first token from `first` on that completes some text."""
    for j in range(first, len(token_ids)):
        before, upto = tokenizer.decode(token_ids[:j]), tokenizer.decode(token_ids[: j + 1])
        if len(upto) > len(before) and upto.startswith(before) and "\ufffd" not in upto:
            stop = next(upto[-m:] for m in range(1, len(upto) + 1) if upto.find(upto[-m:]) + m > len(before))
            return stop, j
    raise AssertionError("no token completes any text")

"""LoRA rows through a worker's and the engine's deaths (one engine: a tiny Llama, two PEFT adapters, the worker in a
process of its own): each adapter's greedy tokens equal PEFT's, and requests of both adapters and of the base, their
steps held in flight while the worker is killed (-9), or streaming while the engine process is, end with exactly
PEFT's tokens (the recomputed rows carry their adapters; the new processes hold the adapters again). Speculative verification rows through an adapter: tests/test_lora_model.py."""

from __future__ import annotations

import asyncio

import pytest

from actors.engine.config import LoraConfig, LoraModule
from frontend.offline import AsyncLLM
from gpu.loading.lora import adapter_digest
from messages.sampling_params import SamplingParams
from tests.cancel_harness import assert_idle, engine_config, gate, start, start_held, wait_for, wait_state
from tests.lora_adapters import make_adapter
from tests.test_actor_death import restarted
from tests.test_lora_e2e import peft_greedy

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def setup(family_dir_of, tmp_path_factory):
    base, root = family_dir_of("llama"), tmp_path_factory.mktemp("compose")
    adapters = [make_adapter(base, root / f"a{i}", seed=20 + i) for i in range(2)]
    prompt = list(range(500, 540))
    expected = {i: peft_greedy(base, a, prompt, NEW_TOKENS)[0] for i, a in enumerate(adapters)}
    expected[None] = peft_greedy(base, None, prompt, NEW_TOKENS)[0]
    return base, adapters, prompt, expected


def params(digest: str | None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, lora=digest)


async def test_lora_rows_survive_a_worker_and_an_engine_kill(setup):
    base, adapters, prompt, expected = setup
    digests = [adapter_digest(a) for a in adapters]
    lora = LoraConfig(modules=[LoraModule(name=f"a{i}", path=str(a), digest=d)
                               for i, (a, d) in enumerate(zip(adapters, digests, strict=True))])  # fmt: skip
    config = engine_config(base, worker="process", lora=lora)
    choices = [0, 1, None]
    async with AsyncLLM(config) as llm:
        gate(llm, None)
        for c in choices:  # fault-free, one at a time
            run = start(llm, prompt, params(None if c is None else digests[c]))
            await run.done()
            assert run.token_ids == expected[c], f"adapter {c}"
        # held in flight, then the worker killed
        first = await start_held(llm, prompt, params(digests[0]))
        runs = [first, *(start(llm, prompt, params(None if c is None else digests[c])) for c in choices[1:])]
        old = llm.system.pids()["worker"]
        llm.system.kill("worker")
        await wait_for(lambda: llm.system.pids().get("worker", old) != old and llm.system.state["worker"] == "up")
        gate(llm, None)
        await asyncio.gather(*(r.done() for r in runs))
        for c, run in zip(choices, runs, strict=True):
            assert run.token_ids == expected[c], f"adapter {c} after the kill"
        stats, _ = await llm.fresh_stats()
        assert stats.worker_resets_total == 1
        # the engine process killed (-9) with LoRA rows in flight: the client resumes each copy, with its adapter
        gate(llm, 2)
        runs = [start(llm, prompt, params(None if c is None else digests[c])) for c in choices]
        await wait_state(llm, held_steps=1)
        old = llm.system.pids()["engine"]
        llm.system.kill("engine")
        await restarted(llm, "engine", old)
        for c, run in zip(choices, runs, strict=True):
            assert (await run.done(timeout=60)).finish_reason == "length"
            assert run.token_ids == expected[c], f"adapter {c} after the engine's kill"
        assert llm.client.streams.counts.resumes["death"] >= len(choices)
        await assert_idle(llm)

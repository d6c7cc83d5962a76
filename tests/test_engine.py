"""The engine through its real actors (engine + detokenizer processes, ZMQ), tiny random Llama.

Two engines share the module: sync and async scheduling, with a KV cache small enough that the
mixed workload preempts. After every test both must be idle (no requests, every block free).
"""

from __future__ import annotations

import asyncio
import os

import msgspec
import pytest
import torch

from actors.engine.config import EngineConfig
from frontend.offline import AsyncLLM
from messages.names import SCHEDULER
from messages.sampling_params import SamplingParams
from messages.wire import CheckIdle
from tests.cancel_harness import assert_idle
from tests.tiny_model import make_tiny_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog",
    "Once upon a time, in a land far away, there lived a king who had three daughters. " * 2,
    "1 2 3 4 5",
    "What is the capital of France?",
    "a" * 50,
    "Sluice streams text token by token.",
    "The meaning of life is",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def engine_config(model_dir, async_scheduling: bool) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        num_kv_blocks=40,
        block_size=16,
        max_model_len=256,
        max_num_batched_tokens=32,  # the long prompt takes several chunked-prefill steps
        max_num_seqs=8,
        engine_threads=1,
        async_scheduling=async_scheduling,
    )


@pytest.fixture(scope="module", params=["sync", "async"])
async def llm(request, model_dir):
    async with AsyncLLM(engine_config(model_dir, request.param == "async")) as engine:
        yield engine


@pytest.fixture(autouse=True)
async def idle_after(llm):
    yield
    await assert_idle(llm)


def hf_greedy(model_dir, prompt_ids: list[int], n: int, **kwargs) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n, **kwargs)
    return out[0, len(prompt_ids) :].tolist()


async def test_greedy_batch_matches_hf_with_chunked_prefill_and_preemption(llm, model_dir):
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    assert max(map(len, ids)) > 32, "one prompt must exceed the chunked-prefill budget"
    outs = await llm.generate(ids, GREEDY)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 24 for o in outs)
    for prompt, out in zip(ids, outs, strict=True):
        assert out.token_ids == hf_greedy(model_dir, prompt, 24)
        assert out.text == llm.tokenizer.decode(out.token_ids)
    assert llm.client.engine_stats is not None


async def test_sync_and_async_agree_on_a_mixed_workload(model_dir, llm):
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=30, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=3, max_tokens=40, presence_penalty=0.5, min_tokens=5),
    ] * 2
    outs = await llm.generate(PROMPTS, params)
    key = [(o.token_ids, o.finish_reason) for o in outs]
    # the same workload again, rows in another order: seeded output does not depend on the batch
    again = await llm.generate(PROMPTS[::-1], params[::-1])
    assert [(o.token_ids, o.finish_reason) for o in again[::-1]] == key
    if llm.config.async_scheduling:
        return  # the sync run below compares against an async twin
    async with AsyncLLM(engine_config(model_dir, async_scheduling=True)) as twin:
        assert [(o.token_ids, o.finish_reason) for o in await twin.generate(PROMPTS, params)] == key


async def test_stop_conditions(llm):
    prompt = llm.tokenizer.encode("The meaning of life is")
    free = await llm.generate_one(prompt, GREEDY)
    stop_tok = free.token_ids[3]
    first = free.token_ids.index(stop_tok)
    out = await llm.generate_one(prompt, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_tok]))
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_tok)
    assert out.token_ids == free.token_ids[: first + 1]
    held = await llm.generate_one(
        prompt, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_tok], min_tokens=first + 1)
    )
    assert len(held.token_ids) > first + 1 and stop_tok not in held.token_ids[: first + 1]
    length = await llm.generate_one(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert (length.finish_reason, len(length.token_ids)) == ("length", 5)
    capped = await llm.generate_one(
        list(range(10, 250)), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    )
    assert capped.finish_reason == "length" and len(capped.token_ids) == 256 - 240


async def test_a_repetition_penalty_reads_every_output_token_as_hf_does(llm, model_dir):
    """Greedy under a repetition penalty against HF's generate: the worker must hold every output token so far (its
    deltas), the one-step-ahead scheduler syncing for it."""
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:3]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.5)
    for prompt, out in zip(ids, await llm.generate(ids, params), strict=True):
        assert out.token_ids == hf_greedy(model_dir, prompt, 24, repetition_penalty=1.5)


async def test_min_tokens_holds_back_eos_exactly_that_long_with_and_without_penalties(llm):
    """The model made to pick EOS every step (its bias): the first min_tokens tokens are something else, the next one
    EOS. The worker holds a request's output only while its sampling reads it (ExecuteStep.appended): it must have
    seen min_tokens of them, no fewer (EOS banned for good) and, with a penalty, every one (the penalties' history)."""
    eos = 2  # (tests/tiny_model.py)
    bias = {"logit_bias": {eos: 100.0}, "max_tokens": 24}
    params = [SamplingParams(temperature=0, min_tokens=5, **bias), SamplingParams(temperature=0.0, min_tokens=1, **bias),
              SamplingParams(temperature=0, min_tokens=7, frequency_penalty=0.5, **bias)]  # fmt: skip
    for out, p in zip(await llm.generate([[5, 6, 7]] * 3, params), params, strict=True):
        assert (len(out.token_ids), out.token_ids[-1], out.finish_reason) == (p.min_tokens + 1, eos, "stop")
        assert eos not in out.token_ids[:-1]


@pytest.mark.parametrize(
    "prompt, params, error",
    [
        ([], GREEDY, "empty"),
        ([5, 10**6], GREEDY, "outside the vocabulary"),
        (list(range(300)), GREEDY, "max_model_len"),
        ([5, 6], SamplingParams(max_tokens=0), "max_tokens"),
    ],
)
async def test_bad_input_fails_alone(llm, prompt, params, error):
    good = asyncio.ensure_future(llm.generate_one([1, 2, 3], GREEDY))
    bad = await llm.generate_one(prompt, params)
    assert bad.finish_reason == "error" and error in bad.error
    assert (await good).finish_reason == "length"


async def test_explicit_abort(llm):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    rid = llm.new_id()
    stream = llm.stream([1, 2, 3, 4], params, request_id=rid)
    got = 0
    async for item in stream:
        got += len(item.token_ids)
        if got >= 3:
            break
    llm.abort(rid)
    llm.abort(rid)  # twice is harmless
    finished = [item async for item in stream][-1]
    assert finished.finish_reason == "abort"
    late = await llm.generate_one([1, 2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    await llm.client.ask(SCHEDULER, CheckIdle())  # FIFO barrier: rid's aborts were handled ...
    before, _ = await llm.fresh_stats()  # ... so stats published after it count them
    llm.abort(late.request_id)  # finished: a late abort, ignored
    await llm.client.ask(SCHEDULER, CheckIdle())
    after, _ = await llm.fresh_stats()
    assert after.late_aborts_total - before.late_aborts_total == 1


async def test_finish_while_next_step_in_flight_discards_the_extra_sample(llm, model_dir):
    """Async scheduling plans step N+1 before N's stop token is known: N+1's junk sample is dropped."""
    prompt = llm.tokenizer.encode("Once upon a time")
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)
    free = await llm.generate_one(prompt, sampled)
    stop_tok = next(t for i, t in enumerate(free.token_ids) if i >= 2 and t not in free.token_ids[:i])
    before = await llm.client.ask(SCHEDULER, CheckIdle())
    stopping = msgspec.structs.replace(sampled, stop_token_ids=[stop_tok])
    outs = await llm.generate([prompt] * 3, stopping)
    cut = free.token_ids[: free.token_ids.index(stop_tok) + 1]
    assert all(o.token_ids == cut and o.finish_reason == "stop" for o in outs)
    await assert_idle(llm)  # the junk steps are updated; stats published after this reply count them
    stats, _ = await llm.fresh_stats()
    if llm.config.async_scheduling:
        assert stats.discarded_samples_total >= 3
    assert before.idle


async def test_debug_relay_checks_hold_in_async_mode(model_dir):
    """Debug mode fills the device relay buffer with -1 and asserts every placeholder read a written slot."""
    config = msgspec.structs.replace(engine_config(model_dir, async_scheduling=True), debug_checks=True)
    async with AsyncLLM(config) as engine:
        outs = await engine.generate(PROMPTS, GREEDY)
        assert all(o.finish_reason == "length" and len(o.token_ids) == 24 for o in outs)


def test_engine_threads_default_to_every_core_this_process_may_use():
    """Measured fastest on 2 cores with the HTTP and detokenizer processes busy (docs/performance-history.md,
    "Engine speed against vLLM's CPU build (issue 13, first pass)")."""
    assert EngineConfig(model="m").threads() == len(os.sched_getaffinity(0))
    assert EngineConfig(model="m", engine_threads=3).threads() == 3

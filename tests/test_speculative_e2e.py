"""Speculative decoding (n-gram) end to end, through the engine and detokenizer processes.

On the real SmolLM2: greedy and seeded output with speculation is identical to output without it, for 12
prompts batched together (repetitive ones, where drafts are accepted, and others), with stop strings, stop
tokens, EOS and odd max_tokens ending requests inside accepted runs; speculation steps synchronously, so
the engine's async_scheduling setting must not matter. On the tiny model: an abort during a speculative
step frees everything, and nothing of the request follows its Finished.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from actors.engine.config import SpeculativeConfig
from frontend.launch import resolve_model
from frontend.offline import AsyncLLM
from messages.sampling_params import SamplingParams
from tests.cancel_harness import assert_idle, engine_config, gate, model_dir, start_held, wait_state  # noqa: F401

pytestmark = pytest.mark.real_model

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
PASSAGE = (
    "The old lighthouse keeper climbed the stairs every evening. He lit the lamp, wound the clock, and "
    "watched the ships pass the rocks below. In winter the storms were fierce, and the waves broke over the wall."
)
GREEDY = SamplingParams(temperature=0, max_tokens=48)
REQUESTS = [  # (user message, sampling params)
    (f"Repeat this passage exactly: {PASSAGE}", msgspec.structs.replace(GREEDY, max_tokens=120)),  # ends on EOS
    (f"Repeat this passage exactly: {PASSAGE}", msgspec.structs.replace(GREEDY, max_tokens=37)),
    (f"Repeat this passage exactly: {PASSAGE}", msgspec.structs.replace(GREEDY, stop=["the ships"])),
    (f"Copy this text: {PASSAGE}", msgspec.structs.replace(GREEDY, stop=["winter"], include_stop_str_in_output=True)),
    (f"Repeat twice: {PASSAGE[:60]}", msgspec.structs.replace(GREEDY, stop_token_ids=[30])),  # token 30 is "."
    ("List the numbers from 1 to 30, separated by commas.", GREEDY),
    ("Write a short poem about the sea.", GREEDY),
    ("What is the capital of France?", GREEDY),
    ("Explain photosynthesis in one sentence.", GREEDY),
    ("Say hello in five languages.", msgspec.structs.replace(GREEDY, logprobs=2)),
    # seeded sampling: a seeded row's uniforms are keyed by output position, so speculation changes nothing
    (f"Repeat this passage exactly: {PASSAGE}", SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, seed=5)),
    ("Write a short poem about the sea.", SamplingParams(temperature=1.0, top_k=40, max_tokens=48, seed=6)),
]


async def generate(speculative, async_scheduling: bool = True):
    model = resolve_model(None)
    config = engine_config(
        model.path, speculative=speculative, async_scheduling=async_scheduling, step_gate=False,
        num_kv_blocks=None, max_model_len=1024, max_num_batched_tokens=512, engine_threads=None,
    )  # fmt: skip
    async with AsyncLLM(config, log_level="WARNING") as llm:

        def ids(message: str) -> list[int]:
            text = llm.tokenizer.render_chat([{"role": "user", "content": message}])
            return llm.tokenizer.encode(text, add_special_tokens=False)

        outs = await asyncio.gather(*(llm.generate_one(ids(m), p) for m, p in REQUESTS))
        engine, _ = await llm.fresh_stats()
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason, o.logprobs) for o in outs], engine


@pytest.fixture(scope="module")
async def plain():
    return (await generate(None))[0]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
async def test_greedy_output_with_ngram_speculation_is_identical(plain, async_scheduling):
    outs, engine = await generate(NGRAM, async_scheduling)
    for i, (got, want) in enumerate(zip(outs, plain, strict=True)):
        assert got[:4] == want[:4], f"request {i}: {REQUESTS[i][0][:40]!r}"
        if want[4] is not None:  # logprobs for every emitted token; values up to batch-shape numerics
            assert got[4].top_ids == want[4].top_ids
            assert got[4].sampled == pytest.approx(want[4].sampled, abs=1e-4)
    assert plain[0][2] == "stop" and plain[1][2] == "length" and len(plain[1][0]) == 37
    assert plain[2][3] == "the ships" and plain[3][3] == "winter" and plain[4][3] == 30  # the stops did stop
    assert engine.spec_num_accepted_tokens > 0.3 * engine.spec_num_draft_tokens  # drafts were often accepted
    assert engine.spec_accepted_per_pos[3] > 0  # whole runs of 4 were accepted


async def test_an_abort_during_a_speculative_step_frees_everything(model_dir):  # noqa: F811
    ngram = msgspec.structs.replace(NGRAM, prompt_lookup_min=1)
    async with AsyncLLM(engine_config(model_dir, speculative=ngram)) as llm:
        # the output confined to the prompt's tokens: its last token always recurs, so the step drafts
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, allowed_token_ids=[5, 6, 7])
        run = await start_held(llm, [5, 6, 7, 5, 6, 7, 5, 6], params)  # the prefill step, held
        gate(llm, 1)
        await wait_state(llm, gate_permits=0, held_steps=1)  # the first decode step, with drafts, held
        llm.abort(run.request_id)
        await wait_state(llm, running=0)
        gate(llm, None)
        fin = await run.done()
        assert fin.finish_reason == "abort" and len(run.token_ids) == 1  # the prefill's token only
        await assert_idle(llm)
        engine, _ = await llm.fresh_stats()
        assert engine.spec_num_drafts == 1 and engine.discarded_samples_total >= 1

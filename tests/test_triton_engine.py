"""The GPU path's pieces through the whole engine on CPU: the triton backend (Triton attention, the fused kernels,
in the Triton interpreter) and steps of every kind on the CUDA graphs' static buffers (gpu/runner/graphs.py, run
eagerly here)
give the torch backend's dynamic-path tokens on one workload through chunked prefill, decode, preemption (a KV
cache too small for every row), n-gram speculation (verification rows, rolled-back drafts; the seeded rows outlast
the others, so the last steps are plain decode steps) and an abort, greedy and seeded; the counters show each of
those paths ran."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from actors.engine.config import SpeculativeConfig
from frontend.offline import AsyncLLM
from messages.sampling_params import SamplingParams
from tests.cancel_harness import engine_config, model_dir  # noqa: F401

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6],  # repetitive: n-gram drafts from the prompt
    list(range(100, 150)),  # longer than a step's 32-token budget: chunked
    [42] * 9,
    [7, 300, 12, 4000, 91, 17],
]
TWIN_TOKENS = 80  # (request 2's aborted twin's length)
PARAMS = [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=30, seed=8, max_tokens=30, ignore_eos=True),
]


async def aborted_after(llm, n: int) -> list[int]:
    """PROMPTS[2] with its params but a longer length (its tokens come 4 a step: a loaded client could read 3 of 20
    only once the engine had made them all), aborted once it has streamed n tokens: the tokens it got."""
    rid, got = llm.new_id(), []
    stream = llm.stream(PROMPTS[2], msgspec.structs.replace(PARAMS[2], max_tokens=TWIN_TOKENS), request_id=rid)
    async for item in stream:
        got += item.token_ids
        if len(got) >= n:
            break
    llm.abort(rid)
    assert [item async for item in stream][-1].finish_reason == "abort"
    return got


async def run(model_dir, backend: str, static: bool):  # noqa: F811
    config = engine_config(
        model_dir,
        attention_backend=backend,
        static_decode=static,
        max_model_len=96,
        num_kv_blocks=7,  # the 4 rows end at 3 + 5 + 2 + 2 blocks: preemption
        step_gate=False,
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3),
    )
    async with AsyncLLM(config, log_level="WARNING") as llm:
        outs, aborted = await asyncio.gather(llm.generate(PROMPTS, PARAMS), aborted_after(llm, 3))
        stats, _ = await llm.fresh_stats()
    return [(o.token_ids, o.finish_reason) for o in outs], aborted, stats


@pytest.fixture(scope="module")
async def reference(model_dir):  # noqa: F811
    return await run(model_dir, "torch", static=False)


@pytest.mark.parametrize(("backend", "static"), [("torch", True), ("triton", True)], ids=["static", "triton-static"])
async def test_gpu_path_pieces_give_the_torch_dynamic_paths_tokens(model_dir, reference, backend, static):  # noqa: F811
    outs, aborted, stats = await run(model_dir, backend, static)
    assert outs == reference[0]
    assert [len(tokens) for tokens, _ in outs] == [p.max_tokens for p in PARAMS]
    assert len(aborted) < TWIN_TOKENS  # the aborted twin of request 2 streamed its tokens, then stopped
    assert aborted[: PARAMS[2].max_tokens] == outs[2][0][: len(aborted)]
    assert stats.num_preemptions_total > 0
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0

"""The whole engine on the triton backend (Triton attention, the fused kernels and stacked q/k/v and gate/up weights:
the GPU path, in the Triton interpreter on CPU) gives the torch backend's tokens on one workload through chunked
prefill, decode, preemption (a KV cache too small for every row) and n-gram speculation (multi-token verification
rows, rolled-back drafts), greedy and seeded; the counters show each of those paths ran."""

from __future__ import annotations

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
PARAMS = [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=30, seed=8, max_tokens=20, ignore_eos=True),
]


async def run(model_dir, backend: str):  # noqa: F811
    config = engine_config(
        model_dir,
        attention_backend=backend,
        max_model_len=96,
        num_kv_blocks=7,  # the 4 rows end at 3 + 5 + 2 + 2 blocks: preemption
        step_gate=False,
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3),
    )
    async with AsyncLLM(config, log_level="WARNING") as llm:
        outs = await llm.generate(PROMPTS, PARAMS)
        stats, _ = await llm.fresh_stats()
    return [(o.token_ids, o.finish_reason) for o in outs], stats


@pytest.fixture(scope="module")
async def torch_run(model_dir):  # noqa: F811
    return await run(model_dir, "torch")


async def test_triton_backend_engine_equals_torch_backend(model_dir, torch_run):  # noqa: F811
    outs, stats = await run(model_dir, "triton")
    assert outs == torch_run[0]
    assert all(len(tokens) == 20 for tokens, _ in outs)
    assert stats.num_preemptions_total > 0
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0

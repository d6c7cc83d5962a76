"""The default model (SmolLM2-135M-Instruct, fp32) through the real engine and detokenizer processes."""

from __future__ import annotations

import re

import pytest

from actors.engine.config import EngineConfig
from frontend.offline import AsyncLLM
from messages.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def smollm2():
    from gpu.loading.convert import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="module")
async def llm(smollm2):
    config = EngineConfig(model=str(smollm2), num_kv_blocks=256, engine_threads=1)
    async with AsyncLLM(config) as engine:
        yield engine


async def test_sampled_chat_is_fluent_english(llm):
    prompt = llm.tokenizer.render_chat([{"role": "user", "content": "Tell me a short story about a cat."}])
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=1234, max_tokens=60)
    out = await llm.generate_one(prompt, params)
    words = re.findall(r"[A-Za-z']+", out.text)
    assert len(words) >= 20, out.text
    assert len(set(out.token_ids)) / len(out.token_ids) > 0.4, f"degenerate: {out.text!r}"
    common = {"the", "a", "and", "was", "to", "of", "in", "cat", "her", "his", "she", "he"}
    assert sum(w.lower() in common for w in words) / len(words) > 0.1, out.text

"""Sampling parameters that read the output so far, through the real engine (async scheduling: the host's output
list lags the device by a step there)."""

from __future__ import annotations

from messages.sampling_params import SamplingParams
from tests.cancel_harness import clean_llm, model_dir  # noqa: F401 (fixtures)

EOS = 2  # the tiny model's


async def test_min_tokens_holds_eos_then_releases_it(clean_llm):  # noqa: F811
    """EOS biased to win every step: masked for the first min_tokens tokens, then it ends the request."""
    prompt = clean_llm.tokenizer.encode("The meaning of life is")
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=3, logit_bias={EOS: 100.0})
    out = await clean_llm.generate_one(prompt, params)
    assert (out.finish_reason, len(out.token_ids), out.token_ids[-1]) == ("stop", 4, EOS), out
    assert EOS not in out.token_ids[:3]


async def test_min_tokens_holds_stop_token_ids_then_releases_them(clean_llm):  # noqa: F811
    prompt = clean_llm.tokenizer.encode("Once upon a time")
    params = SamplingParams(
        temperature=0.8, seed=5, max_tokens=12, min_tokens=5, stop_token_ids=[700], logit_bias={700: 100.0}
    )
    out = await clean_llm.generate_one(prompt, params)
    assert (out.finish_reason, out.stop_reason, len(out.token_ids)) == ("stop", 700, 6), out

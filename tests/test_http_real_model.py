"""The server on the real SmolLM2-135M-Instruct: sensible text through the whole pipeline."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.real_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


async def test_chat_answers_and_streams_the_same_text(real_server):
    client = real_server.client()
    whole = await client.chat.completions.create(model=None, messages=QUESTION, max_tokens=24, temperature=0.0)
    answer = whole.choices[0].message.content
    assert "Paris" in answer and whole.choices[0].finish_reason in ("stop", "length")
    stream = await client.chat.completions.create(
        model=None, messages=QUESTION, max_tokens=24, temperature=0.0, stream=True
    )
    assert "".join([c.choices[0].delta.content or "" async for c in stream]) == answer


async def test_a_stop_string_cuts_real_text(real_server):
    out = await real_server.client().completions.create(
        model=None, prompt="The capital of France is", max_tokens=32, temperature=0.0, stop=["."]
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == "." and "." not in choice.text
    assert "Paris" in choice.text

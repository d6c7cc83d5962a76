"""vLLM/OpenAI conformance (issue 18), continued from tests/test_conformance.py (its `api` fixture: Sluice's shared
server, or the control server at SLUICE_CONFORMANCE_URL): continuous usage stats per choice; /tokenize with tools,
refusing what it does not honour (and chat_template_kwargs that would replace the template's own variables); beam search
(vLLM's batch test); chat messages of the deprecated and custom roles;
chat truncation from the right; a chat's max_completion_tokens past the context.
"""

from __future__ import annotations

import json

import openai
import pytest

from frontend.context import ServingContext
from frontend.protocol import parse_chat
from frontend.tokenize import tokenize
from frontend.tokenizer import Tokenizer
from tests.test_conformance import CHAT, CONTROL, api_fixture  # noqa: F401  (the `api` fixture)

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("kind", ["completions", "chat"])
async def test_continuous_usage_stats_count_each_choice(api, kind):
    """continuous_usage_stats with include_usage (as vLLM): each chunk carries its choice's usage so far, its
    prompt's tokens and the tokens that choice's chunks brought (n=2: the choice's, not the request's), without
    prompt_tokens_details; the final usage chunk totals the choices. Without include_usage no chunk has usage."""
    client, tok = api.client(), api.tokenizer
    if kind == "completions":
        create, prompt, num_prompt = (
            client.completions.create,
            {"prompt": "Hello world"},
            len(tok.encode("Hello world")),
        )
    else:
        create, prompt = client.chat.completions.create, {"messages": CHAT}
        num_prompt = len(tok.encode(tok.render_chat(CHAT), add_special_tokens=False))
    kwargs = dict(
        model="", n=2, max_tokens=6, temperature=1.0, seed=0, stream=True, **prompt
    )  # (vLLM: n > 1 is not greedy)
    options = {"include_usage": True, "continuous_usage_stats": True}
    extra = {"ignore_eos": True, "return_token_ids": True}
    received, final = [0, 0], None
    async for chunk in await create(**kwargs, stream_options=options, extra_body=extra):
        if not chunk.choices:
            final = chunk.usage
            continue
        [choice] = chunk.choices
        received[choice.index] += len(choice.model_extra.get("token_ids") or [])
        usage = chunk.usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (num_prompt, received[choice.index]), chunk
        assert usage.total_tokens == num_prompt + received[choice.index] and usage.prompt_tokens_details is None
    assert received == [6, 6] and (final.prompt_tokens, final.completion_tokens) == (num_prompt, 12)
    assert final.prompt_tokens_details is not None or not api.local  # (vLLM: only with --enable-prompt-tokens-details)
    plain = await create(**kwargs, stream_options={"continuous_usage_stats": True}, extra_body=extra)
    usages = [chunk.usage async for chunk in plain]
    assert usages and not any(usages)


def test_tokenize_renders_tools_as_a_chat_request_does(tiny_model_dir):
    """/tokenize with messages and tools: the prompt a chat request with those tools is given (here under a
    template that renders tools)."""
    tok = Tokenizer.from_model_dir(tiny_model_dir, TOOLS_TEMPLATE)
    ctx = ServingContext(tok, ["tiny"], 512, tok.vocab_size)
    body = {"messages": CHAT, "tools": [WEATHER]}
    ids = tokenize(json.dumps(body).encode(), ctx)["tokens"]
    chat = parse_chat(json.dumps(body | {"tool_choice": "none"}).encode(), ctx)
    assert ids == chat.prompts[0].token_ids != tokenize(json.dumps({"messages": CHAT}).encode(), ctx)["tokens"]
    assert '"name": "weather"' in tok.decode(ids)


@pytest.mark.skipif(CONTROL is not None, reason="Sluice's refusals (vLLM honours chat_template)")
async def test_tokenize_takes_tools_and_refuses_what_it_does_not_honour(api):
    """/tokenize on the server: tools give the chat endpoint's prompt; chat_template is refused as the chat
    endpoint refuses it, as are chat_template_kwargs that set one of the template's own variables, invalid
    tools, tools or chat_template_kwargs without messages, and both continue_final_message and
    add_generation_prompt."""
    chat = await api.client().chat.completions.create(
        model="",
        messages=CHAT,
        max_tokens=1,
        tools=[WEATHER],
        tool_choice="none",
        extra_body={"return_token_ids": True},
    )
    async with api.session() as s:
        async with s.post("/tokenize", json={"messages": CHAT, "tools": [WEATHER]}) as resp:
            assert (await resp.json())["tokens"] == chat.model_extra["prompt_token_ids"]
        for payload, param in [
            ({"chat_template": "{{ messages }}"}, "chat_template"),
            ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
            ({"chat_template_kwargs": {"eos_token": "x"}}, "chat_template_kwargs"),
            ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
            ({"tools": [{"type": "function"}]}, "tools[0]"),
            ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        ]:
            async with s.post("/tokenize", json={"messages": CHAT, **payload}) as resp:
                error = (await resp.json())["error"]
            assert (resp.status, error["param"]) == (400, param), payload
            with pytest.raises(openai.BadRequestError) as e:  # as the chat endpoint refuses it
                await api.client().chat.completions.create(model="", messages=CHAT, max_tokens=1, extra_body=payload)
            assert (e.value.body["param"], e.value.body["message"]) == (param, error["message"])
        for name, value in [("tools", [WEATHER]), ("chat_template_kwargs", {"enable_thinking": False})]:
            async with s.post("/tokenize", json={"prompt": "hi", name: value}) as resp:
                assert (resp.status, (await resp.json())["error"]["param"]) == (400, name)


async def test_beam_search_returns_distinct_beams_per_prompt(api):
    """vLLM's batch completion with use_beam_search: n beams per prompt, different from each other, the same for
    the same prompt."""
    batch = await api.client().completions.create(
        model="", prompt=["Hello, my name is"] * 2, n=2, max_tokens=5, temperature=0.0,
        extra_body={"use_beam_search": True},
    )  # fmt: skip
    texts = [c.text for c in sorted(batch.choices, key=lambda c: c.index)]
    assert len(texts) == 4 and texts[0] != texts[1] and texts[:2] == texts[2:]


@pytest.mark.skipif(CONTROL is not None, reason="vLLM 0.32 ignores best_of")
async def test_best_of_equal_to_n_is_a_no_op_and_less_is_refused(api):
    client = api.client()
    out = await client.completions.create(model="", prompt="hi", max_tokens=1, n=2, extra_body={"best_of": 2})
    assert len(out.choices) == 2
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model="", prompt="hi", max_tokens=1, n=2, extra_body={"best_of": 1})
    assert e.value.body["param"] == "best_of" and "less than n" in e.value.body["message"]


async def test_chat_takes_the_function_role_a_custom_role_and_a_function_call(api):
    """The deprecated `function` role with its name, a custom role, and an assistant's deprecated function_call
    through the openai client: the prompt is the template's render of them (tests/test_tokenizer.py pins that)."""
    tok = api.tokenizer
    messages = [
        *CHAT,
        {"role": "assistant", "content": None, "function_call": {"name": "get_time", "arguments": "{}"}},
        {"role": "function", "name": "get_time", "content": "12:00"},
        {"role": "narrator", "content": "Later."},
    ]
    response = await api.client().chat.completions.create(
        model="", messages=messages, max_tokens=1, extra_body={"return_token_ids": True}
    )
    prompt = response.model_extra["prompt_token_ids"]
    assert prompt == tok.encode(tok.render_chat(messages), add_special_tokens=False)
    assert "<|im_start|>function\n12:00<|im_end|>\n<|im_start|>narrator\nLater.<|im_end|>" in tok.decode(prompt)


async def test_chat_truncation_from_the_right_streamed(api):
    """truncate_prompt_tokens with truncation_side "right" keeps a chat prompt's first tokens (streamed: the
    first chunk's prompt_token_ids, the usage's prompt_tokens)."""
    tok, messages = api.tokenizer, [{"role": "user", "content": " x" * 700}]  # more than the 512 of the context
    full = tok.encode(tok.render_chat(messages), add_special_tokens=False)
    extra = {"truncate_prompt_tokens": 100, "truncation_side": "right", "return_token_ids": True}
    stream = await api.client().chat.completions.create(
        model="", messages=messages, max_tokens=2, stream=True, stream_options={"include_usage": True}, extra_body=extra
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].model_extra["prompt_token_ids"] == full[:100] and chunks[-1].usage.prompt_tokens == 100


async def test_chat_max_completion_tokens_past_the_context_ends_with_length(api):
    """A chat whose max_completion_tokens reaches past the 512-token context is served to the context's end
    (vLLM 0.32 refuses such a max with a 400: the control asks for exactly what fits)."""
    tok, messages = api.tokenizer, [{"role": "user", "content": " x" * 480}]
    num_prompt = len(tok.encode(tok.render_chat(messages), add_special_tokens=False))
    assert num_prompt < 512
    response = await api.client().chat.completions.create(
        model="", messages=messages, max_completion_tokens=10_000 if api.local else 512 - num_prompt,
        temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert response.choices[0].finish_reason == "length"
    assert (response.usage.prompt_tokens, response.usage.total_tokens) == (num_prompt, 512)

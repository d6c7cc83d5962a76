"""Beam search over HTTP on the tiny model: width 1 is greedy decoding, wider searches return what HF transformers'
own beam search returns, the fields that would change the ranking are refused naming them, and a client that hangs
up aborts the whole search."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

PROMPTS = [[1, 504, 3032, 282, 8814, 30], [1, 19556, 314, 253, 1932, 28, 7263, 282]]


async def complete(server, **body) -> dict:
    async with server.session() as s, s.post("/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_width_one_is_greedy_decoding(server):
    for prompt in PROMPTS:
        greedy = await complete(server, prompt=prompt, max_tokens=12, temperature=0, return_token_ids=True)
        beam = await complete(server, prompt=prompt, max_tokens=12, use_beam_search=True, return_token_ids=True)
        assert beam["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]
        assert beam["choices"][0]["text"] == greedy["choices"][0]["text"]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_beams(model, prompt, width, n, max_tokens, early_stopping) -> list[list[int]]:
    """transformers' beam search (length_penalty 0: both rank by cumulative logprob), its outputs cut at EOS."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), num_beams=width, num_return_sequences=n, max_new_tokens=max_tokens,
            length_penalty=0.0, early_stopping=early_stopping, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    beams = []
    for row in out[:, len(prompt) :].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        beams.append(row[:end])
    return beams


@pytest.mark.parametrize("early_stopping", [True, "never"])
async def test_beams_are_those_of_transformers_beam_search(server, hf_model, early_stopping):
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 10, "n": 2, "best_of": 4, "use_beam_search": True}
        got = await complete(server, **body, length_penalty=0, early_stopping=early_stopping, return_token_ids=True)
        want = hf_beams(hf_model, prompt, 4, 2, 10, early_stopping)
        assert [c["token_ids"] for c in got["choices"]] == want
        assert len(set(map(tuple, want))) == 2  # (two different beams)


async def test_searches_and_sampled_requests_share_the_steps(server):
    """Searches beside greedy requests (the engine steps synchronously while a search runs): each answers as alone."""
    beam = {"max_tokens": 10, "n": 2, "best_of": 3, "use_beam_search": True, "return_token_ids": True}
    greedy = {"max_tokens": 24, "temperature": 0, "return_token_ids": True}
    calls = [(p, beam) for p in PROMPTS] + [(p, greedy) for p in PROMPTS * 2]
    alone = [await complete(server, prompt=p, **body) for p, body in calls]
    together = await asyncio.gather(*(complete(server, prompt=p, **body) for p, body in calls))
    ids = [[c["token_ids"] for c in r["choices"]] for r in (*alone, *together)]
    assert ids[: len(calls)] == ids[len(calls) :]


async def test_streamed_chat_beams_equal_the_whole_answer(server):
    beams = {"use_beam_search": True, "best_of": 3, "length_penalty": 0.5}
    body = {"messages": [{"role": "user", "content": "Name a color"}], "max_tokens": 8, "n": 2, "extra_body": beams}
    client = server.client()
    whole = await client.chat.completions.create(model="", **body)
    texts = ["", ""]
    async for chunk in await client.chat.completions.create(model="", stream=True, **body):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in whole.choices] and texts[0] != texts[1]


async def test_stop_strings_cut_the_returned_beams(server):
    body = {"prompt": PROMPTS[1], "max_tokens": 10, "n": 2, "use_beam_search": True, "ignore_eos": True}
    whole = [c["text"] for c in (await complete(server, **body))["choices"]]
    stop = whole[0][len(whole[0]) // 2 :][:3]  # (a piece of the best beam's second half)
    cut = (await complete(server, **body, stop=[stop]))["choices"]
    assert [c["text"] for c in cut] == [t[: t.index(stop)] if stop in t else t for t in whole]
    assert cut[0]["finish_reason"] == "stop" and cut[0]["stop_reason"] == stop


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"use_beam_search": True, "temperature": 0.7}, "temperature"),
        ({"use_beam_search": True, "top_p": 0.9}, "top_p"),
        ({"use_beam_search": True, "logprobs": 2}, "logprobs"),
        ({"use_beam_search": True, "min_tokens": 2}, "min_tokens"),
        ({"use_beam_search": True, "guided_regex": "[a-z]+"}, "guided_regex"),
        ({"use_beam_search": True, "n": 3, "best_of": 2}, "best_of"),
        ({"use_beam_search": True, "best_of": 17}, "best_of"),  # (the server runs 16 sequences at most)
        ({"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping"),
        ({"best_of": 2}, "best_of"),
        ({"length_penalty": 2.0}, "length_penalty"),
        ({"early_stopping": True}, "early_stopping"),
    ],
)
async def test_what_beam_search_cannot_honour_is_refused_naming_it(server, fields, param):
    async with server.session() as s, s.post("/v1/completions", json={"prompt": "Hi", **fields}) as resp:
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["param"] == param, error


async def test_a_client_that_hangs_up_aborts_the_search(server):
    before = (await server.metrics()).get(("sluice:request_aborts_total", (("reason", "client"),)), 0)
    body = {"prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "n": 2, "use_beam_search": True}
    async with server.session() as s:
        call = asyncio.ensure_future(s.post("/v1/completions", json=body))
        await server.wait_metrics({("sluice:num_requests_running", ()): 1})  # (the search: one engine request)
        call.cancel()
    await server.wait_metrics(
        {
            ("sluice:request_aborts_total", (("reason", "client"),)): before + 2,  # (each choice)
            ("sluice:num_requests_running", ()): 0,
        }
    )
    reports = await server.idle()
    assert all(v == 0 for details in reports.values() for v in details.values()), reports

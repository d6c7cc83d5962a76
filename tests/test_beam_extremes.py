"""Extreme values of every beam search field (issue 48): any finite length_penalty (vLLM does not bound it) ranks
as vLLM's formula's exact values would, compared without overflow (actors/engine/beams.py; in the scheduler, against
tests.test_beam_search's exhaustive and reference searches); over HTTP a value vLLM accepts runs to a 200, a bad
one is a 400 naming the field, and none of them restarts the engine process."""

import json
import math

import pytest

from tests.test_beam_search import EOS, Engine, exhaustive, reference

ISSUE = {"prompt": "The quick brown fox", "max_tokens": 1, "use_beam_search": True, "best_of": 2}
JSON = {"Content-Type": "application/json"}
BEAMS = {"prompt": "The quick brown fox", "max_tokens": 6, "use_beam_search": True, "ignore_eos": True}


@pytest.fixture
async def same_engine(server):
    """The engine process before and after the test: the same one."""
    pid = server.server.pids()["engine"]
    yield server
    assert server.server.pids()["engine"] == pid


async def post(server, body: dict | str) -> tuple[int, dict]:
    data = body if isinstance(body, str) else json.dumps(body)
    async with server.session() as s, s.post("/v1/completions", data=data, headers=JSON) as resp:
        return resp.status, await resp.json()


@pytest.mark.parametrize("lp", [400, -400, 1e308, -1e308, 5e-324, 0])
async def test_the_issues_request_answers_for_any_finite_length_penalty(same_engine, lp):
    status, body = await post(same_engine, {**ISSUE, "length_penalty": lp})
    assert status == 200, body
    assert len(body["choices"]) == 1 and body["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize(
    "fields",
    [
        {"best_of": 1},
        {"best_of": 16},  # (the server runs 16 sequences at most)
        {"n": 3, "best_of": 3, "length_penalty": -1e308, "early_stopping": "never"},
        {"n": 2, "length_penalty": 1e308, "early_stopping": True},
        {"best_of": 4, "length_penalty": 700, "early_stopping": False},
        {"best_of": 4, "length_penalty": -700, "early_stopping": "never"},
        {"best_of": 2, "max_tokens": 1},
    ],
)
async def test_extreme_accepted_beam_fields_run(same_engine, fields):
    status, body = await post(same_engine, {**BEAMS, **fields})
    assert status == 200, body
    n = fields.get("n", 1)
    assert len(body["choices"]) == n and body["usage"]["completion_tokens"] == n * fields.get("max_tokens", 6)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"best_of": 0}, "best_of"),
        ({"best_of": -1}, "best_of"),
        ({"best_of": 1 << 40}, "best_of"),
        ({"best_of": 129}, "best_of"),  # (past --max-n)
        ({"best_of": 2.5}, "best_of"),
        ({"n": 0}, "n"),
        ({"n": 4, "best_of": 3}, "best_of"),
        ({"length_penalty": "1"}, "length_penalty"),
        ({"early_stopping": "always"}, "early_stopping"),
        ({"early_stopping": 1}, "early_stopping"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 1 << 40}, "max_tokens"),
        ({"use_beam_search": "yes"}, "use_beam_search"),
    ],
)
async def test_bad_beam_fields_are_a_400_naming_them(same_engine, fields, param):
    status, body = await post(same_engine, {**BEAMS, **fields})
    assert status == 400 and body["error"]["param"] == param, body


@pytest.mark.parametrize("lp", ["1e309", "-1e309"])
async def test_a_length_penalty_past_floats_range_is_a_400_naming_it(same_engine, lp):
    """(JSON's numbers past float's range decode to infinity.)"""
    status, body = await post(same_engine, json.dumps(BEAMS)[:-1] + f', "length_penalty": {lp}}}')
    assert status == 400 and body["error"]["param"] == "length_penalty", body


@pytest.mark.parametrize("lp", [400, -400, 1000, -1000])
def test_an_extreme_length_penalty_finds_the_exhaustive_best(lp):
    """|length_penalty| x log(length) past float's range: vLLM's formula would overflow (OverflowError) or divide by
    an underflowed zero; the scores compare in log space and order exactly as the formula's exact values."""
    eng = Engine(max_num_seqs=36, num_blocks=512)
    prompt = [1, 2, 0, 1, 2]
    rids = eng.search(prompt, n=5, width=36, max_tokens=3, lp=lp, es="never")
    eng.run()
    assert [eng.answers[r] for r in rids] == [(seq, why) for _, seq, why in exhaustive(prompt, 3, lp)[:5]]


@pytest.mark.parametrize("es", [False, True, "never"])
@pytest.mark.parametrize("lp", [400, -400])
def test_pruning_searches_with_an_extreme_length_penalty_match_the_reference(lp, es):
    eng = Engine(vocab=12, max_num_seqs=12)
    prompts = [[1, 2, 0, 1, 2, 0, 1], [0, 0, 1]]
    runs = [(p, eng.search(p, n=2, width=3, max_tokens=8, lp=lp, es=es)) for p in prompts]
    eng.run()
    for prompt, rids in runs:
        want = reference(prompt, 3, 8, lp, es, vocab=12)
        assert [eng.answers[r] for r in rids] == [(seq, why) for _, seq, why in want[:2]], prompt


@pytest.mark.parametrize("lp", [1e308, -1e308, 5e-324, -5e-324, 0.0, 575.0 / math.log(17)])
@pytest.mark.parametrize("es", [False, True, "never"])
def test_any_finite_length_penalty_runs_to_an_answer(lp, es):
    """Where even the log magnitudes overflow (the scores tie) the search still ends with `width` answers, each a
    sequence the model could output, and frees everything."""
    eng = Engine(vocab=12, max_num_seqs=12)
    rids = eng.search([1, 2, 0, 1, 2, 0, 1, 2, 0, 1], n=3, width=3, max_tokens=7, lp=lp, es=es)
    eng.run()
    for tokens, why in (eng.answers[r] for r in rids):
        assert 1 <= len(tokens) <= 7 and why == ("stop" if tokens[-1] == EOS else "length")
        assert EOS not in tokens[:-1] and (why == "stop" or len(tokens) == 7)

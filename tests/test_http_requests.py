"""The HTTP actor's request table and response rendering, without processes: fan-out, coalescing, bodies. The
protocol cases of its ledger: tests/test_client_ledger.py."""

from __future__ import annotations

import pytest

from frontend.responses import response_body, stream_events, stream_head, stream_tail
from messages.sampling_params import child_seed
from messages.wire import AddRequest, Finished, TextDelta, TextOutputs, TokenLogprobs
from tests.http_table_harness import VOCAB, delta, events, make_table, parsed


@pytest.mark.parametrize("seed", [7, (1 << 63) - 2, -(1 << 63)])
def test_n_fans_out_into_engine_requests_with_derived_seeds(seed):
    table, _, sent = make_table()
    table.add(parsed(n=3, prompts=((1, 2), (3,)), seed=seed), "http")
    assert all(isinstance(m, AddRequest) and m.client == "http" and m.params.n == 1 for m in sent)
    assert [m.request_id for m in sent] == [f"cmpl-abc-{i}" for i in range(6)]
    assert [m.prompt_token_ids for m in sent] == [[1, 2]] * 3 + [[3]] * 3
    assert [m.params.seed for m in sent] == [child_seed(seed, j) for j in (0, 1, 2, 0, 1, 2)]


def test_a_slow_client_gets_one_coalesced_event_per_choice():
    table, _, _ = make_table()
    req = table.add(parsed(n=2), "http")
    for i in range(100):
        for c in req.choices:
            table.on_outputs(delta(c.engine_id, i, f"t{i} "))
    out = events(stream_events(req, VOCAB))
    assert [e["choices"][0]["index"] for e in out] == [0, 1]
    assert [e["choices"][0]["text"] for e in out] == ["".join(f"t{i} " for i in range(100))] * 2
    assert stream_events(req, VOCAB) == b""  # drained
    for c in req.choices:
        table.on_finished(Finished(request_id=c.engine_id, finish_reason="length", num_output_tokens=100))
    assert req.done and [e["choices"][0]["finish_reason"] for e in events(stream_events(req, VOCAB))] == ["length"] * 2
    assert events(stream_tail(req))[0]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 200,
        "total_tokens": 203,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_non_streaming_body_has_logprobs_and_exact_usage():
    table, _, _ = make_table()
    req = table.add(parsed(kind="chat", logprobs=1), "http")
    rid = req.choices[0].engine_id
    lp = TokenLogprobs(sampled=[-0.5], ranks=[1], top_ids=[[7]], top_logprobs=[[-0.5]])
    out = TextOutputs(step=0, deltas=[TextDelta(request_id=rid, seq=0, text="A", token_ids=[7], logprobs=lp)])
    table.on_outputs(out)
    fin = Finished(
        request_id=rid,
        finish_reason="stop",
        text="B",
        token_ids=[8],
        logprobs=lp,
        num_prompt_tokens=3,
        num_output_tokens=2,
    )
    table.on_finished(fin)
    body = response_body(req, VOCAB)
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "AB"} and choice["finish_reason"] == "stop"
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["<7>", "<8>"]
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert events(stream_head(req))[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_echo_puts_the_prompt_text_first():
    table, _, _ = make_table()
    req = table.add(parsed(echo=True), "http")
    rid = req.choices[0].engine_id
    table.on_outputs(delta(rid, 0, " there"))
    table.on_finished(Finished(request_id=rid, finish_reason="length", num_output_tokens=1))
    assert response_body(req, VOCAB)["choices"][0]["text"] == "hi there"

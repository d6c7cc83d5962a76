"""The HTTP actor's request table and response rendering, without processes: fan-out, coalescing,
and every protocol case of the HTTP party (duplicates, gaps, stale outputs, unknown ids, I7)."""

from __future__ import annotations

import json
import time

import pytest

from actors.protocol import MAX_ATTEMPTS
from frontend.metrics import Metrics
from frontend.protocol import ParsedRequest, PromptInput, RequestError
from frontend.requests import RequestTable
from frontend.responses import response_body, stream_events, stream_head, stream_tail
from messages.sampling_params import SamplingParams, child_seed
from messages.wire import Abort, AddRequest, Finished, TextDelta, TextOutputs, TokenLogprobs


class Vocab:
    def token_str(self, token_id: int) -> str:
        return f"<{token_id}>"

    def token_bytes(self, token_id: int) -> bytes:
        return self.token_str(token_id).encode()


VOCAB = Vocab()


def parsed(
    n=1, prompts=((1, 2, 3),), kind="completion", seed=None, logprobs=None, echo=False, rid="cmpl-abc"
) -> ParsedRequest:
    params = SamplingParams(n=n, seed=seed, max_tokens=8, logprobs=logprobs)
    inputs = [PromptInput("hi", list(p), params) for p in prompts]
    return ParsedRequest(kind, rid, "m", 0, inputs, True, True, echo)


def make_table(abort_timeout_s=1.0):
    sent = []
    metrics = Metrics()
    table = RequestTable(lambda dst, msg: sent.append(msg), metrics, abort_timeout_s, max_abort_tries=3)
    return table, metrics, sent


def delta(rid: str, seq: int, text: str, ids=None) -> TextOutputs:
    ids = [seq] if ids is None else ids
    return TextOutputs(step=seq, deltas=[TextDelta(request_id=rid, seq=seq, text=text, token_ids=ids)])


def events(data: bytes) -> list[dict]:
    assert data.endswith(b"\n\n")
    return [json.loads(e.removeprefix(b"data: ")) for e in data.split(b"\n\n")[:-1] if e != b"data: [DONE]"]


def aborts(sent) -> list[tuple[str, str]]:
    return [(m.request_id, m.reason) for m in sent if isinstance(m, Abort)]


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


def resumed(sent) -> list[tuple[str, int, list[int], int]]:
    return [
        (m.request_id, m.attempt, m.resume_token_ids, m.resume_chars)
        for m in sent
        if getattr(m, "resume_token_ids", None) is not None
    ]


def test_duplicates_are_dropped_and_a_gap_is_repaired_from_the_record():
    """A gap re-submits the choice (its next copy) with the tokens and characters it has; the old copy's outputs
    are stale from then on, the new copy's stream on; after MAX_ATTEMPTS copies a gap fails the request."""
    table, metrics, sent = make_table()
    req = table.add(parsed(n=2), "http")
    first, second = (c.engine_id for c in req.choices)
    table.on_outputs(delta(first, 0, "a"))
    table.on_outputs(delta(first, 0, "a"))
    assert metrics.protocol.violations["duplicate"] == 1 and req.choices[0].text == ["a"]
    table.on_outputs(delta(first, 2, "x"))  # seq 1 lost
    assert metrics.protocol.violations["gap"] == 1 and not req.done and not aborts(sent)
    assert resumed(sent) == [(first, 1, [0], 1)]
    table.on_outputs(delta(first, 3, "y"))  # the old copy's: stale
    assert metrics.protocol.stale == 1
    copy = TextDelta(request_id=first, seq=1, text="b", token_ids=[1], attempt=1)
    table.on_outputs(TextOutputs(step=9, deltas=[copy]))
    assert req.choices[0].text == ["a", "b"] and req.choices[0].num_tokens == 2
    attempt = 0
    while not req.done:  # a gap in each copy of the second choice
        gap = TextDelta(request_id=second, seq=5, text="z", token_ids=[5], attempt=attempt)
        table.on_outputs(TextOutputs(step=9, deltas=[gap]))
        attempt = resumed(sent)[-1][1]
    assert [a for rid, a, *_ in resumed(sent) if rid == second] == list(range(1, MAX_ATTEMPTS + 2, 2))  # a client's
    # copies are odd (the detokenizer's even); one numbered past MAX_ATTEMPTS fails at its gap
    assert req.done and req.error.status == 500 and "resumptions" in req.error.message
    assert aborts(sent) == [(first, "error"), (second, "error")]
    tail = stream_tail(req)
    assert tail.endswith(b"data: [DONE]\n\n") and events(tail)[0]["error"]["type"] == "server_error"


def test_a_finished_that_skips_tokens_is_repaired():
    """The repair goes on above the Finished's copy (the detokenizer's copy 2 here, never seen before: the client's
    next copy is 3, not 1, which the scheduler would drop as older)."""
    table, metrics, sent = make_table()
    req = table.add(parsed(), "http")
    rid = req.choices[0].engine_id
    table.on_outputs(delta(rid, 0, "a"))
    skipping = Finished(request_id=rid, finish_reason="length", text="c", token_ids=[2], num_output_tokens=3, attempt=2)
    table.on_finished(skipping)
    assert metrics.protocol.violations["gap"] == 1 and not req.done and resumed(sent) == [(rid, 3, [0], 1)]
    table.on_finished(
        Finished(request_id=rid, finish_reason="length", text="bc", token_ids=[1, 2], num_output_tokens=3, attempt=3)
    )
    assert req.done and req.error is None and req.choices[0].text == ["a", "bc"]


def test_a_finished_that_reports_fewer_tokens_than_arrived_closes_with_what_arrived():
    """Delivered text is never taken back: a short count is a violation ("after_finished": output went past it),
    and the choice ends, its text whole (the HTTP and offline clients share this ledger, so they agree)."""
    table, metrics, _ = make_table()
    req = table.add(parsed(), "http")
    rid = req.choices[0].engine_id
    table.on_outputs(delta(rid, 0, "a"))
    table.on_outputs(delta(rid, 1, "b"))
    table.on_finished(Finished(request_id=rid, finish_reason="length", text="c", token_ids=[2], num_output_tokens=2))
    assert metrics.protocol.violations == {"after_finished": 1} and req.done and req.error is None
    assert response_body(req, VOCAB)["choices"][0]["text"] == "abc"
    table.on_outputs(delta(rid, 2, "c"))  # within the three tokens that arrived: a duplicate
    assert metrics.protocol.violations == {"after_finished": 1, "duplicate": 1}


def test_a_death_waits_then_resumes_every_live_choice_and_fails_a_poison_request():
    """While the engine side is down nothing is sent and tombstones go; once both actors are back every live choice
    is re-submitted from its record; one live at more than max_resumes deaths fails with 503 (its siblings too,
    no Abort: the new engine side never heard of them)."""
    table, metrics, sent = make_table()
    req = table.add(parsed(n=2), "http")
    gone = table.add(parsed(rid="cmpl-gone"), "http")
    table.cancel(gone)
    first, second = (c.engine_id for c in req.choices)
    table.on_outputs(delta(first, 0, "a"))
    for death in (1, 2):
        assert table.on_down("scheduler") and table.on_down("detokenizer") and not table.tombstones
        assert not table.on_up("worker") and not table.on_up("scheduler")  # the detokenizer is still down
        n = len(sent)
        assert table.on_up("detokenizer") and metrics.protocol.resumes["death"] == 2 * death
        assert [(m.request_id, m.resume_token_ids) for m in sent[n:]] == [(first, [0]), (second, [])]
    table.on_down("engine")
    assert not table.on_up("engine") and not req.done, "only the scheduler and detokenizer hold requests"
    table.on_down("scheduler")
    n = len(sent)
    table.on_up("scheduler")
    assert req.done and req.error.status == 503 and "restarts" in req.error.message and sent[n:] == []
    assert not table.live and table.tombstones.keys() == {first, second}  # (dropped after one timeout)


def test_a_lost_textoutputs_repairs_the_choices_not_heard_from_since():
    """TextOutputs are numbered: a gap in the numbers, once two later messages came (or a second passed), repairs
    every live choice that has had no output taken since the lost message (one seen again or an older copy's is
    not taken); a message seen twice is dropped whole."""
    table, metrics, sent = make_table()
    req = table.add(parsed(n=3), "http")
    a, b, c = (ch.engine_id for ch in req.choices)
    out = [TextOutputs(step=i, deltas=[], number=i) for i in range(5)]
    out[0].deltas = [TextDelta(request_id=rid, seq=0, text="x", token_ids=[0]) for rid in (a, b, c)]
    out[2].deltas = [TextDelta(request_id=rid, seq=s, text="y", token_ids=[s]) for rid, s in ((a, 1), (b, 0))]
    for i in (0, 0, 2):  # 1 (lost) may have had b's or c's next output
        table.on_outputs(out[i])
    assert metrics.protocol.violations["duplicate"] == 2 and not resumed(sent)
    table.on_outputs(out[3])  # two messages past the missing one: lost
    assert sorted(resumed(sent)) == [(b, 1, [0], 1), (c, 1, [0], 1)]
    out[4].deltas = [TextDelta(request_id=c, seq=1, text="z", token_ids=[1])]  # the replaced copy's: stale
    table.on_outputs(out[4])
    assert metrics.protocol.stale == 1 and len(resumed(sent)) == 2


def test_a_lost_textoutputs_named_by_a_later_one_repairs_only_the_requests_it_held():
    """A TextOutputs names the requests of the RECENT (2) messages before it: a lost one repairs those alone, however
    many other choices are live and quiet; two lost in a row are named by the next one still."""
    table, _, sent = make_table()
    req = table.add(parsed(n=4), "http")
    a, b, c, d = (ch.engine_id for ch in req.choices)
    out = [TextOutputs(step=i, deltas=[], number=i) for i in range(5)]
    out[0].deltas = [TextDelta(request_id=rid, seq=0, text="x", token_ids=[0]) for rid in (a, b, c, d)]
    out[3].recent = [(2, [c]), (1, [b])]  # 1 and 2 are lost: they held b's and c's next outputs
    out[4].recent = [(3, []), (2, [c])]
    for i in (0, 3, 4):
        table.on_outputs(out[i])
    assert sorted(resumed(sent)) == [(b, 1, [0], 1), (c, 1, [0], 1)]


def test_outputs_after_a_disconnect_are_stale_and_unknown_ids_are_violations():
    table, metrics, sent = make_table()
    req = table.add(parsed(), "http")
    rid = req.choices[0].engine_id
    table.cancel(req, "client")
    assert req.done and req.error is None and aborts(sent) == [(rid, "client")]
    table.on_outputs(delta(rid, 0, "late"))
    assert metrics.protocol.stale == 1 and rid in table.tombstones
    table.on_finished(Finished(request_id=rid, finish_reason="abort"))
    assert metrics.protocol.stale == 1 and not table.tombstones and not table.live
    table.on_finished(Finished(request_id=rid, finish_reason="abort"))  # a duplicate terminal message
    table.on_outputs(delta("never-seen", 0, "x"))
    assert metrics.protocol.violations == {"duplicate": 1, "unknown_id": 1} and metrics.protocol.stale == 1


def test_output_past_the_count_of_its_finished_is_a_violation_and_a_late_duplicate_is_not():
    table, metrics, _ = make_table()
    req = table.add(parsed(), "http")
    rid = req.choices[0].engine_id
    table.on_outputs(delta(rid, 0, "a"))
    table.on_finished(Finished(request_id=rid, finish_reason="length", text="b", token_ids=[1], num_output_tokens=2))
    table.on_outputs(delta(rid, 0, "a"))  # a duplicated message: tokens the Finished accounts for
    table.on_finished(Finished(request_id=rid, finish_reason="length", num_output_tokens=2))
    assert metrics.protocol.violations == {"duplicate": 2}
    table.on_outputs(delta(rid, 2, "c"))  # token 2: nothing may follow the terminal message (I2)
    table.on_finished(Finished(request_id=rid, finish_reason="length", num_output_tokens=3))
    assert metrics.protocol.violations == {"duplicate": 2, "after_finished": 2}
    assert response_body(req, VOCAB)["choices"][0]["text"] == "ab" and not table.live and not table.tombstones


def test_an_unanswered_abort_is_resent_then_the_tombstone_is_dropped():
    table, _, sent = make_table(abort_timeout_s=1.0)
    req = table.add(parsed(), "http")
    rid = req.choices[0].engine_id
    table.cancel(req)
    t0 = time.monotonic()
    table.expire(t0 + 0.5)
    assert len(aborts(sent)) == 1
    for i in (1, 2):
        table.expire(t0 + 1.01 * i)
        assert len(aborts(sent)) == 1 + i
    table.expire(t0 + 3.1)
    assert aborts(sent) == [(rid, "client")] * 3 and not table.tombstones


def test_engine_death_fails_requests_without_aborts_and_the_detokenizer_closes_them():
    table, metrics, sent = make_table()
    req = table.add(parsed(n=2), "http")
    table.fail_all(RequestError(503, "the scheduler died"), send_abort=False)
    assert req.done and req.error.status == 503 and not aborts(sent)
    for c in req.choices:
        table.on_finished(Finished(request_id=c.engine_id, finish_reason="error", error="the engine died"))
    assert not table.tombstones and not metrics.protocol.violations
    other = table.add(parsed(), "http")
    table.fail_all(RequestError(503, "the scheduler died"), send_abort=False)
    table.expire(time.monotonic() + 1.1)  # no Finished came: dropped after one timeout, nothing sent
    assert not table.tombstones and not aborts(sent) and other.done


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

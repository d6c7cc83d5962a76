"""The client party's ledger (actors/client_ledger.py) through the HTTP actor's request table, without processes:
every protocol case (duplicates, gaps, lost messages, stale outputs, unknown ids, a short Finished, deaths, I7).
The offline client shares the ledger class: these cases hold for it too."""

from __future__ import annotations

import time

from actors.protocol import MAX_ATTEMPTS
from frontend.protocol import RequestError
from frontend.responses import response_body, stream_tail
from messages.wire import Finished, TextDelta, TextOutputs
from tests.http_table_harness import VOCAB, aborts, delta, events, make_table, parsed, resumed


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


def test_a_death_waits_then_resumes_every_live_choice_and_detokenizer_deaths_fail_a_poison_request():
    """While the engine side is down nothing is sent and tombstones go (an output of one is then an unknown id's);
    once both actors are back every live choice is re-submitted from its record. The scheduler's deaths are the
    engine's to judge (its flight record blames the requests of the steps it died in): a choice is resumed through
    any number of them. One live at more than max_resumes deaths of the detokenizer (both at once: one) fails with
    500 (its siblings too, no Abort: the new engine side never heard of them)."""
    table, metrics, sent = make_table()
    req = table.add(parsed(n=2), "http")
    gone = table.add(parsed(rid="cmpl-gone"), "http")
    table.cancel(gone)
    first, second = (c.engine_id for c in req.choices)
    table.on_outputs(delta(first, 0, "a"))
    deaths = [("scheduler", "detokenizer"), *[("scheduler",)] * 4, ("detokenizer",)]
    for i, dead in enumerate(deaths, 1):
        assert all(map(table.on_down, dead)) and not table.tombstones
        assert not table.on_up("worker")
        assert not any(table.on_up(actor) for actor in dead[:-1])  # (the last is still down)
        n = len(sent)
        assert table.on_up(dead[-1]) and metrics.protocol.resumes["death"] == 2 * i and not req.done
        assert [(m.request_id, m.resume_token_ids) for m in sent[n:]] == [(first, [0]), (second, [])]
    table.on_down("engine")
    assert not table.on_up("engine") and not req.done, "only the scheduler and detokenizer hold requests"
    table.on_down("detokenizer")  # its third death with the choices live
    n = len(sent)
    table.on_up("detokenizer")
    assert req.done and req.error.status == 503 and "restarts of the detokenizer" in req.error.message
    assert sent[n:] == [] and not table.live and table.tombstones.keys() == {first, second}  # (for one timeout)
    table.on_outputs(delta(gone.choices[0].engine_id, 0, "late"))  # its tombstone went with the first death
    assert metrics.protocol.violations == {"unknown_id": 1}, "never taken for output past a Finished"


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

"""What a sender may put in a numbered message, fuzzed into the receiving sides' protocol objects (no processes):
the numbering (actors/protocol.py's StepNumbers, shared by the detokenizer's StepOutputs link and the client's
TextOutputs links), the client's ledger (the HTTP actor's request table), the detokenizer's step handler and the
front's door to remote replicas. Numbers huge, negative, repeated, zero, past any gap; `recent` lists long and naming
anything; unknown request ids, seqs and attempts anywhere. Seeded, fixed counts: no exception escapes, and a gap of
any size leaves at most KEPT + 1 numbers tracked (one numbered 2**62 after 0 made a receiver list them all: the front
hung on one message from a node)."""

from __future__ import annotations

import logging
import random
import time

import pytest

from actors import replica_link
from actors.detokenizer.actor import DetokenizerActor
from actors.protocol import KEPT, StepNumbers, lost_suspects
from actors.replica_remote import NUMBER_WINDOW
from messages.sampling_params import SamplingParams
from messages.wire import ActorDown, AddRequest, Finished, RequestOutput, StepOutputs, TextDelta, TextOutputs
from tests.http_table_harness import make_table, parsed
from tests.test_replica_nodes import Clock, door, joined, relay
from tests.tiny_model import make_tiny_model_dir

HUGE = (2**31, 2**62, 2**63 - 1)
BOUND = KEPT + 1  # the numbers a receiver tracks after one message, whatever it said


def a_number(rng: random.Random, last: int) -> int:
    """What a sender may number its next message, honest or not."""
    return rng.choice([
        last + 1, last + 1, last + 2, last + rng.randint(3, 12), last, last - 1, max(0, last - rng.randint(1, 5)),
        0, -1, -rng.randint(2, 2**63), rng.choice(HUGE), rng.randint(0, 2**63 - 1), last + KEPT + rng.randint(1, 10**9),
    ])  # fmt: skip


def a_recent(rng: random.Random, last: int, ids: list[str]) -> list[tuple[int, list[str]]]:
    """What a sender may put in a message's `recent`: none to 400 entries, each any number naming any of `ids`."""
    length = rng.choice([0, 1, 2, 2, 3, 400])
    entries = [(rng.choice([last - 1, last - 2, a_number(rng, last)]), rng.sample(ids, rng.randint(0, len(ids))))
               for _ in range(min(length, 4))]  # fmt: skip
    return (entries * 100)[:length]  # (a long one repeats its few: every entry is looked up all the same)


def test_a_jump_of_any_size_tracks_a_bounded_set_and_repairs_as_a_long_loss():
    """The regression: 0, then 10**6 (today: a million numbers listed, for ever for 2**62); the loss is found as
    the whole run's would be: every request not heard from since is suspect."""
    link = StepNumbers()
    assert link.accept(0) and link.accept(10**6, [(10**6 - 1, ["a"]), (10**6 - 2, ["b"])])
    assert len(link.missing) <= BOUND and link.last == 10**6
    lost = link.lost()
    records = {"a": _heard(0), "b": _heard(0), "c": _heard(10**6)}  # (c was in the jumping message)
    assert str(lost) == "1..999998" and len(lost) == 10**6 - 2 and len(lost.runs) <= BOUND  # (999999: one behind)
    assert sorted(lost_suspects(link, lost, records.items())) == ["a", "b"]
    assert link.accept(2**62) and len(link.missing) <= 2 * BOUND and link.accept(2**62 + 1)


class _heard:
    """A request's record as lost_suspects reads it (Heard): the number of the last message it was heard in."""

    def __init__(self, heard: int):
        self.heard = heard


@pytest.mark.parametrize("seed", range(2))
def test_step_numbers_stay_bounded_whatever_a_sender_numbers(seed):
    rng, link, last = random.Random(seed), StepNumbers(), 0
    records = {f"r{i}": _heard(0) for i in range(6)}
    for i in range(2000):
        n = a_number(rng, last)
        link.accept(n, a_recent(rng, last, list(records)))
        last = max(last, n) if n >= 0 else last
        assert len(link.missing) <= 1 + BOUND * (1 + i % 3) and len(link.named) <= len(link.missing)
        if i % 3 == 2:  # (receivers look for losses after each message; here after every third, too)
            lost_suspects(link, link.lost(), records.items())
            assert len(link.missing) <= BOUND


def _delta(rng: random.Random, rids: list[str]) -> TextDelta:
    """A TextDelta for any of `rids` with any seq, attempt and number of tokens."""
    seq = rng.choice([0, 1, 2, 3, -1, *HUGE])
    ids = [rng.randrange(50)] * rng.choice([0, 1, 3])
    return TextDelta(request_id=rng.choice(rids), seq=seq, text="x" * len(ids), token_ids=ids,
                     attempt=rng.choice([0, 0, 1, 2, 3, -1, 2**40]))  # fmt: skip


def _finished(rng: random.Random, rids: list[str]) -> Finished:
    """A Finished for any of `rids`: any reason, any count of output tokens (huge and negative too), any attempt."""
    return Finished(request_id=rng.choice(rids), finish_reason=rng.choice(["stop", "length", "abort", "error"]),
                    num_output_tokens=rng.choice([0, 1, 5, -1, *HUGE]), token_ids=[1] * rng.choice([0, 2]),
                    attempt=rng.choice([0, 1, 2, 2**40]))  # fmt: skip


@pytest.mark.parametrize("seed", range(2))
def test_the_client_ledger_takes_anything_a_replica_sends(seed, caplog):
    """The HTTP actor's request table (two replicas), fed TextOutputs from any replica index: no exception escapes,
    each link tracks a bounded set, the live requests are those it opened (or fewer: failed, finished)."""
    caplog.set_level(logging.CRITICAL, "sluice")  # (a violation's log line each: formatting them is the cost)
    rng = random.Random(seed)
    table, _, _ = make_table(replicas=2)
    requests = [table.add(parsed(n=2, rid=f"cmpl-{i}"), "http") for i in range(4)]
    rids = [c.engine_id for r in requests for c in r.choices] + ["cmpl-unknown", ""]
    last = 0
    for i in range(1000):
        number = a_number(rng, last)
        last = max(last, number) if number >= 0 else last
        deltas = [_delta(rng, rids) for _ in range(rng.randint(0, 3))]
        finished = [_finished(rng, rids) for _ in range(rng.choice([0, 0, 1]))]
        msg = TextOutputs(step=rng.randint(-2, 10), number=number, recent=a_recent(rng, last, rids),
                          replica=rng.choice([0, 0, 1, -1, 7]), deltas=deltas, finished=finished)  # fmt: skip
        table.on_outputs(msg)
        if i % 50 == 0:
            table.expire(time.monotonic())
        assert all(len(r.link.missing) <= BOUND for r in table.replicas.all)
        assert len(table.live) <= 8 and len(table.tombstones) <= 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny model's directory: the detokenizer's tokenizer."""
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny-fuzz") / "model"))


@pytest.mark.parametrize("seed", range(2))
def test_the_detokenizer_takes_any_numbering_of_steps(model, seed, caplog):
    """The StepOutputs link (scheduler -> detokenizer, one host): the same numbering, the same bound."""
    caplog.set_level(logging.CRITICAL, "sluice")
    rng = random.Random(seed)
    detok = DetokenizerActor(model)
    detok.tell = lambda dst, msg: None
    rids = [f"req-{i}" for i in range(4)] + ["req-unknown"]
    for rid in rids[:4]:
        params = SamplingParams(max_tokens=10**6, ignore_eos=True)
        detok.on_add(AddRequest(request_id=rid, prompt_token_ids=[1, 2], params=params, client="http"))
    last = 0
    for i in range(800):
        step = a_number(rng, last)
        last = max(last, step) if step >= 0 else last
        outputs = [RequestOutput(request_id=rng.choice(rids), seq=rng.choice([0, 1, 2, 5, -1, 2**62]),
                                 new_token_ids=[1000 + rng.randrange(4)] * rng.choice([0, 1, 2]),
                                 attempt=rng.choice([0, 0, 2, 2**40])) for _ in range(rng.randint(0, 3))]  # fmt: skip
        detok.on_step(StepOutputs(step=step, outputs=outputs, recent=a_recent(rng, last, rids)))
        assert len(detok.steps.missing) <= BOUND
        if i % 300 == 299:  # (the engine restarts: the link numbers afresh)
            detok.on_actor_down(ActorDown(actor=detok.scheduler))


def test_the_detokenizer_counts_and_logs_a_long_loss_whole(model, caplog):
    """Steps 0 and 10**6: the loss of 1 .. 999998 counts 999998 lost steps (not the 5 entries that stand for them)
    and is logged as that range (999999, one behind the last, is not lost yet)."""
    caplog.set_level(logging.ERROR, "sluice")
    detok = DetokenizerActor(model)
    detok.tell = lambda dst, msg: None
    for step in (0, 10**6):
        detok.on_step(StepOutputs(step=step, outputs=[]))
    assert detok.lost_steps == 10**6 - 2
    assert "engine steps 1..999998 lost" in caplog.text


@pytest.mark.parametrize("seed", range(2))
def test_the_door_takes_a_node_that_numbers_falsely_out_of_rotation(seed, caplog, monkeypatch):
    """Any numbering from a node's detokenizer: what runs at most NUMBER_WINDOW past the highest one before is
    delivered; a number further ahead takes the replica down (not delivered, counted) until, its quarantine over, it
    joins a new epoch."""
    caplog.set_level(logging.CRITICAL, "sluice")
    monkeypatch.setattr(replica_link, "time", clock := Clock())
    rng, d = random.Random(seed), door()
    r, violations = d.remote[1], 0
    for _ in range(1000):
        if not r.up:
            clock.now = r.barred_until
            joined(d)
        before = r.number
        number = a_number(rng, before or 0)
        d.router.delivered.clear()
        relay(d, b"A", TextOutputs(step=0, deltas=[], number=number, replica=1))
        jumped = before is not None and number > 0 and number - before > NUMBER_WINDOW
        violations += jumped
        assert d.violations == violations and r.up is not jumped
        outputs = [m for _, m in d.router.delivered if isinstance(m, TextOutputs)]
        assert outputs == ([] if jumped else [TextOutputs(step=0, deltas=[], number=number, replica=1)])
    assert violations > 0

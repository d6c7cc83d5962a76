"""The detokenizer actor's handlers driven directly, message by message (no processes): which copy of a request
(AddRequest.attempt, DESIGN I6/I8) it follows when its own repair, a client's copy, a late registration and an
older copy's AbortAck arrive in the orders a reordering or restarted link produces."""

from __future__ import annotations

import msgspec
import pytest

from actors.detokenizer.actor import DetokenizerActor
from messages.names import SCHEDULER
from messages.sampling_params import SamplingParams
from messages.wire import Abort, AbortAck, AddRequest, RequestOutput, StepOutputs, TextOutputs
from tests.tiny_model import make_tiny_model_dir

RID, CLIENT = "req-1", "client"
T = [1000, 1001, 1002, 1003, 1004]  # output tokens (plain text pieces)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny-copies") / "model"))


def recording(model: str) -> DetokenizerActor:
    actor = DetokenizerActor(model, stats_to=[CLIENT])
    actor.sent = []
    actor.tell = lambda dst, msg: actor.sent.append((dst, msg))
    return actor


@pytest.fixture
def detok(model):
    actor = recording(model)
    add = AddRequest(
        request_id=RID, prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=5, ignore_eos=True), client=CLIENT
    )
    actor.on_add(add)
    return actor


def step(actor: DetokenizerActor, n: int, seq: int, tokens: list[int], attempt: int, finish: str | None = None):
    out = RequestOutput(request_id=RID, seq=seq, new_token_ids=tokens, attempt=attempt, finish_reason=finish)
    actor.on_step(StepOutputs(step=n, outputs=[out]))


def to_client(actor: DetokenizerActor) -> tuple[list[int], list[str]]:
    """The token ids and finish reasons the client was sent (a Finished carries its step's tokens)."""
    batches = [m for dst, m in actor.sent if dst == CLIENT and isinstance(m, TextOutputs)]
    tokens = [t for b in batches for part in (*b.deltas, *b.finished) for t in part.token_ids]
    return tokens, [f.finish_reason for b in batches for f in b.finished]


def to_client_text(actor: DetokenizerActor) -> list[str]:
    return [d.text for dst, m in actor.sent if dst == CLIENT and isinstance(m, TextOutputs) for d in m.deltas]


def copies_made(actor: DetokenizerActor) -> list[AddRequest]:
    return [m for dst, m in actor.sent if dst == SCHEDULER and isinstance(m, AddRequest)]


def test_its_own_repair_registered_late_does_not_reset_the_stream(detok):
    """A gap makes a copy (attempt 2, even: the detokenizer's); that copy's outputs overtake its registration
    (a reordering link). They go on from the state the copy was made from, and the registration, when it comes,
    is this actor's own copy: ignored, not a rebuild back to where the copy started (which re-submitted the
    request at every later output, and once the copy finished left it live forever)."""
    step(detok, 0, 0, T[:1], attempt=0)
    step(detok, 1, 2, [T[2]], attempt=0)  # seq 1 lost
    (copy,) = copies_made(detok)
    assert (copy.attempt, copy.resume_token_ids) == (2, T[:1])
    step(detok, 2, 1, [T[1]], attempt=2)
    detok.on_add(copy)  # the registration, late
    step(detok, 3, 2, T[2:], attempt=2, finish="length")
    detok.on_add(copy)  # and again, after the end
    assert to_client(detok) == (T, ["length"])
    assert len(copies_made(detok)) == 1 and not detok.live


def test_a_clients_newer_copy_is_followed_and_an_older_one_ignored(detok):
    """A client's copy (odd) newer than the detokenizer's rebuilds the state from what the client has; the
    detokenizer's own older copy, registered after it, changes nothing."""
    step(detok, 0, 0, [T[0]], attempt=0)
    step(detok, 1, 1, [T[1]], attempt=0)
    step(detok, 2, 3, [T[3]], attempt=0)  # seq 2 lost: the detokenizer's copy 2
    (own,) = copies_made(detok)
    first = to_client_text(detok)[0]
    client_copy = msgspec.structs.replace(own, resume_token_ids=T[:1], resume_chars=len(first), attempt=3)
    detok.on_add(client_copy)  # the client lost the message with T[1], and made a copy too
    detok.on_add(own)  # older than the copy followed: ignored
    step(detok, 3, 2, [T[2]], attempt=2)  # the replaced copy's output: stale
    step(detok, 4, 1, T[1:], attempt=3, finish="length")
    tokens, finishes = to_client(detok)
    assert tokens == [T[0], T[1], *T[1:]] and finishes == ["length"]  # the client gets T[1] again (it lost it)
    assert detok.counts.stale == 1 and not detok.live


def test_an_older_copys_abort_ack_does_not_end_the_copy_followed(detok):
    """An AbortAck of a copy the detokenizer replaced (the engine acked it before the new copy arrived) is stale;
    the current copy's ends the request."""
    step(detok, 0, 0, T[:1], attempt=0)
    step(detok, 1, 2, [T[2]], attempt=0)  # copy 2 made
    detok.on_ack(AbortAck(request_id=RID, reason="stop", attempt=0))
    assert RID in detok.live and to_client(detok)[1] == []
    detok.on_ack(AbortAck(request_id=RID, reason="client", attempt=2))
    assert to_client(detok) == (T[:1], ["abort"]) and not detok.live


def test_a_stop_aborts_its_copy_only_and_a_newer_copy_replaces_the_tombstone(model):
    """A stop string in copy 0's output ends the request here and aborts copy 0 (Abort.attempt). Its client, which
    lost that Finished, re-submits copy 1 while the tombstone waits: copy 1 replaces it (the scheduler drops copy 0
    silently: no ack would come) and streams; copy 0's late ack is stale; the stop is found again in copy 1."""
    actor = recording(model)
    stop = actor.tokenizer.decode([T[1]])
    params = SamplingParams(max_tokens=5, ignore_eos=True, stop=[stop])
    add = AddRequest(request_id=RID, prompt_token_ids=[1, 2], params=params, client=CLIENT)
    actor.on_add(add)
    step(actor, 0, 0, T[:2], attempt=0)
    aborts = [m for dst, m in actor.sent if isinstance(m, Abort)]
    assert aborts == [Abort(request_id=RID, reason="stop", attempt=0)] and RID in actor.tombstones
    actor.sent.clear()
    actor.on_add(msgspec.structs.replace(add, resume_token_ids=[], attempt=1))
    assert RID in actor.live and RID not in actor.tombstones
    step(actor, 1, 0, T[:1], attempt=1)
    actor.on_ack(AbortAck(request_id=RID, reason="stop", attempt=0))
    assert actor.counts.stale == 1 and RID in actor.live
    step(actor, 2, 1, [T[1]], attempt=1)
    assert to_client(actor) == (T[:2], ["stop"])  # (the Finished carries the token that held the stop)
    assert [m for dst, m in actor.sent if isinstance(m, Abort)] == [Abort(request_id=RID, reason="stop", attempt=1)]


def test_a_closed_requests_copy_registered_after_its_own_outputs_is_repaired(detok):
    """The request ends; its client (which lost the end) makes a copy; the copy's outputs, its end among them,
    overtake its registration on a reordering link: registered after them, it is re-submitted at once (it would
    otherwise wait for outputs already gone: live for ever), while a copy whose older copy's outputs came is not."""
    step(detok, 0, 0, T, attempt=0, finish="length")
    assert not detok.live
    copy = AddRequest(request_id=RID, prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=5, ignore_eos=True),
                      client=CLIENT, resume_token_ids=T[:2], attempt=1)  # fmt: skip
    step(detok, 1, 2, T[2:], attempt=1, finish="length")  # (the copy's, unknown here: a violation)
    detok.on_add(copy)
    (repair,) = copies_made(detok)
    assert repair.attempt > copy.attempt and repair.resume_token_ids == T[:2]
    newer = msgspec.structs.replace(copy, attempt=repair.attempt + 1)
    detok.on_add(newer)  # (a newer copy: only older copies' outputs came, so it waits for its own)
    assert copies_made(detok) == [repair] and detok.live[RID].attempt == newer.attempt

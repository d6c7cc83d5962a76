"""actors.protocol.Tombstones: DESIGN I7, shared by the detokenizer and the HTTP actor. An Abort without a
terminal message is re-sent after each timeout; after max_abort_tries the tombstone is dropped."""

from __future__ import annotations

import logging
import time

from actors.protocol import Tombstones
from messages.wire import Abort


def test_an_unanswered_abort_is_resent_as_it_was_then_dropped(caplog):
    tombstones, sent = Tombstones(1.0, 3, logging.getLogger("test")), []
    tombstones.add(Abort(request_id="a", reason="stop", attempt=3), "scheduler.1")  # (a stop string in copy 3's)
    tombstones.add(Abort(request_id="b", reason="client"), "scheduler")
    t0 = time.monotonic()
    tombstones.expire(t0 + 0.5, send := lambda to, msg: sent.append((to, msg)))
    assert sent == []
    del tombstones["b"]  # its terminal message came
    for i in (1, 2):
        tombstones.expire(t0 + 1.01 * i, send)
        resent = ("scheduler.1", Abort(request_id="a", reason="stop", attempt=3))  # to where it went first
        assert sent == [resent] * i and tombstones["a"].tries == 1 + i
    with caplog.at_level(logging.ERROR):
        tombstones.expire(t0 + 3.1, send)
    assert len(sent) == 2 and not tombstones
    assert "[a] no terminal message in time (stop); tombstone dropped" in caplog.text


def test_a_tombstone_without_an_abort_is_dropped_after_one_timeout():
    tombstones, sent = Tombstones(1.0, 3, logging.getLogger("test")), []
    tombstones.add(Abort(request_id="a", reason="error"), "scheduler", sent=False)  # the engine is gone
    tombstones.expire(time.monotonic() + 1.01, lambda to, msg: sent.append(msg))
    assert not tombstones and not sent


def test_the_tombstones_of_a_dead_scheduler_are_dropped_alone():
    tombstones = Tombstones(1.0, 3, logging.getLogger("test"))
    for rid, to in (("a", "scheduler"), ("b", "scheduler.1"), ("c", "scheduler")):
        tombstones.add(Abort(request_id=rid, reason="client"), to)
    tombstones.drop("scheduler")
    assert list(tombstones) == ["b"]

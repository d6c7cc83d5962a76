"""The scheduler's intake ledger (actors/engine/intake.py): cases of its state x event table on a stub engine (the
real Scheduler, no model), with the memory of ids shrunk to 4 so that forgetting can be shown."""

from __future__ import annotations

import asyncio
import types

from actors.engine.block_manager import BlockManager
from actors.engine.intake import IntakeLedger, RequestIntake
from actors.engine.scheduler import Scheduler
from messages.names import replica
from messages.sampling_params import SamplingParams
from messages.wire import Abort, AbortAck, AddRequest


class Flight:
    def admit(self, req):
        return None


class Intake(RequestIntake):
    def __init__(self):
        self.sched = Scheduler(BlockManager(64, 16, False), 8, 64, 128, [2])
        self.intake = IntakeLedger()
        self.intake.seen.capacity = 4
        self.config = types.SimpleNamespace(replica=replica(0), stats_to=None)
        self.model = types.SimpleNamespace(bos_token_id=1, vocab_size=100)
        self.max_model_len, self.admitting, self.flight = 128, True, Flight()
        self.duplicates = self.late_aborts = 0
        self._work = asyncio.Event()
        self.told: list = []

    def tell(self, to, msg):
        self.told.append(msg)


def add(rid: str, attempt: int = 0, resume: list[int] | None = None) -> AddRequest:
    params = SamplingParams(max_tokens=20)
    return AddRequest(
        request_id=rid, prompt_token_ids=[5, 6, 7], params=params, attempt=attempt, resume_token_ids=resume
    )


def test_a_running_copy_is_not_replaced_by_an_older_one_after_its_note_is_forgotten():
    """R runs as copy 3; more ids than the ledger remembers arrive; a late copy 2 (the detokenizer's, made at once
    with 3) must still be dropped: the running copy's own number says 3 came first."""
    s = Intake()
    s.on_add(add("R"))
    s.on_add(add("R", 3, [9]))  # copy 0 aborted silently (nothing in flight: freed at once), copy 3 admitted
    s._send_acks()
    assert s.sched.requests["R"].attempt == 3
    for i in range(4):
        s.on_add(add(f"x{i}"))  # R's note is forgotten
    assert "R" not in s.intake.seen
    s.on_add(add("R", 2, [9]))
    s._send_acks()
    assert s.sched.requests["R"].attempt == 3 and s.duplicates == 1 and not s.intake.held


def test_an_abort_before_its_request_acks_it_at_once_and_a_new_add_again_is_a_duplicate():
    s = Intake()
    s.on_abort(Abort(request_id="A", reason="client"))
    s.on_add(add("A"))
    assert [type(m) for m in s.told] == [AddRequest, AbortAck] and "A" not in s.sched.requests
    s.on_add(add("A"))
    assert s.duplicates == 1


def test_a_copy_aborted_while_it_waits_for_its_earlier_copy_is_acked_when_that_one_is_freed():
    s = Intake()
    s.on_add(add("B"))
    batch = s.sched.schedule()  # copy 0 in flight: its blocks are read until the step reports
    s.on_add(add("B", 1, [9]))
    assert s.intake.count(compiling=False) == 1 and s.sched.requests["B"].attempt == 0
    s.on_abort(Abort(request_id="B", reason="client"))
    s.sched.update(batch, [8])
    s._send_acks()
    acks = [(m.request_id, m.attempt) for m in s.told if isinstance(m, AbortAck)]
    assert acks == [("B", 1)] and not s.intake.held and "B" not in s.sched.requests

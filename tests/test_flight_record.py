"""The engine's flight record (actors/engine/flight_record.py) without processes: each FlightRecord object is one
incarnation of the engine (a new one on the same path is the restarted engine reading what its predecessor wrote).
A torn write is ignored (the write before it is read), blame accumulates across deaths and goes with sampling, a
poison's copy is refused at max_step_failures, a copy that never comes is forgotten. (The real process deaths:
tests/test_worker_e2e.py.)"""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

from actors.engine.flight_record import FlightRecord
from actors.engine.request import EngineRequest, RequestStatus
from actors.engine.scheduler_actor import SchedulerActor
from gpu.batch import BatchSpec, ScheduledRow
from messages.sampling_params import SamplingParams
from tests.test_beam_search import Engine

MAX_FAILURES = 3
STEPS = itertools.count()  # (step numbers are unique)


def step(*rids: str) -> BatchSpec:
    """A step with a row of each id given."""
    rows = [ScheduledRow(rid, i, [1], 0, [0], True) for i, rid in enumerate(rids)]
    return BatchSpec(step=next(STEPS), rows=rows)


def request(rid: str) -> EngineRequest:
    return EngineRequest(rid, [1, 2], SamplingParams())


def incarnation(path: Path, ready: bool = True, **kwargs) -> tuple[FlightRecord, dict[str, int]]:
    """The record as a new engine opens it (`ready`: and then its model is loaded)."""
    record = FlightRecord(str(path), MAX_FAILURES, **kwargs)
    blamed = record.recover()
    if ready:
        record.arm()
    return record, blamed


def slots(path: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(path.parent.glob(f"{path.name}.*"))}


def test_the_first_start_blames_nobody_and_a_record_without_steps_in_flight_neither(tmp_path):
    path = tmp_path / "scheduler.flight"
    record, blamed = incarnation(path)
    assert blamed == {}
    record.write([step("a", "b")])
    record.write([])  # postprocessed: nothing in flight when the process dies
    assert incarnation(path)[1] == {}


def test_the_steps_in_flight_at_the_last_write_are_blamed_each_request_once(tmp_path):
    """A step stays in flight over two writes (async scheduling); one no longer in flight is not blamed; a request
    in both steps, or in two rows of one (a CFG companion's row carries its parent's id), is blamed once."""
    path = tmp_path / "scheduler.flight"
    record, _ = incarnation(path)
    a, b, c = step("a", "a"), step("b", "both"), step("c", "both")
    record.write([a])
    record.write([a, b])
    record.write([b, c])
    assert incarnation(path)[1] == {"b": 1, "c": 1, "both": 1}


def test_blame_is_kept_across_deaths_and_a_poison_is_refused_at_max_step_failures(tmp_path):
    """p is in the step in flight at three deaths; x at the first only, and it is still blamed at the third (it
    did not sample); y at the first, and it sampled since: forgotten."""
    path = tmp_path / "scheduler.flight"
    record, _ = incarnation(path)
    record.write([step("p", "x", "y"), step("p", "x", "y", "y")])
    record, blamed = incarnation(path)  # death 1
    assert blamed == {"p": 1, "x": 1, "y": 1}
    p, x, y = request("p"), request("x"), request("y")
    for req in (p, x, y):
        assert record.admit(req) is None
    assert (p.failed_steps, x.failed_steps, y.failed_steps) == (1, 1, 1)
    y.failed_steps = 0  # y sampled (Scheduler.update)
    record.write([step("p")])
    record, blamed = incarnation(path)  # death 2
    assert blamed == {"p": 2}
    p, x = request("p"), request("x")
    assert record.admit(p) is None and record.admit(x) is None and (p.failed_steps, x.failed_steps) == (2, 1)
    assert record.admit(request("y")) is None  # (a copy of y: clean)
    record.write([step("p")])
    record, blamed = incarnation(path)  # death 3
    assert blamed == {"p": 3}
    error = record.admit(request("p"))
    assert error is not None and "crashed the engine 3 times" in error
    x = request("x")
    assert record.admit(x) is None and x.failed_steps == 1


def test_a_request_that_ends_or_samples_leaves_the_record_and_the_workers_blames_stay(tmp_path):
    """A request blamed by a worker's death (recovery.py counts failed_steps; the scheduler `watch`es it) keeps
    that blame in the record, though in no step in flight, until it samples or ends."""
    path = tmp_path / "scheduler.flight"
    record, _ = incarnation(path)
    a, b, c = request("a"), request("b"), request("c")
    a.failed_steps = b.failed_steps = c.failed_steps = 2
    record.watch([a, b, c, request("clean")])
    b.status = RequestStatus.FINISHED
    c.failed_steps = 0
    record.write([])
    record, blamed = incarnation(path)
    assert blamed == {}
    copies = {rid: request(rid) for rid in ("a", "b", "c", "clean")}
    assert not any(map(record.admit, copies.values()))
    assert {rid: req.failed_steps for rid, req in copies.items()} == {"a": 2, "b": 0, "c": 0, "clean": 0}


def two_writes(path: Path) -> tuple[Path, bytes, bytes]:
    """Steps of nine requests in flight, then [a, b], then [b, c] and [c, d]: the slot of the last write (of the
    first too: they take turns), before and after it."""
    path.parent.mkdir()
    record, _ = incarnation(path)
    record.write([step(*(f"old-{i}" for i in range(9)))])
    record.write([step("a", "b")])
    before = slots(path)
    record.write([step("b", "c"), step("c", "d")])
    after = slots(path)
    (newest,) = [p for p in after if after[p] != before[p]]
    return newest, before[newest], after[newest]


def test_a_torn_write_is_ignored_and_the_one_before_it_read(tmp_path):
    """A write the process died in: its slot holds a prefix of the new record over the old one, or is short; the
    other slot, written one write before, is read. Both torn: nobody is blamed (nothing is made up)."""
    for i, tear in enumerate((lambda old, new: new[:14] + old[14:], lambda old, new: new[:14])):  # (a header is 12)
        path = tmp_path / str(i) / "scheduler.flight"
        newest, old, new = two_writes(path)
        assert tear(old, new) != new
        newest.write_bytes(tear(old, new))
        assert incarnation(path)[1] == {"a": 1, "b": 1}
    path = tmp_path / "both" / "scheduler.flight"
    two_writes(path)
    for p, data in slots(path).items():  # a bit of each record's body flipped
        p.write_bytes(data[:12] + bytes([data[12] ^ 1]) + data[13:])
    assert incarnation(path)[1] == {}


def test_a_blamed_request_whose_copy_never_comes_is_forgotten(tmp_path):
    """Once the wait for the copies is over (PENDING_TTL_S, 0 here), a late copy starts clean and the record
    forgets the blame of a copy that never came."""
    path = tmp_path / "scheduler.flight"
    record, _ = incarnation(path)
    record.write([step("gone", "late")])
    record, _ = incarnation(path, ttl_s=0.0)
    late = request("late")
    assert record.admit(late) is None and late.failed_steps == 0
    record.write([step("late")])
    record, blamed = incarnation(path)
    assert blamed == {"late": 1}
    gone = request("gone")
    assert record.admit(gone) is None and gone.failed_steps == 0


def test_the_wait_for_the_copies_starts_when_the_engine_is_ready(tmp_path):
    """However long the model takes to load, a blame waits for its copy from the engine's readiness on (the
    clients re-submit only then): not armed, even a zero wait forgets nothing."""
    path = tmp_path / "scheduler.flight"
    record, _ = incarnation(path)
    record.write([step("poison")])
    record, _ = incarnation(path, ready=False, ttl_s=0.0)
    poison = request("poison")
    assert record.admit(poison) is None and poison.failed_steps == 1


def test_the_flight_record_names_a_searchs_members_where_its_rows_carry_the_group():
    """The ids a step's requests' copies arrive under (SchedulerActor._arrives_as, the flight record's names): a
    search's rows carry its group's id, each beam's row the same one, and name its members, each once, beside a plain
    request; with no search left, the rows' own ids, each once."""
    eng = Engine(vocab=12)
    members = eng.search([1, 2, 0], n=2)
    eng.sched.add_request(EngineRequest("plain", [1, 2], SamplingParams(max_tokens=12)))
    actor = SimpleNamespace(sched=eng.sched)
    for _ in range(3):  # (the prompt's row, then a row per beam)
        eng.step()
    batch = eng.sched.schedule()
    rids = [row.request_id for row in batch.rows]
    assert rids.count(rids[0]) == 2 and rids[0] not in members  # (two beams' rows, the group's id)
    assert SchedulerActor._arrives_as(actor, rids) == [*members, "plain"]
    while batch.rows:  # (the search ends first: max_tokens)
        sampled, lp = eng.model.execute(batch)
        eng.sched.update(batch, sampled, None, lp)
        batch = eng.sched.schedule()
        if not eng.sched.num_groups:
            break
    assert "plain" in eng.sched.requests and not eng.sched.num_groups
    assert SchedulerActor._arrives_as(actor, ["plain", "plain"]) == ["plain"]

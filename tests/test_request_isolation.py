"""A request that raises while the scheduler plans or post-processes it fails alone (actors/engine/isolation.py):
it ends with exactly one error output after the tokens it reported, every other request outputs what an unbatched
run does (tests.scheduler_harness's oracle), nothing it held is left (blocks, slots, in-flight counts), and no
cached block it registered without computing is handed out (the harness reads every row's context back from KV).
What is not one request's fault (MemoryError, RecursionError, a failure that leaves the shared ledgers corrupt)
propagates: the engine process dies and restarts clean."""

import logging

import pytest

from actors.engine.isolation import INTERNAL_ERROR
from actors.runtime.faults import FaultInjector, FaultPlan, FaultRule, InjectedFault
from tests.scheduler_harness import Harness, expected, prompts
from tests.test_beam_search import Engine

MAX_MODEL_LEN = 64


class Failing(Harness):
    """The harness, taking the terminal outputs of requests whose planning failed as the actor sends them."""

    def step(self):
        batch = super().step()
        for out in self.sched.drain_failed():
            assert out.request_id not in self.finish and out.seq == len(self.tokens[out.request_id])
            self.finish[out.request_id] = (out.finish_reason, out.stop_reason)
        assert self.sched.ledger_error() is None  # (a failure handled alone leaves every ledger consistent)
        return batch


def raising(site: str, request: str, skip: int = 0):
    """The fault plan's raise rule, as the engine's scheduler gets it."""
    return FaultInjector(FaultPlan(rules=[FaultRule(action="raise", site=site, request=request, skip=skip)])).check


def assert_alone(h: Harness, reqs: dict, failed: str) -> None:
    """`failed` ended in an error after a prefix of its tokens; every other request as alone."""
    for rid, (prompt, p) in reqs.items():
        want, end = expected(prompt, p, MAX_MODEL_LEN)
        if rid == failed:
            assert h.finish[rid] == ("error", None) and h.tokens[rid] == want[: len(h.tokens[rid])]
        else:
            assert (h.tokens[rid], h.finish[rid]) == (want, end), rid


def workload(h: Harness, n: int = 5, **params) -> dict:
    reqs = {}
    for i, prompt in enumerate(prompts(n, seed=4, hi=40)):
        reqs[f"r{i}"] = (prompt, {"max_tokens": 6 + 3 * i, "ignore_eos": True, **params})
        h.add(f"r{i}", prompt, **reqs[f"r{i}"][1])
    return {rid: (prompt, h.requests[rid].params) for rid, (prompt, _) in reqs.items()}


@pytest.mark.parametrize("one_ahead", [False, True])
@pytest.mark.parametrize("site", ["scheduler.update", "scheduler.schedule"])
@pytest.mark.parametrize("skip", [0, 4])
def test_a_request_that_raises_fails_alone(one_ahead, site, skip):
    """At its first planning or result, or mid-decode (with a step of it in flight one ahead)."""
    h = Failing(one_ahead=one_ahead, budget=24, max_num_seqs=4, max_model_len=MAX_MODEL_LEN)
    h.sched.fault = raising(site, "r2", skip)
    reqs = workload(h)
    h.run()
    assert_alone(h, reqs, "r2")
    assert skip == 0 or h.tokens["r2"]  # (mid-stream: it reported tokens first)


@pytest.mark.parametrize("one_ahead", [False, True])
def test_a_row_lost_after_it_registered_cached_blocks_is_taken_back(one_ahead, monkeypatch):
    """A failure inside a row's planning, after it counted the row in flight and registered its full blocks in the
    prefix cache (tokens no step will compute): the counts are restored (else it is never freed) and the cache is
    forgotten (else the next request with that prefix reads KV nobody wrote)."""
    h = Failing(one_ahead=one_ahead, caching=True, budget=64, max_model_len=MAX_MODEL_LEN)
    shared = list(range(10, 30))  # 5 full blocks of 4
    row = h.sched._row

    def failing_row(req, n, drafts=(), seq=None):
        built = row(req, n, drafts, seq)
        if req.request_id == "victim":
            raise InjectedFault("after the row was planned")
        return built

    monkeypatch.setattr(h.sched, "_row", failing_row)
    p = {"max_tokens": 4, "ignore_eos": True}
    h.traffic([("victim", [*shared, 1], p, 0, None), ("later", [*shared, 2], p, 2, None), ("x", [5, 6], p, 1, None)], 4)
    reqs = {rid: (prompt, h.requests[rid].params) for rid, prompt in (("later", [*shared, 2]), ("x", [5, 6]))}
    assert_alone(h, reqs, "victim")
    assert h.finish["victim"] == ("error", None) and h.tokens["victim"] == []


def test_a_guided_request_that_fails_after_its_companions_row_frees_both(monkeypatch):
    """The companion's row is planned (and counted in flight) before its parent's: the parent's failure takes both
    back."""
    h = Failing(budget=32, max_model_len=MAX_MODEL_LEN)
    row = h.sched._row
    calls = []

    def failing_row(req, n, drafts=(), seq=None):
        calls.append(req.request_id)
        if req.request_id == "guided" and calls.count("guided") == 3:
            raise InjectedFault("the parent's row")
        return row(req, n, drafts, seq)

    monkeypatch.setattr(h.sched, "_row", failing_row)
    reqs = workload(h, n=3)
    h.add("guided", [7, 8, 9], negative=[1, 2], max_tokens=8, ignore_eos=True)
    h.run()
    assert_alone(h, reqs, "guided")
    assert h.finish["guided"] == ("error", None) and len(h.tokens["guided"]) == 2


def test_a_failed_search_fails_its_members_alone():
    eng = Engine(vocab=12)
    eng.sched.fault = raising("scheduler.update", "gpoisoned/*", skip=4)
    alone = Engine(vocab=12)
    want = [alone.answers[r] for r in alone.search([2, 1, 0, 2], n=2, width=3, max_tokens=8) if alone.run() or True]
    eng.ids = iter(["poisoned", "fine"])
    poisoned = eng.search([1, 2, 0, 1], n=2, width=3, max_tokens=8)
    fine = eng.search([2, 1, 0, 2], n=2, width=3, max_tokens=8)
    eng.run()
    assert [eng.answers[r] for r in poisoned] == [([], "error")] * 2
    assert [eng.answers[r] for r in fine] == want


def test_a_fork_that_fails_mid_regroup_leaves_no_beam_behind(monkeypatch):
    """The second fork of a step raises: the children made so far are the group's, freed with it."""
    eng = Engine(vocab=12)
    fork, calls = eng.sched.block_manager.fork, []

    def failing_fork(seq, parent, n):
        calls.append(seq)
        if len(calls) == 2:
            raise InjectedFault("fork")
        fork(seq, parent, n)

    monkeypatch.setattr(eng.sched.block_manager, "fork", failing_fork)
    rids = eng.search([1, 2, 0, 1, 2, 0, 1, 2, 0], n=2, width=3, max_tokens=8)
    eng.run()  # (idle: every block and slot free)
    assert [eng.answers[r] for r in rids] == [([], "error")] * 2


@pytest.mark.parametrize("one_ahead", [False, True])
def test_a_request_that_raises_amid_its_tokens_reports_none_of_them(one_ahead, monkeypatch):
    """A row's tokens are appended one by one: a failure after the first of a step takes them back, and the error
    output follows the last token reported (I6: no gap, nothing twice)."""
    h = Failing(one_ahead=one_ahead, max_model_len=MAX_MODEL_LEN)
    ends = h.sched._ends

    def failing_ends(req, token):
        if req.request_id == "r1" and len(req.output_token_ids) == 3:
            raise InjectedFault("a stop condition")
        return ends(req, token)

    monkeypatch.setattr(h.sched, "_ends", failing_ends)
    reqs = workload(h, n=3)
    h.run()
    assert_alone(h, reqs, "r1")
    assert len(h.tokens["r1"]) == 2


def test_a_request_that_fails_as_it_is_admitted_leaves_nothing_held(monkeypatch):
    """A failure between its slots and its blocks: it is already in the running list, where its status says."""
    h = Failing(budget=32, max_model_len=MAX_MODEL_LEN)
    allocate = h.sched.block_manager.allocate

    def failing_allocate(seq, num_tokens, hits=()):
        if seq.request_id == "r3":
            raise InjectedFault("allocate")
        allocate(seq, num_tokens, hits)

    monkeypatch.setattr(h.sched.block_manager, "allocate", failing_allocate)
    reqs = workload(h)
    h.run()
    assert_alone(h, reqs, "r3")


@pytest.mark.parametrize("at", ["_finish", "_settle"])
def test_a_search_that_raises_as_it_ends_its_members_ends_every_member(monkeypatch, at):
    """The group ends, then raises while it ends its second member (before or after that one finished): every member
    still gets one error output and is freed (the engine reports idle: Engine.run)."""
    eng = Engine(vocab=12)
    real, raised = getattr(eng.sched, at), []

    def failing(req, *args):
        if req.request_id == "g0/1" and not raised:
            raised.append(req)
            raise InjectedFault(at)
        return real(req, *args)

    monkeypatch.setattr(eng.sched, at, failing)
    rids = eng.search([1, 2, 0, 1], n=3, width=3, max_tokens=4, ignore_eos=True)
    eng.run()
    assert raised and [eng.answers[r] for r in rids] == [([], "error")] * 3


def test_the_client_is_told_the_request_id_and_the_log_the_exception(monkeypatch, caplog):
    """The exception's text (which may name other requests) goes to the log with its traceback, not to the client."""
    h = Failing(max_model_len=MAX_MODEL_LEN)
    h.sched.fault = raising("scheduler.update", "r1")
    update, errors = h.sched.update, {}

    def recording(*args):
        outputs = update(*args)
        errors.update((o.request_id, o.error) for o in outputs if o.error)
        return outputs

    monkeypatch.setattr(h.sched, "update", recording)
    workload(h, n=2)
    with caplog.at_level(logging.ERROR, "sluice.engine"):
        h.run()
    assert errors == {"r1": INTERNAL_ERROR}
    (record,) = [r for r in caplog.records if r.message.startswith("[r1]")]
    assert record.exc_info[0] is InjectedFault and "InjectedFault" in caplog.text


@pytest.mark.parametrize("error", [MemoryError, RecursionError])
def test_what_is_not_one_requests_fault_propagates(error):
    h = Failing(max_model_len=MAX_MODEL_LEN)

    def fault(site, rid):
        if rid == "r1":
            raise error()

    h.sched.fault = fault
    workload(h, n=3)
    with pytest.raises(error):
        h.run()


def corrupt(h: Harness, how: str) -> None:
    s = h.sched
    if how == "refcount":
        s.block_manager.ref_counts[s.requests["r0"].block_table[0]] += 1
    elif how == "free queue":
        s.block_manager.free_queue[s.requests["r0"].block_table[0]] = None
    elif how == "slot":
        s.free_slots.append(s.requests["r0"].slot)
    else:  # a request dropped from its queue (a preemption that failed half-way)
        s.running.remove(s.requests["r0"])


@pytest.mark.parametrize("how", ["refcount", "free queue", "slot", "queue"])
def test_a_failure_that_leaves_a_shared_ledger_corrupt_propagates(monkeypatch, how):
    """r2 raises after it broke what every request shares: carrying on could mix KV between requests, so the
    scheduler raises (the engine process dies and restarts clean) instead of failing r2 alone."""
    h = Failing(max_model_len=MAX_MODEL_LEN)
    workload(h)
    h.step()
    plan = h.sched._plan

    def corrupting(req, budget, chunk):
        if req.request_id == "r2":
            corrupt(h, how)
            raise InjectedFault("after it broke a shared ledger")
        return plan(req, budget, chunk)

    monkeypatch.setattr(h.sched, "_plan", corrupting)
    with pytest.raises(RuntimeError, match="ledgers are corrupt after request r2 failed") as caught:
        h.step()
    assert isinstance(caught.value.__cause__, InjectedFault)


def test_the_schedule_hook_counts_the_steps_a_request_is_planned_in():
    """A queue head blocked (a CFG pair short of slots behind a running request) is not planned: the raise rule's
    skip counts only the steps its rows are planned in (its admission, then one), so it fails at its third."""
    h = Failing(max_num_seqs=2, max_model_len=MAX_MODEL_LEN)
    h.sched.fault = raising("scheduler.schedule", "guided", skip=2)
    reqs = workload(h, n=1)
    h.add("guided", [7, 8, 9], negative=[1, 2], max_tokens=8, ignore_eos=True)
    h.run()
    assert_alone(h, reqs, "guided")
    assert h.finish["guided"] == ("error", None) and len(h.tokens["guided"]) == 2

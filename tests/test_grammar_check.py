"""Grammars.check, the frontend's compile check, under slow grammars: a spec that waited for a thread the whole
timeout is GrammarBusy and taken off the queue (never compiled for nobody), one that ran too long is GrammarError,
a spec that compiled before passes without a thread, an invalid one is compiled (and refused) every time. The
compiles are stand-ins blocked on events: no timing is measured."""

from __future__ import annotations

import concurrent.futures
import threading
import types

import pytest

from actors.engine.grammar import GrammarBusy, GrammarError, Grammars
from messages.sampling_params import StructuredOutput
from tests.cancel_harness import model_dir  # noqa: F401 (fixture)

WAIT_S = 30  # a deadline on events that the test sets itself: only a bug reaches it


def spec(name: str) -> StructuredOutput:
    return StructuredOutput(kind="regex", spec=name)


@pytest.fixture
def gated(model_dir):  # noqa: F811
    """Grammars whose compiles of specs named "slow*" start, then wait for `gate`; "bad*" specs are invalid."""
    g = Grammars(str(model_dir), 49152, [2], threads=2)
    gate, started, compiled = threading.Event(), {}, []

    def compile(s: StructuredOutput):
        started.setdefault(s.spec, threading.Event()).set()
        compiled.append(s.spec)
        if s.spec.startswith("slow"):
            assert gate.wait(WAIT_S)
        if s.spec.startswith("bad"):
            raise GrammarError("invalid")

    g.compile = compile
    g.gate, g.started, g.compiled = gate, started, compiled
    yield g
    gate.set()
    g._pool.shutdown(wait=True)


def occupy(g: Grammars, pool: concurrent.futures.Executor, *names: str) -> list[concurrent.futures.Future]:
    """Checks of slow specs, returned once their compiles hold the threads."""
    futures = [pool.submit(g.check, spec(n), WAIT_S) for n in names]
    for n in names:
        assert g.started.setdefault(n, threading.Event()).wait(WAIT_S)
    return futures


def test_a_spec_that_never_got_a_thread_is_busy_and_dropped(gated):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        first, second = occupy(gated, pool, "slow-a", "slow-b")
        with pytest.raises(GrammarBusy, match="busy"):
            gated.check(spec("waits"), 0.05)
        with pytest.raises(GrammarError, match="took more than") as e:
            gated.check(spec("slow-a"), 0.05)  # it runs: too slow, not busy
        assert not isinstance(e.value, GrammarBusy)
        gated.gate.set()
        for future in (first, second):
            future.result(WAIT_S)
    gated._pool.shutdown(wait=True)
    assert gated.compiled == ["slow-a", "slow-b"]  # the dropped spec was never compiled


def test_a_spec_compiled_before_needs_no_thread(gated):
    gated.gate.set()
    gated.check(spec("slow-known"), WAIT_S)
    gated.gate.clear()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        occupy(gated, pool, "slow-c", "slow-d")
        gated.check(spec("slow-known"), 0.001)  # both threads busy: passes from memory
        gated.gate.set()
    assert gated.compiled.count("slow-known") == 1


def test_an_invalid_spec_is_refused_every_time(gated):
    for _ in range(2):
        with pytest.raises(GrammarError, match="invalid"):
            gated.check(spec("bad"), WAIT_S)
    assert gated.compiled == ["bad", "bad"]


def test_a_spec_too_slow_once_stays_refused_without_a_thread(gated):
    """A retry of a spec that compiled, but past its asker's timeout, cannot slip through to the engine."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        (holder,) = occupy(gated, pool, "slow-x")
        with pytest.raises(GrammarError, match="took more than"):
            gated.check(spec("slow-x"), 0.05)
        gated.gate.set()
        holder.result(WAIT_S)
    gated._pool.shutdown(wait=True)  # (no thread left: a check that needed one would fail otherwise)
    with pytest.raises(GrammarError, match="did before"):
        gated.check(spec("slow-x"), WAIT_S)


def test_every_asker_of_a_dropped_spec_is_told_at_once(gated):
    """Two requests wait for a thread for the same spec; when the first gives up (and takes it off the queue), the
    second is told it is busy then, not at the end of its own, longer wait."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        occupy(gated, pool, "slow-a", "slow-b")
        patient = pool.submit(gated.check, spec("waits"), WAIT_S)
        with pytest.raises(GrammarBusy):
            gated.check(spec("waits"), 0.05)
        with pytest.raises(GrammarBusy):
            patient.result(WAIT_S / 6)  # (woken by the cancellation, long before its own deadline)
        gated.gate.set()


def test_checking_a_compile_that_ended_at_once_returns(model_dir):  # noqa: F811
    """check() once deadlocked on its own lock when the compile ended before it could watch it (a cached spec, a
    fast compile: the done callback then runs at once in the caller). A compile that is done on submission."""
    g = Grammars(str(model_dir), 49152, [2], threads=1)
    done = concurrent.futures.Future()
    done.set_result(None)
    g._pool = types.SimpleNamespace(submit=lambda *args: done)
    checker = threading.Thread(target=g.check, args=(StructuredOutput(kind="regex", spec="[a-z]+"), 5.0), daemon=True)
    checker.start()
    checker.join(10)
    assert not checker.is_alive(), "check() deadlocked"

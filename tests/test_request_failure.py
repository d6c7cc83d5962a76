"""One request that raises in the engine's scheduler fails alone, through the real engine and detokenizer
processes (issue 48): a fault plan's raise rule fires inside `update` or `schedule` for the chosen request while
others stream; it ends with an internal error (a 500 for its client) after a prefix of its tokens, every other
request outputs exactly what the fault-free engine does, the engine process is the same one (no restart), nothing
is left behind, and the engine serves on.

A terminal output made outside a step's results (a failed planning, a request the intake refuses, a poison request
recovery fails) travels in a numbered StepOutputs like any other, so its loss is a gap the detokenizer repairs: the
scheduler actor's intake, recovery and reports around a scheduler harness (`Loop`), its messages carried to a real
detokenizer by hand, the one holding the victim's error lost, and every client still answered once."""

from __future__ import annotations

import asyncio
import collections
import types

import pytest

from actors.detokenizer.actor import DetokenizerActor
from actors.engine.intake import IntakeLedger, RequestIntake
from actors.engine.isolation import INTERNAL_ERROR
from actors.engine.recovery import WorkerRecovery
from actors.engine.step_outputs import StepReports
from actors.engine.worker_link import DIED, WorkerLost
from actors.protocol import SentNames
from actors.runtime import FaultPlan, FaultRule
from actors.runtime.faults import FaultInjector
from frontend.offline import AsyncLLM
from messages.names import SCHEDULER, replica
from messages.sampling_params import SamplingParams
from messages.step import StepResult
from messages.wire import AbortAck, AddRequest, Finished, StepOutputs, TextOutputs
from tests.cancel_harness import (
    LONG_PROMPT,
    assert_idle,
    clean_llm,  # noqa: F401 (a fixture)
    engine_config,
    model_dir,  # noqa: F401 (a fixture)
    start,
)
from tests.scheduler_harness import VOCAB, Harness, expected, prompts

PROMPTS = [[5, 6, 7], [100, 200, 300, 400], LONG_PROMPT, [42] * 20, [9, 8, 7, 6, 5, 4, 3, 2]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)
VICTIM = [11, 12, 13, 14]
SKIP = 3  # (the victim's first outputs pass: it fails mid-stream)
PLAN = FaultPlan(
    rules=[
        FaultRule(action="raise", site="scheduler.update", request="victim-update-*", skip=SKIP),
        FaultRule(action="raise", site="scheduler.schedule", request="victim-schedule-*", skip=SKIP),
    ]
)


def workload() -> list[tuple[list[int], SamplingParams]]:
    return [(p, GREEDY if i % 2 else SEEDED) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
async def faulty(model_dir):  # noqa: F811
    async with AsyncLLM(engine_config(model_dir), fault_plan=PLAN) as llm:
        yield llm


@pytest.fixture(scope="module")
async def reference(clean_llm):  # noqa: F811
    runs = [start(clean_llm, p, params) for p, params in [(VICTIM, GREEDY), *workload()]]
    for run in runs:
        await run.done()
    return [(r.token_ids, r.text, r.finished.finish_reason) for r in runs]


@pytest.mark.parametrize("site", ["update", "schedule"])
async def test_a_request_that_raises_in_the_scheduler_fails_alone(faulty, reference, site):
    engine = faulty.system.pids()["engine"]
    victim = start(faulty, VICTIM, GREEDY, request_id=f"victim-{site}-{faulty.new_id()}")
    others = [start(faulty, p, params) for p, params in workload()]
    fin = await victim.done()
    assert (fin.finish_reason, fin.error_kind) == ("error", "internal"), fin
    assert fin.error == f"request {victim.request_id}: {INTERNAL_ERROR}"  # (the exception: in the log)
    tokens, text, _ = reference[0]
    assert victim.token_ids == tokens[: len(victim.token_ids)] and text.startswith(victim.text)
    assert len(victim.token_ids) < len(tokens) and (site == "schedule" or len(victim.token_ids) == SKIP)
    unfinished = [r for r in others if r.finished is None]
    assert unfinished, "the others were still streaming as it failed"
    for run in others:
        await run.done()
    assert [(r.token_ids, r.text, r.finished.finish_reason) for r in others] == reference[1:]
    assert faulty.system.pids()["engine"] == engine  # (the same process: no restart)
    await assert_idle(faulty)
    after = start(faulty, VICTIM, GREEDY)  # (the engine serves on)
    assert ((await after.done()).finish_reason, after.token_ids) == ("length", tokens)


class Loop(RequestIntake, WorkerRecovery, StepReports):
    """The scheduler actor's intake, recovery and reports around a harness's scheduler, its step loop synchronous;
    `told`: what it sends the detokenizer. The first step with a row of `lose`'s is lost by the worker (it died)."""

    def __init__(self, max_step_failures: int = 3):
        self.h = Harness(max_model_len=64)
        self.sched, self.intake, self.names, self.flight = self.h.sched, IntakeLedger(), SentNames(), self
        self.config = types.SimpleNamespace(replica=replica(0), max_step_failures=max_step_failures)
        self.model = types.SimpleNamespace(bos_token_id=1, vocab_size=VOCAB)
        self.max_model_len, self.admitting, self._record, self.proposer = 64, True, None, None
        self.duplicates = self.late_aborts = self.worker_resets = self.epoch = self.seq = 0
        self.freed, self.told, self.lose, self.idle = [], [], None, False
        self._work = asyncio.Event()
        self.link = types.SimpleNamespace(lost=lambda *_: None, ready=lambda: asyncio.sleep(0))

    def admit(self, req):  # (the flight record's: no blame)
        return None

    def tell(self, to, msg):
        self.told.append(msg)

    async def turn(self) -> bool:
        """One turn of the step loop: a step, or (going idle, or woken idle) the idle marker; whether it moved."""
        batch = self.sched.schedule()
        if batch.rows:
            sampled, emitted = self.h.model.execute(batch)
            if any(row.request_id == self.lose for row in batch.rows):
                self.lose = None
                await self._worker_lost(collections.deque([(batch, None, None, 0)]), WorkerLost("died", DIED))
            else:
                await self._postprocess(batch, StepResult(epoch=0, seq=0, step=batch.step, sampled=sampled,
                                                          num_emitted=emitted))  # fmt: skip
        elif self.sched.has_unfinished():
            return True
        elif self.idle and not self._work.is_set():  # (idle, and nothing woke it)
            return False
        else:
            self._idle_marker()
        self.idle = not batch.rows
        self._work.clear()
        return True


async def converse(loop: Loop, detok: DetokenizerActor, victim: str, join: dict[int, AddRequest]) -> None:
    """Turn the loop and carry messages both ways by hand until neither side moves, losing the first StepOutputs
    with an error entry of `victim`'s; `join`: turn -> a request arriving then."""
    lost, carried = False, 0
    handlers = {AddRequest: detok.on_add, StepOutputs: detok.on_step, AbortAck: detok.on_ack}
    for turn in range(500):
        moved = await loop.turn()
        if turn in join:
            loop.on_add(join[turn])
        told, loop.told = loop.told, []
        for msg in told:
            if (
                not lost
                and isinstance(msg, StepOutputs)
                and any(o.request_id == victim and o.error for o in msg.outputs)
            ):
                lost = True  # (the link loses it)
            else:
                handlers[type(msg)](msg)
        back, carried = [m for dst, m in detok.sent[carried:] if dst == SCHEDULER], len(detok.sent)
        for msg in back:
            (loop.on_add if isinstance(msg, AddRequest) else loop.on_abort)(msg)
        if not (moved or told or back or turn < max(join)):
            break
    assert lost and not (detok.live or detok.tombstones), "the victim's error was lost, and every request closed"


@pytest.mark.parametrize("how", ["planning", "refused", "poison"])
async def test_an_error_made_outside_a_step_is_repaired_when_its_message_is_lost(model_dir, how):  # noqa: F811
    """The victim's error is made outside a step's results (its planning raises; the intake refuses it; recovery fails
    it, a poison) and the message holding it is lost: the detokenizer sees the gap and re-submits it, and its client
    is answered once: the error again, or (the poison's copy carries no blame) its whole output; the others exactly."""
    loop = Loop(max_step_failures=2)
    detok = DetokenizerActor(str(model_dir), stats_to=["client"])
    detok.sent, detok.tell = [], lambda dst, msg: detok.sent.append((dst, msg))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    reqs = {f"r{i}": p for i, p in enumerate(prompts(3, seed=5, hi=12))}
    victim = [VOCAB + 1] if how == "refused" else [3, 1, 4, 1, 5]  # (refused: a token outside the vocabulary)
    join = {0: AddRequest(request_id="r0", prompt_token_ids=reqs["r0"], params=params, client="client"),
            3: AddRequest(request_id="victim", prompt_token_ids=victim, params=params, client="client"),
            4: AddRequest(request_id="r1", prompt_token_ids=reqs["r1"], params=params, client="client"),
            6: AddRequest(request_id="r2", prompt_token_ids=reqs["r2"], params=params, client="client")}  # fmt: skip
    if how == "planning":
        loop.sched.fault = FaultInjector(FaultPlan(rules=[FaultRule(action="raise", request="victim", skip=2)])).check
    if how == "poison":  # blamed once before (it runs in steps of its own): a worker death in its next step fails it
        loop.flight = types.SimpleNamespace(admit=lambda req: setattr(req, "failed_steps", 1))
        loop.lose = "victim"
    await converse(loop, detok, "victim", join)
    got = collections.defaultdict(list)
    for msg in (m for dst, m in detok.sent if dst == "client" and isinstance(m, TextOutputs)):
        for part in (*msg.deltas, *msg.finished):
            got[part.request_id].append(part)
    ends = {}
    for rid, parts in got.items():
        (ends[rid],) = [p for p in parts if isinstance(p, Finished)]  # (exactly one each)
        tokens = [t for p in parts for t in p.token_ids]
        want, _ = expected(victim if rid == "victim" else reqs[rid], params, 64)
        assert tokens == (want[: len(tokens)] if ends[rid].finish_reason == "error" else want), rid
    outcome = {"planning": ("error", "internal"), "refused": ("error", "invalid"), "poison": ("length", "internal")}
    assert {rid: (e.finish_reason, e.error_kind) for rid, e in ends.items()} == {
        **dict.fromkeys(reqs, ("length", "internal")),
        "victim": outcome[how],
    }

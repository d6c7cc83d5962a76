"""A terminal output made outside a step's results waits for no worker restart (actors/engine/step_outputs.py): a
request the intake refuses while the worker restarts (its `ready()` held) is answered before the worker is up; one
refused while a step is in flight goes first in that step's StepOutputs; one refused with none in flight goes at once
under a number of its own. The numbers the detokenizer sees stay 0, 1, 2, ... (no duplicate, no gap), and nothing
of a refused request follows its terminal output. The scheduler actor's intake, recovery and reports around a
scheduler harness (tests/test_request_failure.py's `Loop`)."""

from __future__ import annotations

import asyncio
import collections

import pytest

from actors.engine.worker_link import DIED, WorkerLost
from messages.sampling_params import SamplingParams
from messages.step import StepResult
from messages.wire import AddRequest, StepOutputs
from tests.scheduler_harness import VOCAB, expected
from tests.test_request_failure import Loop

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPT = [3, 1, 4, 1, 5]


class HeldLink:
    """A worker link whose restart is held until `up` is set; `waiting` is set once recovery waits for it."""

    def __init__(self):
        self.waiting, self.up = asyncio.Event(), asyncio.Event()

    def lost(self, *_) -> None:
        pass

    async def ready(self) -> None:
        self.waiting.set()
        await self.up.wait()


def add(loop: Loop, rid: str, prompt: list[int]) -> None:
    loop.on_add(AddRequest(request_id=rid, prompt_token_ids=prompt, params=PARAMS, client="client"))


def refused(loop: Loop, victim: str = "victim") -> None:
    add(loop, victim, [VOCAB + 1])  # (a token outside the vocabulary: the client's 400, naming "prompt")


def reports(loop: Loop) -> list[StepOutputs]:
    return [m for m in loop.told if isinstance(m, StepOutputs)]


def terminal(loop: Loop, rid: str) -> list[tuple[int, str | None]]:
    """The (StepOutputs number, error kind) of each output of `rid` told so far."""
    return [(m.step, o.error_kind) for m in reports(loop) for o in m.outputs if o.request_id == rid]


async def finish(loop: Loop) -> None:
    """Turn the loop until it is idle; then every number was told once, in order, and r0 answered exactly."""
    for _ in range(100):
        if not await loop.turn():
            break
    assert [m.step for m in reports(loop)] == list(range(len(reports(loop))))
    tokens = [t for m in reports(loop) for o in m.outputs if o.request_id == "r0" for t in o.new_token_ids]
    assert tokens == expected(PROMPT, PARAMS, 64)[0]


@pytest.mark.parametrize("shutting_down", [False, True])
async def test_a_request_refused_while_the_worker_restarts_is_answered_before_it_is_up(shutting_down):
    loop = Loop()
    loop.link = link = HeldLink()
    add(loop, "r0", PROMPT)
    batch = loop.sched.schedule()  # r0's first step: the worker dies in it
    restart = asyncio.create_task(
        loop._worker_lost(collections.deque([(batch, None, None, 0)]), WorkerLost("died", DIED))
    )
    await link.waiting.wait()
    assert [m.step for m in reports(loop)] == [0]  # (the step dropped keeps its number)
    loop.admitting = not shutting_down
    refused(loop)
    kind = "unavailable" if shutting_down else "invalid"
    assert terminal(loop, "victim") == [(1, kind)] and not link.up.is_set()  # (at once, the worker still down)
    (registered,) = [i for i, m in enumerate(loop.told) if isinstance(m, AddRequest) and m.request_id == "victim"]
    assert registered < loop.told.index(reports(loop)[-1])  # (its registration first: FIFO on one link)
    loop.admitting = True
    link.up.set()
    await restart
    await finish(loop)
    assert terminal(loop, "victim") == [(1, kind)]  # (exactly one terminal output, nothing after it)


async def test_a_refusal_goes_with_the_step_in_flight_or_at_once_when_none_is():
    loop = Loop()
    add(loop, "r0", PROMPT)
    batch = loop.sched.schedule()  # step 0, in flight (planned, not yet postprocessed)
    refused(loop, "during")
    assert terminal(loop, "during") == []  # (its number would come before step 0's report: it waits for it)
    sampled, emitted = loop.h.model.execute(batch)
    await loop._postprocess(batch, StepResult(epoch=0, seq=0, step=batch.step, sampled=sampled, num_emitted=emitted))
    (first,) = reports(loop)
    assert first.step == 0 and first.outputs[0].request_id == "during"  # (first in the step's StepOutputs)
    refused(loop, "between")  # (no step in flight: at once, numbered 1; the next step is 2)
    assert terminal(loop, "between") == [(1, "invalid")]
    await finish(loop)
    assert terminal(loop, "during") == [(0, "invalid")] and terminal(loop, "between") == [(1, "invalid")]

"""Copies of a request (AddRequest.attempt, DESIGN I8) through the real engine and detokenizer processes, sent by
hand in the orders a lossy or reordering link produces: which copy runs, which copy an Abort ends, and what the
client of an aborted request is told when it re-submits it."""

from __future__ import annotations

import asyncio

import msgspec

from messages.names import CLIENT, SCHEDULER
from messages.sampling_params import SamplingParams
from messages.wire import Abort, AddRequest, Finished
from tests.cancel_harness import (
    assert_idle,
    clean_llm,  # noqa: F401 (a fixture)
    model_dir,  # noqa: F401 (a fixture)
    start,
)


async def test_a_copy_of_an_aborted_request_is_told_its_abort_again(clean_llm):  # noqa: F811
    """A client that lost the Finished(abort) of a request it aborted re-submits it (a resumed copy): the
    detokenizer answers Finished(abort) again, keeping no state, and the engine never runs the copy."""
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    run = start(clean_llm, [5, 6], params)
    await run.wait_tokens(2)
    clean_llm.abort(run.request_id)
    assert (await run.done()).finish_reason == "abort"
    await assert_idle(clean_llm)
    engine0, _ = await clean_llm.fresh_stats()
    copy = AddRequest(request_id=run.request_id, prompt_token_ids=[5, 6], params=params, client=CLIENT)
    stream = clean_llm.client.add(msgspec.structs.replace(copy, resume_token_ids=[], attempt=1))
    fin = await asyncio.wait_for(stream.queue.get(), 20)
    assert (fin.finish_reason, fin.stop_reason, fin.attempt) == ("abort", "client", 1)
    await assert_idle(clean_llm)
    engine1, _ = await clean_llm.fresh_stats()
    assert engine1.generation_tokens_total == engine0.generation_tokens_total


async def test_the_scheduler_runs_only_the_highest_copy_and_ignores_an_unknown_ids_stop(clean_llm):  # noqa: F811
    """A client's copy (attempt 3) and the detokenizer's made at once (attempt 2) arrive in either order: only the
    higher runs, and the detokenizer's arriving after it ended is dropped too; a client's lower copy arriving once
    none runs does run, numbered as the newest copy (its client lost the higher copy's end, or never saw it). An Abort(stop) for an id the
    scheduler does not know (an earlier incarnation's: a stop is found in output) is not taken for an early abort
    of a copy that comes later: that copy runs."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine0, _ = await clean_llm.fresh_stats()
    first = AddRequest(request_id=clean_llm.new_id(), prompt_token_ids=[5, 6], params=params, client=CLIENT)
    stream = clean_llm.client.add(msgspec.structs.replace(first, resume_token_ids=[], attempt=3))
    clean_llm.client.tell(SCHEDULER, msgspec.structs.replace(first, resume_token_ids=[], attempt=2))
    second = msgspec.structs.replace(first, request_id=clean_llm.new_id(), resume_token_ids=[], attempt=1)
    clean_llm.client.tell(SCHEDULER, Abort(request_id=second.request_id, reason="stop"))
    other = clean_llm.client.add(second)
    for s, attempt in ((stream, 3), (other, 1)):
        await ends_after(s, 6, attempt)
    clean_llm.client.tell(SCHEDULER, msgspec.structs.replace(first, resume_token_ids=[], attempt=2))  # late
    lower = msgspec.structs.replace(first, resume_token_ids=[], attempt=1)
    await ends_after(clean_llm.client.add(lower), 6, 5)  # run as the newest copy: the next odd number above 3
    await assert_idle(clean_llm)
    engine1, _ = await clean_llm.fresh_stats()
    assert engine1.generation_tokens_total - engine0.generation_tokens_total == 6 * 3, "each copy that runs ran once"


async def test_an_abort_of_an_older_copy_leaves_the_newer_one_running(clean_llm):  # noqa: F811
    """The detokenizer's Abort(stop) names the copy whose output held the stop string; sent again or late, it finds
    a newer copy (its client, which lost that Finished, re-submitted the request) and is ignored: the copy runs
    to its end (it was taken for the newer copy's abort: a Finished(abort) nobody asked for, in a chaos run)."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine0, _ = await clean_llm.fresh_stats()
    first = AddRequest(request_id=clean_llm.new_id(), prompt_token_ids=[5, 6], params=params, client=CLIENT)
    stream = clean_llm.client.add(msgspec.structs.replace(first, resume_token_ids=[], attempt=1))
    clean_llm.client.tell(SCHEDULER, Abort(request_id=first.request_id, reason="stop", attempt=0))
    await ends_after(stream, 6, 1)
    await assert_idle(clean_llm)
    engine1, _ = await clean_llm.fresh_stats()
    assert engine1.late_aborts_total - engine0.late_aborts_total == 1


async def ends_after(stream, num_tokens: int, attempt: int) -> None:
    """The stream gets only copy `attempt`'s outputs, and its Finished after `num_tokens` tokens."""
    while (item := await asyncio.wait_for(stream.queue.get(), 20)) and not isinstance(item, Finished):
        assert item.attempt == attempt
    assert (item.finish_reason, item.num_output_tokens, item.attempt) == ("length", num_tokens, attempt)

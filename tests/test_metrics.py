"""/metrics end to end: the engine's per-request observations reach the HTTP actor's histograms."""

from __future__ import annotations

import asyncio

QUEUE_COUNT = ("sluice:request_queue_time_seconds_count", ())
QUEUE_SUM = ("sluice:request_queue_time_seconds_sum", ())


async def test_queue_time_is_observed_for_each_engine_request(server):
    before = await server.metrics()
    out = await server.client().completions.create(model=None, prompt="Hello", max_tokens=2, n=2)
    assert len(out.choices) == 2
    # n = 2: two engine requests, each observed once (earlier tests' requests may still be reported: at least)
    deadline = asyncio.get_running_loop().time() + 30
    while (got := await server.metrics())[QUEUE_COUNT] < before[QUEUE_COUNT] + 2:
        assert asyncio.get_running_loop().time() < deadline, "the queue-time histogram got no observations"
        await asyncio.sleep(0.05)
    assert got[QUEUE_SUM] >= before[QUEUE_SUM]

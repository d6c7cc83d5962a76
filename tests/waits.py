"""Waiting in tests for what only a poll can see: a client's view of a server (its /metrics, its idle reports, a
background response's state) or of state another process owns. One loop, with a deadline: `eventually(probe)` is the
first truthy result of `probe()` (awaited when it is a coroutine), asked every `every` seconds; past `timeout` the test
fails, saying what it waited for and what it saw last. Anything a test can wait on as an event (an actor's `until`, a
fault plan's gate, a stream's next message) it waits on that way instead."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any


async def eventually(probe: Callable[[], Any], what: str, timeout: float = 30.0, every: float = 0.02) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        got = probe()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        assert loop.time() < deadline, f"{what}: not reached in {timeout:g} s (last seen: {got!r})"
        await asyncio.sleep(every)

"""A canary stream: one streamed completion whose output must come through any hostile traffic
exactly as it does undisturbed.

Its output is robust to batch numerics (CPU matmuls are not batch-invariant, so plain greedy output
may flip on a near-tie when other requests share the batch): sampling is confined to 16 tokens
whose logit biases differ by 0.37 and a frequency penalty of 2 rotates them, so the winner leads
by a wide margin at every step. What it checks is the path: every token arrives, once, in order,
with its text, to a natural end.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import aiohttp

TOKENS = list(range(1000, 1016))
BODY = {
    "prompt": [1000, 1001, 1002],
    "max_tokens": 200,
    "temperature": 0,
    "ignore_eos": True,
    "allowed_token_ids": TOKENS,
    "logit_bias": {str(t): 10 - 0.37 * k for k, t in enumerate(TOKENS)},
    "frequency_penalty": 2.0,
    "stream": True,
    "stream_options": {"include_usage": True},
}


@dataclass(frozen=True)
class Outcome:
    text: str
    finish_reason: str | None
    completion_tokens: int | None


@dataclass
class Canary:
    """`start()` it, await `started` (its first token arrived), then await `task` for its Outcome.
    `gaps` holds the time between its SSE events (the inter-token gaps a client sees)."""

    url: str
    started: asyncio.Event = field(default_factory=asyncio.Event)
    gaps: list[float] = field(default_factory=list)
    task: asyncio.Task | None = None

    def start(self) -> Canary:
        self.task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> Outcome:
        loop = asyncio.get_running_loop()
        text, finish, usage, last = [], None, None, None
        async with aiohttp.ClientSession() as s, s.post(f"{self.url}/v1/completions", json=BODY) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                now = loop.time()
                if last is not None:
                    self.gaps.append(now - last)
                last = now
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for choice in chunk["choices"]:
                    text.append(choice["text"])
                    finish = choice["finish_reason"] or finish
                usage = chunk.get("usage") or usage
                self.started.set()
        return Outcome("".join(text), finish, usage and usage["completion_tokens"])


async def undisturbed(url: str) -> Outcome:
    return await Canary(url).start().task

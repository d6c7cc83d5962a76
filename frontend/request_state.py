"""Per-request state of the HTTP actor: an HttpRequest per HTTP call, a Choice per engine request.

A slow client never grows a queue: a choice's undelivered outputs are one coalesced buffer (text,
token ids, logprobs), taken whole by the writer when it catches up.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from actors.client_ledger import RequestRecord
from frontend.protocol import ParsedRequest, RequestError
from frontend.tool_parser import ToolCallParser
from messages.sampling_params import child_seed
from messages.wire import AddRequest, Finished, TokenLogprobs


class Choice:
    __slots__ = (
        "engine_id", "final_sent", "finished", "index", "last_output", "logprobs", "reasoning", "record", "request",
        "started", "text", "text_offset", "token_ids", "tools", "unwoken",
    )  # fmt: skip

    def __init__(self, request: HttpRequest, index: int, prefix: str | None):
        self.request = request
        self.index = index
        self.engine_id = f"{request.parsed.request_id}-{index}"
        self.text: list[str] = [prefix] if prefix else []  # not yet written (echo: the prompt first)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.record: RequestRecord | None = None  # set as its AddRequest is sent (ClientLedger.submit)
        self.finished: Finished | None = None
        self.started = False  # streaming: a chunk of it was written
        self.final_sent = False  # streaming: the finish_reason chunk was written
        self.text_offset = 0  # streaming completions logprobs: where the next token's text starts
        self.last_output = 0.0
        self.unwoken = 0  # tokens received since this choice last woke its request's writer (--stream-interval)
        self.tools = ToolCallParser() if request.parsed.tool_calls and request.parsed.stream else None
        split = request.parsed.reasoning
        self.reasoning = split.parser() if split is not None and request.parsed.stream else None  # (before tools)

    @property
    def num_tokens(self) -> int:
        """Tokens received: the next delta's seq."""
        return self.record.num_tokens

    @property
    def num_output_tokens(self) -> int:
        """Output tokens so far: those received, all of them once finished (continuous usage stats)."""
        return self.finished.num_output_tokens if self.finished is not None else self.num_tokens

    def append(self, text: str, token_ids: list[int], logprobs: TokenLogprobs | None) -> None:
        if text:
            self.text.append(text)
        self.token_ids += token_ids
        if logprobs is not None:
            self.logprobs.append(logprobs)

    def take(self) -> tuple[str, list[int], list[TokenLogprobs]]:
        """Everything buffered since the last take, coalesced."""
        out = "".join(self.text), self.token_ids, self.logprobs
        self.text, self.token_ids, self.logprobs = [], [], []
        return out


class HttpRequest:
    def __init__(self, parsed: ParsedRequest):
        self.parsed = parsed
        self.arrival = time.monotonic()
        self.wake = asyncio.Event()  # set on every change the writer must see
        self.error: RequestError | None = None
        self.first_output: float | None = None
        prefixes = [p.text if parsed.echo else None for p in parsed.prompts for _ in range(parsed.n)]
        self.choices = [Choice(self, i, prefix) for i, prefix in enumerate(prefixes)]
        self.num_live = len(self.choices)

    @property
    def id(self) -> str:
        return self.parsed.request_id

    @property
    def done(self) -> bool:
        return self.num_live == 0

    def engine_requests(self, client: str) -> list[AddRequest]:
        """One per choice: n > 1 fans out into n = 1 requests, a seed into distinct derived seeds."""
        now, n, out = time.time(), self.parsed.n, []
        for c in self.choices:
            prompt = self.parsed.prompts[c.index // n]
            seed, beam = prompt.params.seed, prompt.params.beam
            if beam is not None:  # the prompt's choices share one search: each is answered with its rank's beam
                beam = msgspec.structs.replace(beam, group=f"{self.parsed.request_id}/{c.index // n}", rank=c.index % n)
            params = msgspec.structs.replace(
                prompt.params, n=1, seed=None if seed is None else child_seed(seed, c.index % n), beam=beam
            )
            out.append(
                AddRequest(
                    request_id=c.engine_id,
                    prompt_token_ids=prompt.token_ids,
                    params=params,
                    arrival_time=now,
                    client=client,
                )
            )
        return out

    def siblings(self, c: Choice) -> list[Choice]:
        """The n choices sampled from c's prompt, c among them."""
        first = c.index - c.index % self.parsed.n
        return self.choices[first : first + self.parsed.n]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.parsed.prompts)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache, per prompt (its first choice's: the others share its prompt)."""
        n = self.parsed.n
        return sum(c.finished.num_cached_tokens for c in self.choices[::n] if c.finished is not None)

    @property
    def num_output_tokens(self) -> int:
        return sum(c.finished.num_output_tokens for c in self.choices if c.finished is not None)

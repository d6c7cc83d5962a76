"""The HTTP actor's request table: one HttpRequest per HTTP call, one Choice per engine request.

Choice states (DESIGN section 3, the HTTP party), state x event -> action:
  LIVE        TextDelta in seq order  -> buffered, the request's writer woken (never awaited here)
  LIVE        TextDelta already seen  -> duplicate: dropped, counted (protocol violation "duplicate")
  LIVE        TextDelta/Finished gap  -> the request fails (500); its live choices are TOMBSTONED
  LIVE        Finished                -> buffered with its finish reason: CLOSED
  LIVE        client gone, failure    -> Abort to the scheduler: TOMBSTONED
  TOMBSTONED  TextDelta               -> stale: dropped, counted
  TOMBSTONED  Finished                -> CLOSED
  TOMBSTONED  no Finished in time     -> Abort re-sent; after max_abort_tries dropped with an error (I7)
  unknown     TextDelta / Finished    -> protocol violation "unknown_id": logged, counted, dropped
  any         scheduler down          -> live requests fail (503); their ids become tombstones, closed by
                                         the detokenizer's Finished(error) (no Abort: the engine is gone)
  any         detokenizer down        -> live requests fail (503); tombstones cleared (nobody can close them)
A slow client never grows a queue: a choice's undelivered outputs are one coalesced buffer, written
as one event per choice when the writer catches up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from frontend.metrics import Metrics
from frontend.protocol import ParsedRequest, PromptInput, RequestError
from messages.wire import Abort, AddRequest, Finished, Msg, TextDelta, TextOutputs, TokenLogprobs

log = logging.getLogger("sluice.http")

SCHEDULER = "scheduler"


def child_seed(seed: int, index: int) -> int:
    """gpu.sampling.child_seed, without importing torch into the HTTP process (a test pins them equal)."""
    return (seed + index + (1 << 63)) % (1 << 64) - (1 << 63)


class Choice:
    __slots__ = (
        "engine_id", "final_sent", "finished", "index", "last_output", "live", "logprobs", "num_tokens", "request",
        "text", "text_offset", "token_ids",
    )  # fmt: skip

    def __init__(self, request: HttpRequest, index: int, prefix: str | None):
        self.request = request
        self.index = index
        self.engine_id = f"{request.parsed.request_id}-{index}"
        self.text: list[str] = [prefix] if prefix else []  # not yet written (echo: the prompt first)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.num_tokens = 0  # tokens received: the next delta's seq
        self.finished: Finished | None = None
        self.live = True
        self.final_sent = False  # streaming: the finish_reason chunk was written
        self.text_offset = 0  # streaming completions logprobs: where the next token's text starts
        self.last_output = 0.0

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

    def prompt(self, choice: Choice) -> PromptInput:
        return self.parsed.prompts[choice.index // self.parsed.n]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.parsed.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(c.finished.num_output_tokens for c in self.choices if c.finished is not None)


@dataclass(slots=True)
class Tombstone:
    reason: str
    since: float
    tries: int


class RequestTable:
    def __init__(
        self,
        tell: Callable[[str, Msg], None],
        metrics: Metrics,
        abort_timeout_s: float = 5.0,
        max_abort_tries: int = 3,
    ):
        self.tell = tell
        self.metrics = metrics
        self.abort_timeout_s = abort_timeout_s
        self.max_abort_tries = max_abort_tries
        self.live: dict[str, Choice] = {}  # engine request id -> choice
        self.tombstones: dict[str, Tombstone] = {}
        metrics.num_tombstones = lambda: len(self.tombstones)

    def add(self, parsed: ParsedRequest, client: str) -> HttpRequest:
        """Register the request and send one AddRequest per choice (n > 1 fans out, seeds derived);
        `client` is the actor the engine sends the text to."""
        req, now = HttpRequest(parsed), time.time()
        for c in req.choices:
            prompt = req.prompt(c)
            seed = prompt.params.seed
            if seed is not None:
                seed = child_seed(seed, c.index % parsed.n)
            params = msgspec.structs.replace(prompt.params, n=1, seed=seed)
            self.live[c.engine_id] = c
            self.tell(
                SCHEDULER,
                AddRequest(
                    request_id=c.engine_id,
                    prompt_token_ids=prompt.token_ids,
                    params=params,
                    arrival_time=now,
                    client=client,
                ),
            )
        return req

    # ------------------------------------------------------------ engine outputs

    def on_outputs(self, msg: TextOutputs) -> None:
        now = time.monotonic()
        for delta in msg.deltas:
            self._on_delta(delta, now)
        for fin in msg.finished:
            self.on_finished(fin)

    def _on_delta(self, delta: TextDelta, now: float) -> None:
        c = self.live.get(delta.request_id)
        if c is None:
            self._not_live(delta.request_id, f"TextDelta seq {delta.seq}", terminal=False)
        elif delta.seq != c.num_tokens:
            if delta.seq + len(delta.token_ids) <= c.num_tokens:
                self._violation("duplicate", c.engine_id, f"TextDelta seq {delta.seq} (expected {c.num_tokens})")
            else:
                self._gap(c, f"TextDelta seq {delta.seq}, expected {c.num_tokens}")
        else:
            c.num_tokens += len(delta.token_ids)
            c.append(delta.text, delta.token_ids, delta.logprobs)
            self._observe_output(c, now)
            c.request.wake.set()

    def on_finished(self, fin: Finished) -> None:
        rid = fin.request_id
        c = self.live.get(rid)
        if c is None:
            self._not_live(rid, f"Finished({fin.finish_reason})", terminal=True)
            return
        seen = c.num_tokens + len(fin.token_ids)
        if fin.finish_reason != "error" and fin.num_output_tokens != seen:  # a lost delta: fail, never corrupt
            what = f"Finished after {fin.num_output_tokens} tokens, {seen} received"
            self._violation("gap", rid, what)
            fin = Finished(request_id=rid, finish_reason="error", error=f"request {rid}: lost output ({what})")
        c.append(fin.text, fin.token_ids, fin.logprobs)
        c.finished = fin
        now = time.monotonic()
        if fin.token_ids:
            self._observe_output(c, now)
        self.metrics.e2e.observe(now - c.request.arrival)
        self._close(c, fin.finish_reason)
        if fin.finish_reason == "error":
            log.warning("[%s] failed in the engine: %s", rid, fin.error)
            self.fail(c.request, RequestError(500, fin.error or "the engine failed the request"))

    def _observe_output(self, c: Choice, now: float) -> None:
        req = c.request
        if req.first_output is None:
            req.first_output = now
            self.metrics.ttft.observe(now - req.arrival)
        elif c.last_output:
            self.metrics.itl.observe(now - c.last_output)
        c.last_output = now

    def _not_live(self, rid: str, what: str, terminal: bool) -> None:
        if rid in self.tombstones:
            if terminal:
                del self.tombstones[rid]
                log.debug("[%s] tombstone closed by %s", rid, what)
            else:
                self.metrics.stale_dropped += 1
        else:
            self._violation("unknown_id", rid, f"{what} for an id neither live nor tombstoned")

    def _violation(self, kind: str, rid: str, what: str) -> None:
        self.metrics.violations[kind] += 1
        log.warning("[%s] protocol violation (%s): %s; dropped", rid, kind, what)

    def _gap(self, c: Choice, what: str) -> None:
        self._violation("gap", c.engine_id, what)
        self.fail(c.request, RequestError(500, f"request {c.engine_id}: lost output ({what})"))

    # ------------------------------------------------------------ ending requests

    def _close(self, c: Choice, reason: str) -> None:
        del self.live[c.engine_id]
        c.live = False
        c.request.num_live -= 1
        c.request.wake.set()
        self.metrics.request_success.labels(reason).inc()

    def _tombstone(self, c: Choice, reason: str, send_abort: bool = True) -> None:
        self._close(c, "abort")
        # without an Abort (the engine is gone) one timeout passes, then the tombstone is dropped
        self.tombstones[c.engine_id] = Tombstone(reason, time.monotonic(), 1 if send_abort else self.max_abort_tries)
        if send_abort:
            self.metrics.aborts.labels(reason).inc()
            self.tell(SCHEDULER, Abort(request_id=c.engine_id, reason=reason))

    def cancel(self, req: HttpRequest, reason: str = "client") -> None:
        """The client is gone: tombstone every live choice and abort it in the engine."""
        live = [c for c in req.choices if c.live]
        if live:
            log.info("[%s] %s: aborting %d choices", req.id, reason, len(live))
        for c in live:
            self._tombstone(c, reason)

    def fail(self, req: HttpRequest, error: RequestError, send_abort: bool = True) -> None:
        """End the request with an error; its other live choices are aborted."""
        if req.error is None:
            req.error = error
        for c in req.choices:
            if c.live:
                self._tombstone(c, "error", send_abort)
        req.wake.set()

    def abort_all(self, reason: str) -> None:
        """Shutdown: ask the engine to abort everything; choices stay LIVE until their Finished."""
        for rid in self.live:
            self.metrics.aborts.labels(reason).inc()
            self.tell(SCHEDULER, Abort(request_id=rid, reason=reason))

    def fail_all(self, error: RequestError, send_abort: bool) -> None:
        """Every live request fails now (an actor on the request path died, or the drain timed out)."""
        for req in dict.fromkeys(c.request for c in self.live.values()):
            log.warning("[%s] failed: %s", req.id, error.message)
            self.fail(req, error, send_abort)

    def expire(self, now: float) -> None:
        """I7: re-send an Abort that got no Finished in time; give up after max_abort_tries."""
        for rid, t in list(self.tombstones.items()):
            if now - t.since < self.abort_timeout_s:
                continue
            if t.tries >= self.max_abort_tries:
                log.error("[%s] no Finished after %d aborts; tombstone dropped", rid, t.tries)
                del self.tombstones[rid]
            else:
                t.tries, t.since = t.tries + 1, now
                self.tell(SCHEDULER, Abort(request_id=rid, reason=t.reason))

"""The HTTP actor's ledger of pooling requests (issue 52): each sent to the pooling engine (actors/pooler) and
awaited by its handler (frontend/embeddings.py, frontend/scoring.py), whatever happens to the engine meanwhile.

Cases (state x event):
  pending  PoolOutput of its copy          -> answered (an error: a 500 naming it); another copy's: stale, dropped
  pending  handler cancelled (client gone) -> Abort to the engine, forgotten (a later PoolOutput / AbortAck: dropped)
  pending  ActorDown(engine), restarting at once -> kept; ActorUp(engine) -> sent again as the next copy
  pending  ActorDown(engine) with a back-off -> failed now (503)
  pending  Shutdown                        -> Abort(shutdown); AbortAck -> 503, or its PoolOutput as it came
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import numpy as np

from frontend.body import RequestError
from messages.names import SCHEDULER
from messages.pooling import PoolOutput, PoolRequest
from messages.wire import Abort, AbortAck, ActorDown, ActorUp

log = logging.getLogger("sluice.http")
ENGINE_ENDED = ("aborted", "the engine keeps")  # an error's start when the engine ended the request (a 503)


class Pending(msgspec.Struct):
    msg: PoolRequest
    answer: asyncio.Future


class PoolFacts(msgspec.Struct, kw_only=True):
    """What the front knows of the pooling model (frontend/preflight.py's pooling_processes)."""

    dimensions: list[int] = []  # matryoshka sizes an embedding may be cut to ([]: none)
    labels: list[str] = []  # a cross-encoder's labels ([]: an embedder)
    score_sigmoid: bool = False  # a cross-encoder's score is sigmoid(logit)


class PoolLedger:
    def __init__(self, http, facts: dict) -> None:
        """`http`: the HttpActor (tell, moved); `facts`: PoolFacts' fields."""
        self.http, self.facts = http, msgspec.convert(facts, PoolFacts)
        self.pending: dict[str, Pending] = {}

    def handlers(self) -> dict:
        return {PoolOutput: self.on_output, AbortAck: self.on_ack}

    def on_output(self, msg: PoolOutput) -> None:
        p = self.pending.get(msg.request_id)
        if p is not None and p.msg.attempt == msg.attempt and not p.answer.done():
            p.answer.set_result(msg)

    def on_ack(self, msg: AbortAck) -> None:
        self.on_output(PoolOutput(request_id=msg.request_id, attempt=msg.attempt, error=f"aborted ({msg.reason})"))

    def on_down(self, msg: ActorDown) -> None:
        if msg.actor == SCHEDULER and msg.retry_in_s > 0:
            for rid in list(self.pending):
                self.on_output(PoolOutput(request_id=rid, attempt=self.pending[rid].msg.attempt,
                                          error=f"the engine keeps failing: restarting in {msg.retry_in_s:.0f} s"))  # fmt: skip

    def on_up(self, msg: ActorUp) -> None:
        if msg.actor == SCHEDULER:
            for p in self.pending.values():  # (what it held is gone: each is sent again, as the next copy)
                p.msg = msgspec.structs.replace(p.msg, attempt=p.msg.attempt + 1)
                self.http.tell(SCHEDULER, p.msg)

    def abort_all(self, reason: str) -> None:
        for p in self.pending.values():
            self.http.tell(SCHEDULER, Abort(request_id=p.msg.request_id, reason=reason))

    def fail_all(self, why: str) -> None:
        """Every request still pending answered now (a 503): the engine said nothing in time."""
        for p in self.pending.values():
            if not p.answer.done():
                p.answer.set_result(PoolOutput(request_id=p.msg.request_id, attempt=p.msg.attempt, error=why))

    async def run(self, msg: PoolRequest, arrival: float) -> np.ndarray:
        """The engine's rows for `msg` ([inputs, dim] float32), or a RequestError (503 if the engine ended it);
        `arrival`: the request's (time.monotonic()), for its latency."""
        self.http.check_available()  # (again: tokenizing took a while; then it is pending before the next message)
        self.pending[msg.request_id] = p = Pending(msg, asyncio.get_running_loop().create_future())
        msg.client = self.http.name  # (the HTTP server it came to: --api-server-count)
        self.http.tell(SCHEDULER, msg)
        out: PoolOutput | None = None
        try:
            out = await p.answer
        finally:
            del self.pending[msg.request_id]
            if out is None:  # the client went away (the handler was cancelled, and the future with it)
                self.http.tell(SCHEDULER, Abort(request_id=msg.request_id, reason="client"))
                self.http.metrics.aborts.labels(0, "client").inc()
            self.http.moved()
            self._count(msg, out, time.monotonic() - arrival)
        if out.error is not None:
            status = 503 if out.error.startswith(ENGINE_ENDED) else 500
            raise RequestError(status, f"the engine failed the request: {out.error}")
        return np.frombuffer(out.data, dtype="<f4").reshape(-1, out.dim)

    def _count(self, msg: PoolRequest, out: PoolOutput | None, seconds: float) -> None:
        """vLLM's request series for a pooling request (replica 0: a pooling model has one): finished "stop", or
        "abort" (its client gone, or the engine ended it), or "error"; once it ran, its prompt tokens and latency
        (from its arrival)."""
        m = self.http.metrics
        if out is None or (out.error or "").startswith(ENGINE_ENDED):
            reason = "abort"
        else:
            reason = "stop" if out.error is None else "error"
        m.request_success.labels(0, reason).inc()
        if reason == "stop":
            m.prompt_tokens.labels(0).observe(sum(map(len, msg.inputs)))
            m.e2e.labels(0).observe(seconds)

"""A stand-in for the scheduler + detokenizer, run as a local actor in the test process.

It answers AddRequest by sending its client one TextOutputs per step ("w0", " w1", ... one token
each, token id 100 + i) and a Finished(length) in the last one; Abort ends a request with
Finished(abort) (unless `ack_aborts` is off). With `hold` on, requests get no output until the test
drives them (`emit`, `finish`); a resumed AddRequest goes on after its tokens. Tests may send anything to the HTTP actor (`tell`) to inject
protocol faults: duplicates, gaps, unknown ids, stale outputs.
"""

from __future__ import annotations

import asyncio

from actors.runtime import Actor
from messages.lora import LoraRegistered, RegisterLora, UnregisterLora
from messages.wire import Abort, AddRequest, EngineStats, Finished, TextDelta, TextOutputs

CLIENT = "http"


class FakeEngine(Actor):
    name = "scheduler"

    def __init__(self, step_s: float = 0.005, clients: list[str] = (CLIENT,)):
        """`clients`: the HTTP servers its stats go to (a request's output goes to the one its AddRequest names)."""
        super().__init__()
        self.step_s = step_s
        self.clients = clients
        self.client_of: dict[str, str] = {}  # request id -> its AddRequest's client
        self.hold = False
        self.ack_aborts = True
        self.live: dict[str, AddRequest] = {}
        self.sent: dict[str, int] = {}  # request id -> tokens sent
        self.added: list[AddRequest] = []
        self._arrived = asyncio.Event()  # set by each AddRequest (wait_added)
        self.aborts: list[Abort] = []
        self.loras: list[RegisterLora | UnregisterLora] = []
        self._steps = 0
        self._reported = 0  # AddRequests whose queue time went out in EngineStats

    def handlers(self):
        return {AddRequest: self.on_add, Abort: self.on_abort, RegisterLora: self.on_lora, UnregisterLora: self.on_lora}

    async def on_start(self) -> None:
        self.spawn(self._stats())

    async def wait_added(self, i: int, timeout: float = 10.0) -> AddRequest:
        """The i-th AddRequest received (from 0), waited for on each arrival, within `timeout`."""
        async with asyncio.timeout(timeout):
            while len(self.added) <= i:
                self._arrived.clear()
                await self._arrived.wait()
        return self.added[i]

    def on_add(self, msg: AddRequest) -> None:
        self.added.append(msg)
        self._arrived.set()
        self.live[msg.request_id] = msg
        self.client_of[msg.request_id] = msg.client
        self.sent[msg.request_id] = len(msg.resume_token_ids or [])  # a resumed request goes on from there
        if not self.hold:
            self.spawn(self._generate(msg.request_id))

    def on_lora(self, msg: RegisterLora | UnregisterLora) -> LoraRegistered | None:
        """Any adapter is served: its digest is its path's (the HTTP side's bookkeeping is what tests check)."""
        self.loras.append(msg)
        return LoraRegistered(digest=f"digest-{msg.path}") if isinstance(msg, RegisterLora) else None

    def on_abort(self, msg: Abort) -> None:
        self.aborts.append(msg)
        if self.ack_aborts and msg.request_id in self.live:
            self.finish(msg.request_id, "abort")

    async def _generate(self, rid: str) -> None:
        while rid in self.live:
            i = self.sent[rid]
            if i + 1 == self.live[rid].params.max_tokens:
                self.finish(rid, "length", text=f" w{i}", token_ids=[100 + i])
            else:
                self.emit(rid, f" w{i}" if i else "w0", [100 + i])
            await asyncio.sleep(self.step_s)

    # ------------------------------------------------------------ driven by tests

    def emit(
        self, rid: str, text: str, token_ids: list[int], seq: int | None = None, attempt: int | None = None
    ) -> None:
        """A delta of the request's live copy (or of an older copy `attempt`: not counted as sent)."""
        seq = self.sent[rid] if seq is None else seq
        if attempt is None:
            self.sent[rid] = max(self.sent[rid], seq + len(token_ids))
            attempt = self.live[rid].attempt
        self._steps += 1
        delta = TextDelta(request_id=rid, seq=seq, text=text, token_ids=token_ids, attempt=attempt)
        self.tell(self.client_of.get(rid, CLIENT), TextOutputs(step=self._steps, deltas=[delta]))

    def finish(self, rid: str, reason: str, text: str = "", token_ids: list[int] = (), **error) -> None:
        """End the request's live copy (`error`: Finished's error fields)."""
        req = self.live.pop(rid)
        self.sent[rid] += len(token_ids)
        fin = Finished(
            request_id=rid,
            finish_reason=reason,
            text=text,
            token_ids=list(token_ids),
            num_prompt_tokens=len(req.prompt_token_ids),
            num_output_tokens=self.sent[rid],
            attempt=req.attempt,
            **error,
        )
        self._steps += 1
        self.tell(req.client, TextOutputs(step=self._steps, deltas=[], finished=[fin]))

    async def _stats(self) -> None:
        while True:
            stats = EngineStats(
                num_running=len(self.live),
                num_waiting=0,
                kv_usage=0.0,
                prompt_tokens_total=sum(len(r.prompt_token_ids) for r in self.added),
                generation_tokens_total=sum(self.sent.values()),
                late_aborts_total=0,
                queue_times_s=[0.001] * (len(self.added) - self._reported),
            )
            self._reported = len(self.added)
            for client in self.clients:
                self.tell(client, stats)
            await asyncio.sleep(0.1)

"""RequestLedger: the scheduler's requests and their lifecycle, WAITING -> RUNNING <-> PREEMPTED -> FINISHED or
ABORTED, and when what each holds is freed: a finished or aborted request leaves the queues at once, its KV blocks
and slot (and its grammar matcher) once no in-flight step references it (DESIGN I5); an aborted one is then
reported by `drain_aborted()`, the moment its AbortAck may be sent. Which token ends a request (`_ends`: stop
conditions), and whom a request short of KV blocks preempts (`_make_room`: the youngest, never the oldest running
request: the scheduler's progress argument rests on it). The Scheduler (actors/engine/scheduler.py) plans steps over
it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from actors.engine.block_manager import BlockManager
from actors.engine.request import EngineRequest, RequestStatus
from messages.wire import AbortReason, FinishReason, RequestOutput


class RequestLedger:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_model_len: int,
        eos_token_ids: Iterable[int],
        release: Callable[[EngineRequest], None] | None,
    ):
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.release = release  # told each finished request once it is freed (the proposer's and worker's state)
        self.requests: dict[str, EngineRequest] = {}  # every request still holding anything
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []  # in admission order: preemption takes the last
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.aborted_freed: list[EngineRequest] = []
        self.num_preemptions = 0
        self.matchers = 0  # grammar matchers its requests hold (the idle invariant's): counted as added, until freed

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def abort(self, request_id: str, reason: AbortReason | None = "client") -> bool:
        """Stop scheduling the request now (`reason`: its AbortAck's, once freed; None: aborted silently). False for
        an unknown, finished or already aborted id (a late abort): no AbortAck is due for it."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        self._dequeue(req)
        req.status, req.abort_reason = RequestStatus.ABORTED, reason
        self._settle(req)
        return True

    def drain_aborted(self) -> list[EngineRequest]:
        """Aborted requests whose resources are freed since the last call: send their AbortAck."""
        freed, self.aborted_freed = self.aborted_freed, []
        return freed

    def fail(self, req: EngineRequest, error: str) -> RequestOutput:
        """End a request that has no step in flight with finish_reason "error" (a poison request)."""
        req.error = error
        self._finish(req, "error")
        self._settle(req)
        return RequestOutput(
            request_id=req.request_id, seq=req.next_seq, new_token_ids=[], finish_reason="error", error=error,
            attempt=req.attempt,
        )  # fmt: skip

    def forget_device_state(self) -> None:
        """The worker lost its KV cache and relay (call once every step in flight is dropped): every running request is
        preempted (it recomputes its prompt and the tokens it emitted) and the prefix cache is emptied."""
        while self.running:  # the last first: they wait at the front in their running order
            self._preempt(self.running.pop())
        self.block_manager.forget_cache()

    # ---------------------------------------------------------------- internals

    def _ends(self, req: EngineRequest, token: int) -> bool:
        """Finish the request if `token`, just appended, ends it (a grammar ends it once complete; a token its
        grammar refuses is taken back and fails it: the matcher failed, or (a bug) the mask allowed the token)."""
        p = req.params
        if req.grammar is not None and not req.grammar.accept(token):
            req.output_token_ids.pop()
            req.error = req.grammar.error or f"token {token} is not allowed by the request's grammar"
            self._finish(req, "error")
        elif (req.grammar is not None and req.grammar.terminated) or (
            len(req.output_token_ids) > p.min_tokens and token in self.eos_token_ids and not p.ignore_eos
        ):
            self._finish(req, "stop")
        elif len(req.output_token_ids) > p.min_tokens and token in p.stop_token_ids:
            self._finish(req, "stop", token)
        elif len(req.output_token_ids) >= p.max_tokens or req.num_known_tokens + req.overhang >= self.max_model_len:
            self._finish(req, "length")
        return req.is_finished

    def _finish(self, req: EngineRequest, reason: FinishReason, stop_reason: int | None = None) -> None:
        self._dequeue(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason

    def _make_room(self, req: EngineRequest, n: int, m: int) -> bool:
        """Preempt the youngest running requests until `req` may grow by n tokens (its CFG companion by m); whether
        it may grow now. The oldest running request is never preempted for blocks: alone, it waits instead (what it lacks is
        held by requests that ended with a step in flight, and it fits alone: Scheduler.add_request). Any other one
        goes itself once all younger ones are gone: the older ones hold the rest and need it first."""
        while not self.block_manager.may_append(req, n, m):
            if self.running == [req]:
                return False
            victim = self.running.pop()
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: EngineRequest) -> None:
        for seq in req.sequences:
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        self._settle(req)

    def _dequeue(self, req: EngineRequest) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)

    def _settle(self, req: EngineRequest) -> None:
        """Free what a request no longer needs once no in-flight step references it (I5)."""
        if req.num_inflight_steps or req.status is RequestStatus.RUNNING:
            return
        for seq in req.sequences:
            if seq.slot >= 0:
                self.free_slots.append(seq.slot)
                seq.slot = -1
            if req.is_finished:
                self.block_manager.free(seq)
        if req.is_finished:
            del self.requests[req.request_id]
            if req.grammar is not None:
                req.grammar.release()
                self.matchers -= 1
            if req.status is RequestStatus.ABORTED:
                self.aborted_freed.append(req)
            if self.release:
                self.release(req)

"""RequestLedger: the scheduler's requests and their lifecycle, WAITING -> RUNNING <-> PREEMPTED -> FINISHED or
ABORTED, and when what each holds is freed: a finished or aborted request leaves the queues at once, its KV blocks
and slot (and its grammar matcher) once no in-flight step references it (DESIGN I5); an aborted one is then
reported by `drain_aborted()`, the moment its AbortAck may be sent. Admission (`_admit`: the head of the queue into
a step), which token ends a request (`_ends`: stop conditions; `_append_tokens`: a step's tokens up to it), and whom
a request short of KV blocks preempts (`_make_room`: the youngest, never the oldest running request: the
scheduler's progress argument rests on it). The Scheduler (actors/engine/scheduler.py) plans steps over it; a
request that raises while planned or post-processed fails alone (actors/engine/isolation.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from actors.engine.beams import Ending, Hypothesis, new_group, regroup, search_key
from actors.engine.block_manager import BlockManager
from actors.engine.logprobs import take_prompt_logprobs
from actors.engine.request import RUNNING, EngineRequest, RequestStatus
from gpu.batch import BatchSpec
from messages.sampling_params import SamplingParams
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
        self.searches: dict[bytes, EngineRequest] = {}  # search_key -> its live beam group
        self.num_groups = 0  # beam groups in `requests` (a search replaced in `searches` by a copy's lives on)
        self.matchers = 0  # grammar matchers its requests hold (the idle invariant's): counted as added, until freed
        self.queue_times: list[float] | None = None  # arrival -> first scheduled, for /metrics (None: not kept)

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
        an unknown, finished or already aborted id (a late abort): no AbortAck is due for it. A beam group's members
        are aborted with it (the last one's going aborts the group, silently)."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        if req.beams is not None and req.beams.members:
            for member in list(req.beams.members.values()):
                self.abort(member.request_id, reason)
            return True
        self._dequeue(req)
        req.status, req.abort_reason = RequestStatus.ABORTED, reason
        self._settle(req)
        return True

    def drain_aborted(self) -> list[EngineRequest]:
        """Aborted requests whose resources are freed since the last call: send their AbortAck."""
        freed, self.aborted_freed = self.aborted_freed, []
        return freed

    def forget_device_state(self) -> None:
        """The worker lost its KV cache and relay (call once every step in flight is dropped): every running request is
        preempted (it recomputes its prompt and the tokens it emitted) and the prefix cache is emptied."""
        while self.running:  # the last first: they wait at the front in their running order
            self._preempt(self.running.pop())
        self.block_manager.forget_cache()

    # ---------------------------------------------------------------- internals

    def _first_scheduled(self, req: EngineRequest) -> None:
        """Stamp the request's first scheduling (whether or not its planning then fails) and count its queue time."""
        req.scheduled_at = time.monotonic()
        if self.queue_times is not None:
            self.queue_times.append(req.scheduled_at - req.queued_at)

    def _ends(self, req: EngineRequest, token: int) -> bool:
        """Finish the request if `token`, just appended, ends it (a grammar ends it once complete; a token its
        grammar refuses is taken back and fails it: the matcher failed, or (a bug) the mask allowed the token)."""
        p, n, grammar = req.params, len(req.output_token_ids), req.grammar
        if grammar is not None and not grammar.accept(token):
            req.output_token_ids.pop()
            req.error = grammar.error or f"token {token} is not allowed by the request's grammar"
            self._finish(req, "error")
        elif (grammar is not None and grammar.terminated) or (
            n > p.min_tokens and token in self.eos_token_ids and not p.ignore_eos
        ):
            self._finish(req, "stop")
        elif n > p.min_tokens and token in p.stop_token_ids:
            self._finish(req, "stop", token)
        elif len(req.prompt_token_ids) + n >= req.length_limit:  # (known tokens)
            self._finish(req, "length")
        return req.finish_reason is not None  # (set by _finish: it had not ended)

    def _append_tokens(self, req: EngineRequest, tokens: list[int]) -> RequestOutput:
        """Append a step's tokens up to the first that ends the request (or that its grammar refuses, which fails
        it); the rest are discarded."""
        seq = req.next_seq
        first = seq == req.first_seq
        for token in tokens:
            req.output_token_ids.append(token)
            if self._ends(req, token):
                break
        new = req.output_token_ids[seq:]
        self.generation_tokens_total += len(new)
        self.num_discarded_samples += len(tokens) - len(new)
        ended = req.finish_reason is not None
        return RequestOutput(
            request_id=req.request_id, seq=seq, new_token_ids=new, finish_reason=req.finish_reason,
            stop_reason=req.stop_reason, prompt_logprobs=take_prompt_logprobs(req) if first else None, error=req.error,
            num_cached_tokens=req.num_cached_tokens if first else None, attempt=req.attempt,
            timings=req.timings(first, ended) if first or ended else None,
        )  # fmt: skip

    # ---------------------------------------------------------------- beam search (actors/engine/beams.py)

    def _join(self, member: EngineRequest) -> None:
        """A beam search's choice joins the live search of its prompt, or starts one (queued like any request)."""
        spec, key = member.params.beam, search_key(member)
        group = self.searches.get(key)
        if group is None or group.is_finished or spec.rank in group.beams.members:
            group = new_group(member, f"{member.request_id}/beams{member.attempt}")
            group.beams.key = key
            self.searches[key] = self.requests[group.request_id] = group
            self.num_groups += 1
            self.waiting.append(group)
        group.beams.members[spec.rank] = member
        member.search, group.failed_steps = group, max(group.failed_steps, member.failed_steps)  # (a copy's blame)

    def _leave(self, member: EngineRequest) -> None:
        """A member ends (its abort, or its answer): a running search left with none is aborted silently."""
        group, member.search = member.search, None
        del group.beams.members[member.params.beam.rank]
        if not group.beams.members and not group.is_finished:
            self.abort(group.request_id, None)

    def _search_step(self, group: EngineRequest) -> list[RequestOutput]:
        """A group whose beams all sampled steps its search: its next beams, or its members' answers."""
        if group.status is not RequestStatus.RUNNING or not group.beams.ready:
            return []
        beams, p = group.beams, group.params
        max_output = min(p.max_tokens, self.max_model_len - group.num_prompt_tokens)
        if children := beams.advance(lambda t: self._ending(p, t), group.num_prompt_tokens, max_output):
            regroup(group, children, self.block_manager)
            return []
        self._finish(group, "stop")
        outputs = []
        for member in self._end_members(group):
            hyp = beams.ended[min(member.params.beam.rank, len(beams.ended) - 1)]
            outputs.append(self._answer(member, hyp))
        self._settle(group)
        return outputs

    def _end_members(self, group: EngineRequest) -> list[EngineRequest]:
        """A finished group's members, finished and freed (their outputs are the caller's)."""
        members = list(group.beams.members.values())
        for member in members:
            member.scheduled_at, member.num_cached_tokens = group.scheduled_at, group.num_cached_tokens
            self._finish(member, group.finish_reason)
            self._settle(member)
        return members

    def _ending(self, p: SamplingParams, token: int) -> Ending | None:
        """Whether a token ends a beam (EOS unless ignore_eos; a stop token id)."""
        if token in p.stop_token_ids:
            return "stop", token
        return ("stop", None) if token in self.eos_token_ids and not p.ignore_eos else None

    def _answer(self, member: EngineRequest, hyp: Hypothesis) -> RequestOutput:
        """A member's one output: the hypothesis of its rank, whole."""
        self.generation_tokens_total += len(hyp.token_ids)
        return RequestOutput(
            request_id=member.request_id, seq=member.first_seq, new_token_ids=hyp.token_ids,
            finish_reason=hyp.finish_reason, stop_reason=hyp.stop_reason, num_cached_tokens=member.num_cached_tokens,
            attempt=member.attempt, timings=member.timings(True, True),
        )  # fmt: skip

    def _finish(self, req: EngineRequest, reason: FinishReason, stop_reason: int | None = None) -> None:
        self._dequeue(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason

    def _admit(self, batch: BatchSpec, req: EngineRequest, budget: int, chunk: int) -> int | None:
        """Admit the head of the queue into the step: the tokens its rows feed (None: it waits, and stays)."""
        hits = self.block_manager.prefix_hits(req)  # each sequence's cached prefix (counted as computed)
        plan = self._plan(req, budget, chunk)
        blocked = req.num_inflight_steps or len(self.free_slots) < req.num_slots or not any(n for _, n in plan)
        if blocked or not self.block_manager.can_allocate([(n, h) for (_, n), h in zip(plan, hits, strict=True)]):
            for seq in req.sequences:
                seq.num_computed_tokens = 0
            return None
        self.inject("scheduler.schedule", req)
        if req.status is RequestStatus.WAITING:
            self.prompt_tokens_total += req.num_prompt_tokens
            req.num_cached_tokens = min(req.sequences[0].num_computed_tokens, req.num_prompt_tokens)
            self.block_manager.queries += req.num_prompt_tokens
            self.block_manager.hits += req.num_cached_tokens
        self.waiting.remove(req)  # (with the next two: a failure anywhere finds it where its status says)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        for seq, blocks in zip(req.sequences, hits, strict=True):  # every hit out of the free queue first: a
            seq.slot = self.free_slots.pop()  # new block taken from it could be another sequence's hit
            self.block_manager.allocate(seq, 0, blocks)
        if req.beams is not None:  # (the slots its beams may take)
            req.beams.spare_slots = [self.free_slots.pop() for _ in range(req.num_slots - len(hits))]
        self.block_manager.grow(plan)
        self._add_rows(batch, req, plan)
        return sum(n for _, n in plan)

    def _make_room(self, req: EngineRequest, plan: list) -> bool:
        """Preempt the youngest running requests until `req` may grow by its plan (its sequences' tokens); whether
        it may grow now. The oldest running request is never preempted for blocks: alone, it waits instead (what it lacks is
        held by requests that ended with a step in flight, and it fits alone: Scheduler.add_request). Any other one
        goes itself once all younger ones are gone: the older ones hold the rest and need it first."""
        while not self.block_manager.may_grow(plan):
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
        if req.search is not None:  # a beam search's member: it leaves its group
            self._leave(req)
        elif req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)

    def _settle(self, req: EngineRequest) -> None:
        """Free what a request no longer needs once no in-flight step references it (I5)."""
        if req.num_inflight_steps or req.status is RUNNING:
            return
        if self.requests.get(req.request_id) is not req:
            return  # (freed already)
        for seq in req.sequences:
            if seq.slot >= 0:
                self.free_slots.append(seq.slot)
                seq.slot = -1
            if req.is_finished:
                self.block_manager.free(seq)
        if req.beams is not None:
            self.free_slots += req.beams.spare_slots
            req.beams.spare_slots = []
        if req.is_finished:
            del self.requests[req.request_id]
            if req.beams is not None:
                self.num_groups -= 1
                if self.searches.get(req.beams.key) is req:
                    del self.searches[req.beams.key]
            if req.grammar is not None:
                req.grammar.release()
                self.matchers -= 1
            if req.status is RequestStatus.ABORTED:
                self.aborted_freed.append(req)
            if self.release:
                self.release(req)

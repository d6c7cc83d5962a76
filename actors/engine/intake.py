"""The scheduler actor's request intake: AddRequest, Abort and ActorDown, admission, the grammar compile, AbortAcks.

A mixin of SchedulerActor (actors/engine/scheduler_actor.py), on its state: `sched` (the Scheduler: the requests it
runs) and `intake` (the IntakeLedger: the copies held here before the scheduler takes them, and what is known of the
last 65536 ids seen).

Cases (DESIGN section 3; request state at the scheduler x event -> action):
  waiting / preempted        Abort -> removed from the queue, AbortAck now
  mid chunked prefill        Abort -> dropped from the next batch; AbortAck when no in-flight step reads its blocks
  decoding, step in flight   Abort -> its sample of that step is discarded (counted); blocks freed, then AbortAck
  decoding, nothing in flight Abort -> blocks freed, AbortAck now
  finished (terminal sent)   Abort -> late abort: ignored, counted (the detokenizer has the terminal entry)
  aborted twice              Abort -> late abort: ignored, counted
  compiling its grammar      Abort -> dropped, AbortAck now (the compile finishes unused)
  unknown (never added)      Abort -> late abort, counted; remembered: if its AddRequest comes after all (the
                                      link reordered them), it is registered and acked at once, never run
  added before               AddRequest -> a duplicate (ids are unique, DESIGN I1): dropped, logged
  unknown or live            AddRequest(resumed, DESIGN I8) -> a live copy is aborted silently; once no copy is left,
                                      registered and admitted with its delivered tokens, outputs from their count on
  a higher copy seen         AddRequest(resumed) -> dropped while one is live, or if the detokenizer made it; a client's
                                      runs renumbered as the newest copy (it lost that copy's end, or never saw it)
  resumed, copy not yet freed Abort -> remembered: registered and acked at once when the copy is freed
  in steps an engine died in AddRequest(resumed) -> admitted with that blame (actors/engine/flight_record.py); at
                                      max_step_failures refused with an error (a poison request fails alone)
  a newer copy than its own  Abort(attempt) -> stale (the detokenizer's, for a stop string or a bad token in the output
                                      of a copy since replaced, sent again or late): ignored, counted as a late abort
  any live request           ActorDown(detokenizer) -> aborted silently (its text is lost; no ack to send)
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import NamedTuple

import msgspec

from actors.engine.beams import beam_fit_error
from actors.engine.grammar import GrammarError, Matcher, grammars
from actors.engine.guidance import guidance_error
from actors.engine.request import EngineRequest
from actors.protocol import CLIENT_COPIES, DETOK_COPIES, RecentIds, next_attempt
from messages.sampling_params import ParamError
from messages.wire import Abort, AbortAck, AbortReason, ActorDown, AddRequest, ErrorKind, RequestOutput

log = logging.getLogger("sluice.engine")


@dataclass(slots=True)
class Seen:
    """What the intake knows of a request id it has seen."""

    attempt: int = 0  # the highest copy of it seen (AddRequest.attempt; resumed ids)
    added: bool = False  # a copy was registered with the detokenizer: a new AddRequest of it is a duplicate
    abort: AbortReason | None = None  # an Abort its next copies are acked with at once (it came before the request,
    # or while a copy waited here, or its client aborted it)


class Held(NamedTuple):
    """A copy held here before the scheduler takes it."""

    msg: AddRequest
    compiling: bool  # its grammar is being compiled (else it waits until its earlier copy, aborted, is freed)


class IntakeLedger:
    """The intake's requests: those held here (`held`), and what is known of the last 65536 ids (`seen`)."""

    def __init__(self):
        self.held: dict[str, Held] = {}
        self.seen = RecentIds()

    def note(self, rid: str) -> Seen:
        """The id's note, a new one if it was not seen (or forgotten)."""
        if (seen := self.seen.get(rid)) is None:
            self.seen.remember(rid, seen := Seen())
        return seen

    def count(self, compiling: bool) -> int:
        return sum(h.compiling == compiling for h in self.held.values())


class RequestIntake:
    def on_add(self, msg: AddRequest) -> None:
        rid = msg.request_id
        seen = self.intake.note(rid)
        if msg.resume_token_ids is None:
            if seen.added or rid in self.sched.requests:
                self.duplicates += 1
                log.warning("[%s] duplicate AddRequest dropped", rid)
                return
        else:
            top = max(seen.attempt, self._newest_copy(rid))  # (a live copy's number outlives its note)
            if msg.attempt <= top:
                if self._live(rid) or msg.attempt % 2 == DETOK_COPIES:  # made at once with a higher copy, which
                    self.duplicates += 1  # runs (its outputs tell the maker) or ran
                    log.info("[%s] copy %d dropped: copy %d came first", rid, msg.attempt, top)
                    return
                # a client's copy when none runs: it lost the end of a higher one (or never saw it); it runs as the
                # newest copy, so every party follows it and a late registration of an older one is ignored
                msg = msgspec.structs.replace(msg, attempt=next_attempt(top, CLIENT_COPIES))
            seen.attempt = msg.attempt
            if self._resume_later(msg):
                return
        self._register(msg)

    def _live(self, rid: str) -> bool:
        return rid in self.sched.requests or rid in self.intake.held

    def _register(self, msg: AddRequest) -> None:
        """A new request, or a copy with no earlier copy left here: registered with the detokenizer, then acked at
        once if it was aborted before (a copy of a request its client aborted), else validated and admitted."""
        rid = msg.request_id
        seen = self.intake.note(rid)
        seen.added, early_abort = True, seen.abort
        self.tell(self.config.replica.detokenizer, msg)  # registration precedes every output (FIFO link)
        if early_abort is not None:
            log.info("[%s] aborted before it arrived (%s)", rid, early_abort)
            self.tell(
                self.config.replica.detokenizer, AbortAck(request_id=rid, reason=early_abort, attempt=msg.attempt)
            )
            return
        if not self.admitting:
            self._reject(msg, "the server is shutting down", "unavailable")
        elif error := self._validate(msg):
            self._reject(msg, error)
        elif msg.params.structured is not None:
            self.intake.held[rid] = Held(msg, compiling=True)
            self.spawn(self._compile(msg))
        else:
            self._admit(msg)

    def _resume_later(self, msg: AddRequest) -> bool:
        """A resumed request whose earlier copy is still here (the detokenizer restarted while it ran) waits until
        that copy, aborted silently, is freed; a copy still compiling is dropped now."""
        rid = msg.request_id
        self.intake.held.pop(rid, None)
        if rid not in self.sched.requests:
            log.info("[%s] resumed after %d tokens", rid, len(msg.resume_token_ids))
            return False
        self.sched.abort(rid, None)
        self.intake.held[rid] = Held(msg, compiling=False)
        self._send_acks()  # admits it now if the copy is freed already
        return True

    def _admit(self, msg: AddRequest, grammar: Matcher | None = None) -> None:
        req = EngineRequest.from_msg(msg, self.model.bos_token_id, grammar)
        if error := self.flight.admit(req):  # a copy takes the blame of its steps in the engine's deaths
            self._reject(msg, error)
            return
        self.sched.add_request(req)
        self._work.set()

    def _reject(self, msg: AddRequest, error: str | ParamError, kind: ErrorKind = "internal") -> None:
        """End the request before it runs: a ParamError names the request field at fault (the client's 400)."""
        log.warning("[%s] rejected: %s", msg.request_id, error)
        param = error.param if isinstance(error, ParamError) else None
        out = RequestOutput(
            request_id=msg.request_id,
            seq=len(msg.resume_token_ids or []),
            new_token_ids=[],
            finish_reason="error",
            error=str(error),
            error_kind="invalid" if param else kind,
            error_param=param,
            attempt=msg.attempt,
        )
        self.sched.hold_failed([out])
        self._report_held()  # (now, unless a step in flight carries it: actors/engine/step_outputs.py)

    async def _compile(self, msg: AddRequest) -> None:
        """A constrained request's matcher, compiled off the loop; then it joins the queue (unless aborted)."""
        try:
            compiler = await asyncio.get_running_loop().run_in_executor(None, grammars, *self.grammar_key)
            accepted = msg.resume_token_ids or ()
            grammar = await asyncio.wrap_future(compiler.run(compiler.matcher, msg.params.structured, accepted))
        except GrammarError as e:
            grammar, error = None, ParamError("structured_outputs", f"invalid structured output: {e}")
        if (held := self.intake.held.get(msg.request_id)) is None or held.msg is not msg:
            return  # aborted meanwhile (acked then), or resumed (a newer copy compiles)
        del self.intake.held[msg.request_id]
        if grammar is None:
            self._reject(msg, error)
        else:
            self._admit(msg, grammar)

    def _validate(self, msg: AddRequest) -> ParamError | str | None:
        """Why the engine cannot run the request: the request field at fault, or (a string) its copy's state."""
        n = len(msg.prompt_token_ids)
        if n == 0:
            return ParamError("prompt", "the prompt is empty")
        if n >= self.max_model_len:
            return ParamError("prompt", f"the prompt has {n} tokens; max_model_len is {self.max_model_len}")
        try:
            msg.params.verify(self.model.vocab_size, limits=None)  # validity; the frontend enforced its limits
        except ParamError as e:
            return e
        if (lora := msg.params.lora) is not None and lora not in (self.sched.loras.paths if self.sched.loras else {}):
            return ParamError("model", f"this engine serves no LoRA adapter {lora}")
        resumed = msg.resume_token_ids or []
        ids = msg.prompt_token_ids + resumed
        if min(ids) < 0 or max(ids) >= self.model.vocab_size:  # (then the first one outside, named)
            bad = next(t for t in ids if not 0 <= t < self.model.vocab_size)
            return ParamError("prompt", f"token id {bad} is outside the vocabulary")
        if resumed and (len(resumed) >= msg.params.max_tokens or n + len(resumed) >= self.max_model_len):
            return f"resumed after {len(resumed)} tokens: nothing is left to generate"
        if (beam := msg.params.beam) is not None:
            if resumed:
                return "a beam search's choice is answered whole: a copy of it has no tokens to resume from"
            max_output = min(msg.params.max_tokens, self.max_model_len - n)
            error = beam_fit_error(beam.width, n, max_output, self.config.max_num_seqs, self.sched.block_manager)
            return error and ParamError("best_of", error)
        if not msg.params.guided:
            return None
        return guidance_error(msg.params, self.config, self.model, n, self.sched.block_manager)

    def on_abort(self, msg: Abort) -> None:
        rid, held = msg.request_id, self.intake.held.get(msg.request_id)
        if msg.attempt is not None and msg.attempt < self._newest_copy(rid):
            self.late_aborts += 1
            log.debug("[%s] abort (%s) of copy %d ignored: a newer copy runs", rid, msg.reason, msg.attempt)
        elif held is not None and not held.compiling:  # registered, then acked at once, when its earlier copy is freed
            self.intake.note(rid).abort = msg.reason
        elif held is not None:
            del self.intake.held[rid]
            log.info("[%s] aborted while its grammar compiled (%s)", rid, msg.reason)
            self._aborted(msg)
            self.tell(
                self.config.replica.detokenizer, AbortAck(request_id=rid, reason=msg.reason, attempt=held.msg.attempt)
            )
        elif self.sched.abort(msg.request_id, msg.reason):
            self._aborted(msg)
            log.info("[%s] aborted (%s)", msg.request_id, msg.reason)
            self._send_acks()
        else:
            self.late_aborts += 1
            log.debug("[%s] late abort (%s) ignored", msg.request_id, msg.reason)
            if rid not in self.intake.seen and msg.reason != "stop":  # (a stop is found in output: an unknown
                self.intake.note(rid).abort = msg.reason  # id's is an earlier incarnation's)

    def _newest_copy(self, rid: str) -> int:
        """The attempt of the newest copy of `rid` here (-1: none)."""
        held, req = self.intake.held.get(rid), self.sched.requests.get(rid)
        return max((c.attempt for c in (held and held.msg, req) if c), default=-1)

    def _aborted(self, msg: Abort) -> None:
        """A later copy of a request its client aborted is acked at once; a copy of one the detokenizer ended (a stop
        string: its client re-submits it if it lost the Finished) runs, and ends at the stop string again."""
        if msg.reason != "stop":
            seen = self.intake.note(msg.request_id)
            seen.added, seen.abort = True, msg.reason

    def _send_acks(self) -> None:
        for req in self.sched.drain_aborted():
            if req.abort_reason is not None:
                ack = AbortAck(request_id=req.request_id, reason=req.abort_reason, attempt=req.attempt)
                self.tell(self.config.replica.detokenizer, ack)
        held = self.intake.held
        for rid in [r for r, h in held.items() if not h.compiling and r not in self.sched.requests]:
            self._register(held.pop(rid).msg)

    def on_actor_down(self, msg: ActorDown) -> None:
        if msg.actor != self.config.replica.detokenizer:
            return
        live = [r.request_id for r in (*self.sched.waiting, *self.sched.running)]
        log.warning("detokenizer down: aborting %d requests silently", len(live) + self.intake.count(compiling=True))
        self.intake.held = {rid: h for rid, h in self.intake.held.items() if not h.compiling}
        for rid in live:
            self.sched.abort(rid, None)
        self._send_acks()

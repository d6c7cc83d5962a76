"""RequestIsolation: an exception raised while the scheduler plans one request's rows of a step (`schedule`) or
applies its results (`update`) fails that request alone, and the engine goes on (a mixin of the Scheduler, on the
RequestLedger's state: actors/engine/lifecycle.py). Only a dead process costs a restart (issue 48).

- The scheduler runs one request's planning of a step, or its results, in a `try` whose `except Exception` hands
  what it raised (a bug, or a fault plan's raise rule) to `_failed` with the request's `snapshot` as it began (a
  plain try, cheap: it runs for every request twice a step). That is logged with the request's id and traceback,
  and ends the request with finish_reason "error", error_kind "internal": a 500 for its client alone, whose message
  is INTERNAL_ERROR after the request id and no more (the exception's text may name other requests). Its terminal
  output goes to `outputs` (planning: `failed`), one per request that was live as the `try` began (a beam group:
  each of its members then, also those the group had ended in it without reporting them), unless it had already
  ended (its terminal went out before, or its abort will be acked): exactly one terminal message each (DESIGN I2).
  So what the `try` runs appends to `outputs` only as its last act.
- Not one request's: MemoryError and RecursionError (the process's state) and anything not an Exception propagate,
  and so does any failure after which the ledgers every request shares are inconsistent (`ledger_error`: each live
  request queued once where its status says, each slot free or held once, each block's reference count that of the
  block tables holding it; O(blocks + requests), once per failure). The engine process then dies and restarts clean
  rather than run on corrupt refcounts (which could mix KV between requests).
- Planning: a request's planning adds its rows to the batch as its last act, so a failed one has none there (the
  worker never sees them: the blocks they counted sent, `sent_blocks`, are moot, the request never planned again);
  the in-flight counts of rows it made are restored, and the prefix cache is forgotten
  (those rows may have registered blocks that no step will compute; running requests register theirs again with
  their next rows). Its rows of the step in flight stay there; their samples are discarded as an aborted request's
  are.
- Post-processing: the output tokens it took in the `try` are taken back (they were not reported: the terminal
  output's seq follows the last token that was).
- Its KV blocks and slots are freed once no step in flight references them (DESIGN I5: `_settle`), and it is never
  planned again: nothing of it follows its terminal output.
- `failed` holds terminal outputs to go first in the scheduler actor's next numbered StepOutputs (a failed planning's,
  the intake's refusals, recovery's poison requests: actors/engine/step_outputs.py), so a lost one shows as a gap.
- The step's lists from the worker are cut per request on the actor's side (logprobs): a StepResult that does not fit
  its batch is the worker's failure, not one request's.

`fault` (a test hook): called with (site, request id) each time a request's rows are planned into a step
("scheduler.schedule": a running request's once it has room, a waiting one's once it is admitted) and each time a
sampling row's tokens are applied to a request still running ("scheduler.update": after its drafts are verified);
the scheduler actor sets it from the engine's fault plan (actors/runtime/faults.py's raise rules).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from actors.engine.request import ENDED, EngineRequest, RequestStatus
from messages.wire import ErrorKind, RequestOutput

log = logging.getLogger("sluice.engine")

NOT_ONE_REQUESTS = (MemoryError, RecursionError)  # the process's state, whichever request it surfaced in
INTERNAL_ERROR = "internal error in the engine (details in the server log)"  # (the detokenizer adds the request id)


def snapshot(req: EngineRequest) -> tuple:
    """What a failure of the request's planning or results restores, and whom it ends (taken as they begin): its
    status, output tokens, in-flight steps and pending tokens, and a beam group's members."""
    members = None if req.beams is None else list(req.beams.members.values())
    return req.status, len(req.output_token_ids), req.num_inflight_steps, req.num_pending_tokens, members


class RequestIsolation:
    fault: Callable[[str, str], None] | None = None

    def hold_failed(self, outputs: list[RequestOutput]) -> None:
        """Terminal outputs of requests that ended outside a step's results, for the next numbered StepOutputs."""
        self.failed += outputs

    def drain_failed(self) -> list[RequestOutput]:
        """The terminal outputs held (module docstring): send them now, first in a numbered StepOutputs."""
        failed, self.failed = self.failed, []
        return failed

    def inject(self, site: str, req: EngineRequest) -> None:
        if self.fault is not None:
            self.fault(site, req.request_id)

    def fail(
        self, req: EngineRequest, error: str, live: list[EngineRequest] | None = None, kind: ErrorKind = "internal"
    ) -> list[RequestOutput]:
        """End a request with finish_reason "error" (a poison request; one that raised: `_failed`; `kind`
        "unavailable": what it needs cannot be had, a 503); a beam group: each member of `live` (default: the
        request, or its group's members) not ended yet. The terminal outputs of `live`, each at the seq after its
        last reported token. Freed once no step in flight references it."""
        if live is None:
            live = list(req.beams.members.values()) if req.beams else [req]
        if not req.is_finished:
            req.error = error
            self._finish(req, "error")
        for member in live:  # a beam group's (also those a group that raised as it ended them had not reached)
            if member is not req:
                if not member.is_finished:
                    self._finish(member, "error")
                self._settle(member)
        self._settle(req)
        return [
            RequestOutput(request_id=r.request_id, seq=r.next_seq, new_token_ids=[], finish_reason="error", error=error,
                          error_kind=kind, attempt=r.attempt)
            for r in live
        ]  # fmt: skip

    def ledger_error(self) -> str | None:
        """What is inconsistent in the ledgers every request shares (module docstring), or None."""
        queued = {id(r): r for q in (self.running, self.waiting) for r in q}
        live = [r for r in self.requests.values() if r.search is None and not r.is_finished]
        if len(queued) != len(self.running) + len(self.waiting) or queued.keys() != {id(r) for r in live}:
            return "a live request is not queued once, or a queued one is not live"
        if any(r.status is not RequestStatus.RUNNING for r in self.running) or any(
            r.status is RequestStatus.RUNNING for r in self.waiting
        ):
            return "a queued request's status is not its queue's"
        if self.num_groups != sum(r.beams is not None for r in self.requests.values()):
            return "the count of beam groups is not the number held"
        sequences = [seq for r in self.requests.values() for seq in r.sequences]
        held = [seq.slot for seq in sequences if seq.slot >= 0]
        held += [slot for r in self.requests.values() if r.beams is not None for slot in r.beams.spare_slots]
        if sorted(held + self.free_slots) != list(range(self.max_num_seqs)):
            return "a slot is held twice, or lost"
        return self.block_manager.ledger_error(seq.block_table for seq in sequences)

    def _failed(self, req: EngineRequest, before: tuple, error: Exception, outputs: list, planning: bool = False):
        """The request's planning or results raised `error`, `before` its `snapshot` as they began: fail it alone,
        with its terminal outputs in `outputs`, unless it is not one request's (then raise: module docstring)."""
        if isinstance(error, NOT_ONE_REQUESTS):
            raise error
        status, known, inflight, pending, members = before
        live = [] if status in ENDED else [req] if members is None else members  # (whom it ends)
        ids = ", ".join([req.request_id, *(r.request_id for r in live if r is not req)])  # (a group's members too)
        what = "planned" if planning else "post-processed"
        log.error("[%s] failed alone: an exception while the engine %s a step of it", ids, what, exc_info=error)
        if planning:
            req.num_inflight_steps, req.num_pending_tokens = inflight, pending
            self.block_manager.forget_cache()
        del req.output_token_ids[known:]
        outputs += self.fail(req, INTERNAL_ERROR, live)
        if problem := self.ledger_error():
            raise RuntimeError(
                f"the scheduler's ledgers are corrupt after request {req.request_id} failed: {problem}"
            ) from error

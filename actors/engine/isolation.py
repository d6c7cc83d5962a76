"""RequestIsolation: an exception raised while the scheduler plans one request's rows of a step (`schedule`) or
applies its results (`update`) fails that request alone, and the engine goes on (a mixin of the Scheduler, on the
RequestLedger's state: actors/engine/lifecycle.py). Only a dead process costs a restart (issue 48).

- `isolated(req, outputs, planning)` is the context of one request's planning of a step, or of its results. What
  it raises (any Exception: a bug, or a fault plan's raise rule) is logged with the request's id and ends the
  request with finish_reason "error", error_kind "internal" (a 500 for its client alone). Its terminal output goes
  to `outputs` (planning: `failed`, which the scheduler actor sends at once as an unnumbered StepOutputs), one per
  request that was live as the context began (a beam group: each of its members then), unless it had already ended
  (its terminal went out before, or its abort will be acked): exactly one terminal message each (DESIGN I2). So a
  context appends to `outputs` only as its last act.
- Planning: a request's planning adds its rows to the batch as its last act, so a failed one has none there (the
  worker never sees them); the in-flight counts of rows it made are restored, and the prefix cache is forgotten
  (those rows may have registered blocks that no step will compute; running requests register theirs again with
  their next rows). Its rows of the step in flight stay there; their samples are discarded as an aborted request's
  are.
- Post-processing: the output tokens it took in the context are taken back (they were not reported: the terminal
  output's seq follows the last token that was).
- Its KV blocks and slots are freed once no step in flight references them (DESIGN I5: `_settle`), and it is never
  planned again: nothing of it follows its terminal output.
- The step's lists from the worker are cut per request on the actor's side (logprobs): a StepResult that does not fit
  its batch is the worker's failure, not one request's.

`fault` (a test hook): called with (site, request id) as each request's planning ("scheduler.schedule") and each
sampling row's post-processing ("scheduler.update") begin; the scheduler actor sets it from the engine's fault plan
(actors/runtime/faults.py's raise rules).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

from actors.engine.request import EngineRequest
from messages.wire import RequestOutput

log = logging.getLogger("sluice.engine")


class RequestIsolation:
    fault: Callable[[str, str], None] | None = None

    def drain_failed(self) -> list[RequestOutput]:
        """The terminal outputs of the requests whose planning failed since the last call: send them now."""
        failed, self.failed = self.failed, []
        return failed

    def inject(self, site: str, req: EngineRequest) -> None:
        if self.fault is not None:
            self.fault(site, req.request_id)

    @contextlib.contextmanager
    def isolated(self, req: EngineRequest, outputs: list[RequestOutput], planning: bool = False) -> Iterator:
        """One request's planning or post-processing: what it raises fails the request alone (module docstring)."""
        live = [] if req.is_finished else list(req.beams.members.values()) if req.beams else [req]
        known, inflight, pending = len(req.output_token_ids), req.num_inflight_steps, req.num_pending_tokens
        try:
            yield
        except Exception as e:
            what = "planned" if planning else "post-processed"
            error = f"internal error while the engine {what} a step of this request ({type(e).__name__}: {e})"
            log.exception("[%s] %s", req.request_id, error)
            if planning:
                req.num_inflight_steps, req.num_pending_tokens = inflight, pending
                self.block_manager.forget_cache()
            del req.output_token_ids[known:]
            outputs += self.fail(req, error, live)

    def fail(self, req: EngineRequest, error: str, live: list[EngineRequest] | None = None) -> list[RequestOutput]:
        """End a request with finish_reason "error" (a poison request; one that raised in `isolated`); a beam group:
        each of its members. The terminal outputs of `live` (default: the request, or its group's members), each at
        the seq after its last reported token. Freed once no step in flight references it."""
        if live is None:
            live = list(req.beams.members.values()) if req.beams else [req]
        if not req.is_finished:
            req.error = error
            self._finish(req, "error")
            if req.beams is not None:
                self._end_members(req)
        self._settle(req)
        return [
            RequestOutput(request_id=r.request_id, seq=r.next_seq, new_token_ids=[], finish_reason="error", error=error,
                          attempt=r.attempt)
            for r in live
        ]  # fmt: skip

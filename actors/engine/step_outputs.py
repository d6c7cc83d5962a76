"""StepReports: what the scheduler actor (actors/engine/scheduler_actor.py) sends the detokenizer, a mixin on its
state: a step's StepOutputs once it is postprocessed (numbered by the step), an empty one with a number of its own
as the engine goes idle (a lost last step shows as a gap), and the terminal outputs of the requests whose planning
failed (unnumbered, at once: actors/engine/isolation.py). With `EngineConfig.record_outputs`, each step's entries
are recorded before they are sent.
"""

from __future__ import annotations

import logging

import msgspec

from actors.engine.logprobs import collect_prompt_logprobs, entries, wanted_logprobs
from actors.engine.worker_link import execute_step
from gpu.batch import BatchSpec
from messages.step import StepResult
from messages.wire import StepOutputs

log = logging.getLogger("sluice.engine")


class StepReports:
    async def _postprocess(self, batch: BatchSpec, result: StepResult) -> None:
        if result.prompt_logprobs is not None:
            collect_prompt_logprobs(batch, result.prompt_logprobs, self.sched.requests)
        lp = result.logprobs
        want = wanted_logprobs(batch, self.sched.requests) if lp is not None else {}  # before update() ends any
        outputs = self.sched.update(batch, result.sampled, result.num_emitted, lp)
        for out in outputs:
            if out.error:  # (a grammar matcher that failed; a request that raised here: actors/engine/isolation.py)
                log.error("[%s] failed: %s", out.request_id, out.error)
            if out.request_id in want:
                start, n = want[out.request_id]
                out.logprobs = entries(lp, start, start + len(out.new_token_ids), n)
        if self._record:  # before the send: a kill -9 between the two must not leave a sent token unrecorded
            self._record.write(msgspec.json.encode([[o.request_id, o.seq, o.new_token_ids] for o in outputs]) + b"\n")
        recent = self.names.stamp(batch.step, [out.request_id for out in outputs])
        self.tell(self.config.replica.detokenizer, StepOutputs(step=batch.step, outputs=outputs, recent=recent))
        self._send_acks()

    def _send_failed(self) -> None:
        """The terminal outputs of the requests whose planning just failed, sent at once (nothing of them follows)."""
        if failed := self.sched.drain_failed():
            self.tell(self.config.replica.detokenizer, StepOutputs(step=-1, outputs=failed))

    def _idle_marker(self) -> None:
        """An empty StepOutputs with a step number of its own, sent as the engine goes idle: a lost
        last step shows as a gap at the detokenizer even when no other step follows."""
        step, self.sched.next_step = self.sched.next_step, self.sched.next_step + 1
        self._no_outputs(step)
        if self.freed:  # the worker forgets the requests that just ended: a step without rows, not waited for
            msg, _ = execute_step(BatchSpec(step=step), {}, self.epoch, self.seq, self.freed)
            self.seq, self.freed = self.seq + 1, []
            self.link.submit(msg)

    def _no_outputs(self, step: int) -> None:
        """An empty StepOutputs numbered `step`: the detokenizer sees no gap in the step numbers."""
        self.tell(
            self.config.replica.detokenizer, StepOutputs(step=step, outputs=[], recent=self.names.stamp(step, []))
        )

"""StepReports: what the scheduler actor (actors/engine/scheduler_actor.py) sends the detokenizer, a mixin on its
state: a step's StepOutputs once it is postprocessed (numbered by the step), an empty one numbered as each step the
worker lost (actors/engine/recovery.py), and one with a number of its own as the engine goes idle (a lost last step
shows as a gap). Every StepOutputs is numbered: the terminal outputs of requests that ended outside a step's results
(a failed planning: actors/engine/isolation.py; a request the intake refused: intake.py; a poison request recovery
failed) are held by the scheduler (`hold_failed`) and go first in the next one, so a lost one shows as a gap too
(DESIGN I6, I7: the detokenizer repairs the requests it named). They are held only while a numbered step is
outstanding (`Scheduler.in_flight`: planned, its number taken, not yet postprocessed or dropped), and go with it:
with none outstanding every number below `next_step` is reported, so they go at once under a number of their own
(a refusal by `_report_held`: it waits for no worker restart or back-off; a planning failure in a step without rows
by the idle marker, as nothing else runs then: Scheduler's progress). FIFO holds: a failed request's samples in the step in flight are discarded, a refused one never ran. With
`EngineConfig.record_outputs`, every entry is recorded before it is sent.
"""

from __future__ import annotations

import logging

import msgspec

from actors.engine.logprobs import collect_prompt_logprobs, entries, wanted_logprobs
from actors.engine.worker_link import execute_step
from gpu.batch import BatchSpec
from messages.step import StepResult
from messages.wire import RequestOutput, StepOutputs

log = logging.getLogger("sluice.engine")


class StepReports:
    async def _postprocess(self, batch: BatchSpec, result: StepResult) -> None:
        if self.sched.loras is not None:
            self.sched.lora_report(result.loras, result.lora_errors)
        if result.prompt_logprobs is not None:
            collect_prompt_logprobs(batch, result.prompt_logprobs, self.sched.requests)
        lp = result.logprobs
        want = wanted_logprobs(batch, self.sched.requests) if lp is not None else {}  # before update() ends any
        outputs = self.sched.update(batch, result.sampled, result.num_emitted, lp)
        for out in outputs:
            if out.error:  # (a grammar matcher that failed; a request that raised: logged with its traceback too)
                log.error("[%s] failed: %s", out.request_id, out.error)
            if out.request_id in want:
                start, n = want[out.request_id]
                out.logprobs = entries(lp, start, start + len(out.new_token_ids), n)
        self._report(batch.step, outputs)
        self._send_acks()

    def _report(self, step: int, outputs: list[RequestOutput]) -> None:
        """The StepOutputs numbered `step`: the terminal outputs held (module docstring), then `outputs`."""
        outputs = [*self.sched.drain_failed(), *outputs]
        if self._record:  # before the send: a kill -9 between the two must not leave a sent token unrecorded
            self._record.write(msgspec.json.encode([[o.request_id, o.seq, o.new_token_ids] for o in outputs]) + b"\n")
        recent = self.names.stamp(step, [out.request_id for out in outputs])
        self.tell(self.config.replica.detokenizer, StepOutputs(step=step, outputs=outputs, recent=recent))

    def _report_held(self) -> None:
        """The terminal outputs held, sent now under a number of their own if no numbered step is outstanding (else
        they go first in its StepOutputs); nothing goes to the worker (it may be down)."""
        if self.sched.failed and not self.sched.in_flight:
            self._report(self._new_number(), [])

    def _idle_marker(self) -> None:
        """A StepOutputs with a step number of its own (empty but for the terminal outputs held), sent as the engine
        goes idle: a lost last step shows as a gap at the detokenizer even when no other step follows."""
        step = self._new_number()
        self._report(step, [])
        if self.freed:  # the worker forgets the requests that just ended: a step without rows, not waited for
            msg, _ = execute_step(BatchSpec(step=step), {}, self.epoch, self.seq, self.freed)
            self.seq, self.freed = self.seq + 1, []
            self.link.submit(msg)

    def _new_number(self) -> int:
        """A StepOutputs number no step holds: every step planned takes its own (`Scheduler.schedule`)."""
        step, self.sched.next_step = self.sched.next_step, self.sched.next_step + 1
        return step

"""WorkerRecovery: the SchedulerActor's part in losing the worker's state (issue 17; docs/ARCHITECTURE.md, "Recovery").

The worker's process died (ActorDown), or a step will never report (worker_link.WorkerLost: a lost, reordered or
late StepResult, a gap, a step that raised there, a step that hung: the worker is restarted): every step in flight
is dropped (an empty StepOutputs keeps its step number, so the detokenizer sees no gap; the first carries the terminal
outputs held, a poison request's among them: actors/engine/step_outputs.py), every running request is
preempted and recomputes on a fresh worker state (a new epoch: every request is new to the worker again) once the
worker is up, and the prefix cache is forgotten. Clients see a pause, never an error, unless a request is blamed
for `max_step_failures` steps that killed the worker, raised or hung there (a poison request): that one fails alone
(from the step before, it runs in steps of its own: Scheduler.isolate_after).
"""

from __future__ import annotations

import collections
import logging
import time

from actors.engine.request import EngineRequest
from actors.engine.worker_link import ProcessWorker, WorkerLost
from messages.wire import ActorDown

log = logging.getLogger("sluice.engine")


class WorkerRecovery:
    async def _worker_lost(self, inflight: collections.deque, lost: WorkerLost) -> None:
        """Drop the steps in flight, recompute every running request on a new epoch, fail a poison request alone."""
        reason = str(lost)
        log.warning("worker lost (%s): %d steps dropped, %d running requests recompute", reason, len(inflight),
                    len(self.sched.running))  # fmt: skip
        self.link.lost(lost.failure, reason)
        self.link.reset_due = False
        hit: dict[str, EngineRequest] = {}
        for batch, *_ in inflight:
            hit.update((req.request_id, req) for req in self.sched.drop(batch))
        dropped = [batch.step for batch, *_ in inflight]
        inflight.clear()
        self.sched.forget_device_state()
        if self.sched.loras is not None:  # (what the new worker state holds: its first report says)
            self.sched.loras.reset()
        self.epoch, self.seq, self.freed = time.monotonic_ns(), 0, []
        self.worker_resets += 1
        for req in self.sched.requests.values():
            req.worker_outputs = -1
        for req in hit.values() if lost.blames else ():
            req.failed_steps += 1
            if req.failed_steps >= self.config.max_step_failures and not req.is_finished:
                error = f"the worker failed {req.failed_steps} steps of this request ({reason})"
                log.error("[%s] %s", req.request_id, error)
                self.sched.hold_failed(self.sched.fail(req, error))
        for step in dropped:  # (the first carries the failures held: actors/engine/step_outputs.py)
            self._report(step, [])
        self._send_acks()
        t0 = time.monotonic()
        await self.link.ready()
        log.info("worker up after %.2f s: %d requests recompute", time.monotonic() - t0, len(self.sched.waiting))

    def _released(self, req: EngineRequest) -> None:
        """A finished request is freed: the proposer and the worker forget it."""
        if req.worker_outputs >= 0:
            self.freed.append(req.request_id)
        if self.proposer:
            self.proposer.release(req.request_id)

    def on_down(self, msg: ActorDown) -> None:
        """The worker's process died: its steps will never report. (Any other actor: the request intake's.)"""
        if msg.actor == self.config.replica.worker and isinstance(self.link, ProcessWorker):
            self.link.down()
            self._work.set()  # (an idle step loop resets the worker state too)
        else:
            self.on_actor_down(msg)

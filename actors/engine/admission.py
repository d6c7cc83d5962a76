"""Admission of the waiting requests into a step (the scheduler's last phase): FIFO, a request at a time while
budget, slots and free blocks last; a suspected poison request alone. The LoRA cap (`max_loras`): at most that many distinct adapters among the running requests, so in
any step (the base model's requests take none). Admission is FIFO but for a waiting request whose adapter would pass
the cap: it is passed over, and the requests behind it are admitted past it, until it has been overtaken
`max_num_seqs` times; then nothing younger is admitted before it. The running requests end (the scheduler's
progress argument), their adapters with them, so it is admitted in time: no head-of-line blocking, no starvation.

| waiting request, at its turn          | outcome                                                          |
|---------------------------------------|------------------------------------------------------------------|
| the base model's, or of an adapter    | admitted as without the cap (budget, slots, blocks)              |
| that runs                             |                                                                  |
| of another adapter, fewer than        | admitted as without the cap (its adapter now runs)               |
| max_loras running                     |                                                                  |
| of another adapter, max_loras running | passed over (the scan goes on, up to max_num_seqs passed over)   |
| ... and overtaken max_num_seqs times  | admission stops for this step: it waits at the front             |

Its adapter must also be held by the worker, or be loaded without stalling others (actors/engine/lora_table.py):
one still loading is passed over without counting as overtaken.
"""

from __future__ import annotations

from actors.engine.isolation import snapshot
from actors.engine.lora_table import LoraTable
from actors.engine.request import EngineRequest
from gpu.batch import BatchSpec


class Admission:
    max_loras: int | None = None  # None: no cap (LoRA off)
    loras: LoraTable | None = None  # the adapters the worker holds or is to (None: LoRA off)

    def _admit_queue(self, batch: BatchSpec, budget: int, chunk: int) -> None:
        """Admit what fits of the queue into `batch`, in `budget` tokens (`chunk` for one request's prefill)."""
        if self.loras is not None and self.loras.retired:
            self.loras.sweep({r.params.lora for r in self.requests.values()})
        passed: list[EngineRequest] = []  # passed over this step for the cap
        i = 0  # (the next waiting request's index: those passed over stay in the queue)
        while i < len(self.waiting) and budget > 0 and self.free_slots:
            req = self.waiting[i]
            if self._suspect(req) and batch.rows:
                break
            if not self._lora_fits(req):
                if self._starved(req) or len(passed) == self.max_num_seqs:
                    break
                passed.append(req)
                i += 1
                continue
            before = snapshot(req)
            try:
                if not self._lora_ready(req, batch):
                    i += 1
                    if i - len(passed) > self.max_num_seqs:  # (a bound on the scan: the queue may be long)
                        break
                    continue
                if (fed := self._admit(batch, req, budget, chunk)) is None:
                    break  # FIFO: it waits for its in-flight sample, for slots, budget or free blocks
            except Exception as e:
                self._failed(req, before, e, self.failed, planning=True)
                continue
            budget -= fed
            for waiting in passed:
                waiting.overtaken += 1
            if self._suspect(req):
                break  # (it runs in a step of its own)

    def lora_report(self, held: list[str] | None, errors: dict[str, str]) -> None:
        """A StepResult's LoRA report (LoraTable.on_report). The requests of an adapter the worker could not load fail
        alone, saying why: the running ones (it ran their rows of the step on the base model, whose samples are
        discarded) and the waiting ones (they waited for that load; a later request tries again)."""
        self.loras.on_report(held, errors)
        for req in [r for r in (*self.running, *self.waiting) if r.params.lora in errors]:
            if not req.is_finished:  # (a beam group's member: ended with its group)
                self.hold_failed(self._adapter_failed(req, errors[req.params.lora]))

    def _adapter_failed(self, req: EngineRequest, why: str) -> list:
        """End `req`, whose adapter the worker could not load: the server's state, not the request's fault (a 503)."""
        return self.fail(req, f"its LoRA adapter could not be loaded: {why}", kind="unavailable")

    def _lora_fits(self, req: EngineRequest) -> bool:
        """Whether running `req` keeps the running requests within max_loras adapters."""
        lora = req.params.lora
        if self.max_loras is None or lora is None:
            return True
        running = {r.params.lora for r in self.running} - {None}
        return lora in running or len(running) < self.max_loras

    def _lora_ready(self, req: EngineRequest, batch: BatchSpec) -> bool:
        """Whether the request's adapter is held, or may be loaded before this step (nothing else runs in it)."""
        if self.loras is None or (lora := req.params.lora) is None:
            return True
        if self.loras.ready(lora, {r.params.lora for r in self.running} - {None}):
            return True
        if self.running or batch.rows or lora not in self.loras.wanted:
            return False
        self.loras.admit_unheld(lora)
        return True

    def _starved(self, req: EngineRequest) -> bool:
        """A passed-over request that nothing younger may overtake any more."""
        return req.overtaken >= self.max_num_seqs

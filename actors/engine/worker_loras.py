"""The worker's LoRA adapters (the scheduler's side: actors/engine/lora_table.py). It holds, in the runner's slots,
what the last ExecuteStep that named them wants, reading new ones from disk on a thread of its own, off the step
loop. Before each step, on the device thread:

1. the adapters no longer wanted leave their slots;
2. the reads that finished are installed (a copy into the slot tables: milliseconds), or their errors kept;
3. a row's adapter not held yet is read and installed now (a new worker state, or a step of nothing else); one that
   fails to load is reported, and its rows run on the base model (the scheduler fails their requests and discards
   those samples: actors/engine/admission.py's lora_report), so no other request's step fails;
4. the wanted adapters neither held nor being read begin their reads.

`report()` says, for the step's StepResult, what the worker holds when that changed, and what failed to load."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from gpu.loading.lora import LoraError
from messages.step import ExecuteStep


class WorkerLoras:
    def __init__(self, runner, wanted: dict[str, str]) -> None:
        """`wanted`: what the runner was given as it was built (digest -> directory)."""
        self.runner, self.wanted = runner, dict(wanted)
        self.paths = dict(wanted)  # every adapter ever wanted's directory (a row's, wanted no more, is read from it)
        self.reads: dict[str, Future] = {}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="lora-read")
        self.changed, self.errors = True, {}  # (the first step reports what it holds)

    @property
    def held(self) -> set[str]:
        return {d for d in self.runner.lora.digests if d is not None}

    def before(self, msg: ExecuteStep) -> set[str]:
        """Steps 1-4 (module docstring) for the step `msg`: the rows' adapters that could not be loaded."""
        if msg.loras is not None:  # (answered with what it holds: the scheduler's view may be stale)
            self.wanted, self.changed = msg.loras, True
            self.paths.update(msg.loras)
            for digest in self.held - set(self.wanted):
                self.runner.lora.remove(digest)
        for digest, read in list(self.reads.items()):
            if read.done():
                del self.reads[digest]
                if digest in self.wanted and digest not in self.held:
                    self._install(digest, read)
        rows = set(dict.fromkeys(r.lora for r in msg.batch.rows if r.lora is not None))
        for digest in rows - self.held:  # (its read, if begun, waited for: or a read here)
            self._install(digest, self.reads.pop(digest, None) or self._read(digest))
        for digest in set(self.wanted) - self.held - set(self.reads) - set(self.errors):
            self.reads[digest] = self._read(digest)
        return rows - self.held

    def report(self) -> tuple[list[str] | None, dict[str, str]]:
        held = sorted(self.held) if self.changed else None
        errors, self.changed, self.errors = self.errors, False, {}
        return held, errors

    def _read(self, digest: str) -> Future:
        return self.pool.submit(self.runner.read_adapter, digest, self.paths[digest])

    def _install(self, digest: str, read: Future) -> None:
        try:
            self.runner.install_adapter(digest, read.result())
            self.changed = True
        except Exception as e:  # (a file changed or broken since it was checked: reported, its requests fail)
            self.errors[digest] = f"{type(e).__name__}: {e}" if not isinstance(e, LoraError) else str(e)

"""The engine's LoRA adapters, as the scheduler sees them: the registered ones (digest -> directory), the ones the
worker is to hold (`wanted`: at most `capacity`, --max-cpu-loras, in least-recently-run order) and the ones it last
reported holding (`held`). The worker learns `wanted` from the next ExecuteStep that carries it (`desired()`),
reads the new ones from disk on a thread of its own (off the step loop) and reports what it holds in a StepResult
(actors/engine/worker_loras.py); a row of an adapter it does not hold yet is loaded on the device thread first.

A waiting request's adapter, at admission (actors/engine/admission.py):

| its adapter                     | outcome                                                                    |
|---------------------------------|----------------------------------------------------------------------------|
| held                            | admitted (as far as the cap goes)                                          |
| not wanted, a slot free (or one | wanted now (the least recently admitted held adapter no running request    |
| whose adapter nothing runs)     | uses leaves: not one still loading for a request ahead) ... then as below  |
| wanted, not held yet            | waits for the worker's report, passed over; but if nothing runs, admitted: |
|                                 | the worker loads it before the step (a stall that delays nobody)           |
| every slot's adapter running    | waits (the cap, max_loras <= max_cpu_loras, bounds what runs)              |
| failed to load                  | it fails, with every request waiting for that load, saying why (alone: the |
|                                 | others go on); the next request naming it tries again (a transient error   |
|                                 | does not stick: vLLM's per-request load)                                   |

A new worker state (an epoch) holds what it holds: `reset` forgets the report until the next one comes. An adapter
unregistered while serving (`unregister`) takes no new request; once no request names it, `sweep` takes it out of
`wanted` (the worker frees its slot)."""

from __future__ import annotations


class LoraTable:
    def __init__(self, paths: dict[str, str], capacity: int, held: list[str]) -> None:
        """`paths`: every registered adapter's directory, by digest; `held`: what the worker holds as it starts."""
        self.paths, self.capacity = dict(paths), capacity
        self.wanted: dict[str, None] = dict.fromkeys(held)  # (dict order: least recently admitted first)
        self.held: set[str] = set(held)
        self.changed = True  # `wanted` changed since the last ExecuteStep carried it (the first one carries it)
        self.loads = self.evictions = 0
        self.retired: dict[str, str] = {}  # unregistered (-> directory), their slots freed once no request names them

    def ready(self, digest: str, running: set[str]) -> bool:
        """Whether rows of `digest` may run now without stalling a step; if not, it is wanted (when a slot can be
        had: `running`, the adapters of the running requests, keep theirs)."""
        if digest in self.held:
            self.wanted[digest] = self.wanted.pop(digest, None)  # (now the most recently admitted)
            return True
        if digest not in self.wanted:
            if len(self.wanted) >= self.capacity:  # (one still loading is another waiting request's: it stays)
                victim = next((d for d in self.wanted if d in self.held and d not in running), None)
                if victim is None:
                    return False
                del self.wanted[victim]
                self.held.discard(victim)
                self.evictions += 1
            self.wanted[digest] = None
            self.changed, self.loads = True, self.loads + 1
        return False

    def admit_unheld(self, digest: str) -> None:
        """Rows of a wanted adapter run before the worker reported it held (nothing else runs): it loads it first."""
        self.held.add(digest)

    def desired(self) -> dict[str, str] | None:
        """What the next ExecuteStep carries: the wanted adapters' directories, when they changed (else None)."""
        if not self.changed:
            return None
        self.changed = False
        return {d: self.paths.get(d) or self.retired[d] for d in self.wanted}

    def on_report(self, held: list[str] | None, errors: dict[str, str]) -> None:
        """A StepResult's report: what the worker holds (None: unchanged), the adapters it failed to load (no longer
        wanted: a request naming one later wants it again, and the worker reads it again)."""
        if held is not None:
            self.held = set(held) & set(self.wanted)
        for digest in errors:
            self.held.discard(digest)  # (one admitted unheld, whose load failed: `held` unchanged in the report)
            if self.wanted.pop(digest, 0) is None:
                self.changed = True

    def register(self, digest: str, path: str) -> None:
        self.paths[digest] = path
        self.retired.pop(digest, None)

    def unregister(self, digest: str) -> None:
        if (path := self.paths.pop(digest, None)) is not None:
            self.retired[digest] = path

    def sweep(self, in_use: set[str]) -> None:
        """Free the retired adapters no request names (`in_use`: those the engine's requests name)."""
        for digest in set(self.retired) - in_use:
            del self.retired[digest]
            if self.wanted.pop(digest, 0) is None:
                self.held.discard(digest)
                self.changed = True

    def reset(self) -> None:
        """A new worker state: what it holds is known from its first report; until then `wanted` is sent again."""
        self.held, self.changed = set(), True

"""Each step's grammar bitmask over its sampled positions (int32 [P, ceil(V / 32)], all allowed except the
constrained rows'), from the requests' matchers (actors/engine/grammar.py).

- `StepMasks` (scheduler): a row whose previous token is known is filled when the step is scheduled and travels
  in ExecuteStep; a row whose previous token is still in flight (async scheduling) once the step before is
  postprocessed, while this step's forward runs (FillMasks).
- `WorkerMasks` (worker): the device thread waits for the last fill (with a deadline) after CFG and before the
  sampler, and applies the mask with xgrammar's kernel (DESIGN 5a).

A row verifying K drafts gets K + 1 masks: position j's with the matcher advanced through the first j drafts
(then rolled back), so a draft the grammar rejects is never accepted and the bonus or resampled token is drawn
from the masked distribution.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from actors.engine.grammar import Matcher
from messages.step import GrammarMasks

if TYPE_CHECKING:
    import torch

MASK_DEADLINE_S = 60.0  # the device thread's wait for a step's masks: only a bug can make it expire


class StepMasks:
    """One step's grammar masks, scheduler side (module docstring): filled from the matchers on the event loop,
    sent to the worker as GrammarMasks (rows whose previous token is known) and FillMasks (the deferred rest)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.filled: list[tuple[Matcher, int, list[int]]] = []  # (matcher, first position, drafts)
        self.deferred: list[tuple[Matcher, int]] = []  # filled once the step before is postprocessed

    def add(self, matcher: Matcher, row: int, drafts: list[int], defer: bool) -> None:
        if defer:  # async scheduling: its previous token is in flight (never with drafts: speculation is sync)
            self.deferred.append((matcher, row))
        else:
            self.filled.append((matcher, row, drafts))

    def wire(self) -> GrammarMasks:
        """The masks of the rows whose previous token is known; the deferred positions named."""
        return self._masks(self.filled, [row for _, row in self.deferred])

    def fill_deferred(self) -> GrammarMasks:
        """The deferred rows' masks, now that their previous token is accepted (or their request ended: then
        all-allowed)."""
        return self._masks([(m, row, []) for m, row in self.deferred])

    def _masks(self, rows: list[tuple[Matcher, int, list[int]]], deferred: list[int] = ()) -> GrammarMasks:
        import xgrammar as xgr

        positions = [row + j for _, row, drafts in rows for j in range(1 + len(drafts))]
        bitmask = xgr.allocate_token_bitmask(len(positions), self.vocab_size)
        k = 0
        for matcher, _, drafts in rows:
            matcher.fill(bitmask, k, drafts)
            k += 1 + len(drafts)
        return GrammarMasks(positions=positions, bitmask=bitmask.numpy().tobytes(), deferred=list(deferred))


class WorkerMasks:
    """One step's grammar masks, worker side: the bitmask over its sampled positions (all allowed but the masked
    rows). The device thread waits for the deferred rows (FillMasks, with a deadline) after CFG and before the
    sampler, and applies the mask with xgrammar's kernel (DESIGN 5a)."""

    def __init__(self, masks: GrammarMasks, num_positions: int, vocab_size: int):
        import xgrammar as xgr

        self.bitmask = xgr.allocate_token_bitmask(num_positions, vocab_size)
        self.vocab_size = vocab_size
        self.rows = sorted(masks.positions + masks.deferred)
        self._ready = threading.Event()
        self.fill(masks)
        if not masks.deferred:
            self._ready.set()

    def fill(self, masks: GrammarMasks, last: bool = False) -> None:
        """Write the rows `masks` holds (`last`: the deferred ones: the sampler may go on)."""
        import torch

        if masks.positions:
            rows = torch.frombuffer(bytearray(masks.bitmask), dtype=torch.int32).view(len(masks.positions), -1)
            self.bitmask[masks.positions] = rows
        if last:
            self._ready.set()

    def apply(self, logits: torch.Tensor) -> None:
        """Mask the logits [P, V] in place: disallowed tokens become -inf (device thread; waits for the fills)."""
        import xgrammar as xgr

        if not self._ready.wait(MASK_DEADLINE_S):
            raise RuntimeError(f"grammar masks not filled within {MASK_DEADLINE_S} s")
        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=self.rows)

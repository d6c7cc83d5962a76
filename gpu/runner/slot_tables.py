"""SlotTables: each slot's block table as its rows left it, so that a row carries only the blocks that changed.

A row of slot s >= 0 holds its sequence's blocks from `blocks_from` on (gpu/batch.py); the blocks before are the
ones this slot's earlier rows left (the scheduler counts what it sent: actors/engine/block_manager.py `unsent`).
Its table becomes `kept[:blocks_from] + row.block_table`: appended blocks, a shortened table (rejected lookahead),
or a whole new one (`blocks_from` 0: a new sequence in the slot, a recompute, every row built outside the
scheduler). A row of slot < 0 (the graphs' pad rows) is taken as it is and leaves nothing. A row whose
`blocks_from` is beyond what its slot holds is refused (the two sides disagree: the step fails, the worker is
reset, every table is sent whole again).

Steady decoding then sends one block per row per `block_size` tokens instead of the whole table each step, and the
step's [rows, width] table is one gather instead of a copy per row from Python lists. A decode step of 256 rows of
1,024-token contexts (64 blocks each; 2-core EPYC, one thread): the ExecuteStep's encode + decode 573 -> 146 us, its
table 325 -> 57 us (128 blocks: 1,000 -> 144 and 619 -> 64). Memory: 8 bytes per slot per block of its longest table
(256 slots of 32k-token contexts: 4 MiB).
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from gpu.batch import ScheduledRow


class SlotTables:
    def __init__(self) -> None:
        self.tables = np.zeros((0, 0), np.int64)  # [slots, width]: slot s's blocks in tables[s, : lens[s]]
        self.lens = np.zeros(0, np.int64)

    def resolve(self, step: int, rows: list[ScheduledRow]) -> tuple[np.ndarray, np.ndarray]:
        """The rows' whole block tables [rows, longest], zero past each row's end, and their lengths; the slots'
        kept tables updated."""
        slots = np.array([r.slot for r in rows], np.int64)
        froms = np.array([r.blocks_from for r in rows], np.int64)
        sent = np.array([len(r.block_table) for r in rows], np.int64)
        ends, kept, width = froms + sent, slots >= 0, int((froms + sent).max(initial=0))
        self._grow(int(slots.max(initial=-1)) + 1, width)
        held = np.zeros_like(ends)
        held[kept] = self.lens[slots[kept]]
        if (bad := np.flatnonzero(kept & (froms > held))).size:
            r = rows[bad[0]]
            raise ValueError(f"step {step}: {r.request_id}'s row sends blocks from {r.blocks_from}, its slot holds "
                             f"{held[bad[0]]}")  # fmt: skip
        for i in np.flatnonzero(kept & (ends < held)):  # (a shorter table: the kept ones stay zero past their end)
            self.tables[slots[i], ends[i] : held[i]] = 0
        values = np.fromiter(chain.from_iterable(r.block_table for r in rows), np.int64, int(sent.sum()))
        row_of = np.repeat(np.arange(len(rows)), sent)
        cols = np.arange(values.size) - np.repeat(np.cumsum(sent) - sent, sent) + froms[row_of]
        mine = kept[row_of]
        self.tables[slots[row_of[mine]], cols[mine]] = values[mine]
        self.lens[slots[kept]] = ends[kept]
        if kept.all():
            return self.tables[slots, :width], ends
        out = np.zeros((len(rows), width), np.int64)
        out[kept] = self.tables[slots[kept], :width]
        out[row_of[~mine], cols[~mine]] = values[~mine]
        return out, ends

    def _grow(self, slots: int, width: int) -> None:
        """Room for `slots` slots of `width` blocks (doubling: a few copies over a server's life)."""
        have_slots, have_width = self.tables.shape
        if slots <= have_slots and width <= have_width:
            return
        grown = np.zeros((max(slots, 2 * have_slots), max(width, 2 * have_width)), np.int64)
        grown[:have_slots, :have_width] = self.tables
        self.tables = grown
        self.lens = np.concatenate([self.lens, np.zeros(grown.shape[0] - have_slots, np.int64)])

"""SlotTables: each slot's block table as its rows left it, so that a row carries only the blocks that changed.

A row of slot s >= 0 holds its sequence's blocks from `blocks_from` on (gpu/batch.py); the blocks before are the
ones this slot's earlier rows left (the scheduler counts what it sent: actors/engine/block_manager.py `unsent`).
Its table becomes `kept[:blocks_from] + row.block_table`: appended blocks, a shortened table (rejected lookahead),
or a whole new one (`blocks_from` 0: a new sequence in the slot, a recompute, every row built outside the
scheduler). A row of slot < 0 (the graphs' pad rows, the memory profile's) is taken as it is and leaves nothing.
TablesDisagree refuses a step where the two sides cannot agree: a row that keeps blocks (`blocks_from` > 0) of a
slot whose last row was another request's, or more than the slot holds, or of no slot, or two rows of a slot (the
step fails blaming nobody, a "gap": the worker is reset, every table is sent whole again; a second one in a row
blames the step's requests, as a step that raised: actors/engine/worker.py).

Steady decoding then sends one block per row per `block_size` tokens instead of the whole table each step, and the
step's [rows, width] table is one gather instead of a copy per row from Python lists. A decode step of 256 rows of
1,024-token contexts (64 blocks each; 2-core EPYC, `scripts/bench_worker.py --link-only`, whole tables against new
blocks only): the ExecuteStep's encode + decode 588 -> 146 us, the tables 447 -> 124 us; at one row 7 -> 5 us.
Memory: 8 bytes per slot (max_num_seqs) per block of the longest table, up to twice that as the width doubles; on
CUDA the memory profile's longest row makes it max_model_len / block_size wide from the start (256 slots of
32k-token contexts: 4-8 MiB).
"""

from __future__ import annotations

import numpy as np

from gpu.batch import ScheduledRow


class TablesDisagree(ValueError):
    """The scheduler's rows and the kept tables do not fit together (a bookkeeping bug, no request's fault)."""


class SlotTables:
    def __init__(self, slots: int = 0) -> None:
        self.tables = np.zeros((slots, 0), np.int64)  # [slots, width]: slot s's blocks in tables[s, : lens[s]]
        self.lens = [0] * slots
        self.owners: list[str | None] = [None] * slots  # the request of each slot's last row

    def check(self, step: int, rows: list[ScheduledRow]) -> None:
        """TablesDisagree unless the rows fit the kept tables (nothing changed: a gang's leader checks before its
        followers see the step, so every rank keeps the same tables)."""
        lens, owners, seen = self.lens, self.owners, set()
        for r in rows:
            slot, start = r.slot, r.blocks_from
            held, owner = (lens[slot], owners[slot]) if 0 <= slot < len(lens) else (0, None)
            if start and (slot < 0 or start > held or owner != r.request_id):
                raise TablesDisagree(f"step {step}: {r.request_id}'s row keeps {start} blocks of slot {slot}, "
                                     f"which holds {held} of {owner}")  # fmt: skip
            if slot in seen:
                raise TablesDisagree(f"step {step}: two rows of slot {slot}")
            if slot >= 0:
                seen.add(slot)

    def resolve(self, step: int, rows: list[ScheduledRow]) -> tuple[np.ndarray, np.ndarray]:
        """The rows' whole block tables [rows, longest], zero past each row's end, and their lengths; the slots'
        kept tables updated (once `check` passes). One pass over the rows, which mostly send nothing, then one
        gather."""
        self.check(step, rows)
        ends = [r.blocks_from + len(r.block_table) for r in rows]
        width = max(ends, default=0)
        self._grow(max([0, *(r.slot for r in rows)]) + 1 if rows else 0, width)  # (a gather reads slot 0 at least)
        tables, lens, owners = self.tables, self.lens, self.owners
        for r, end in zip(rows, ends, strict=True):
            if (slot := r.slot) < 0:
                continue
            if r.block_table:
                tables[slot, r.blocks_from : end] = r.block_table
            if end < lens[slot]:  # (a shorter table: the kept ones stay zero past their end)
                tables[slot, end : lens[slot]] = 0
            lens[slot], owners[slot] = end, r.request_id
        out = tables[[max(r.slot, 0) for r in rows], :width]
        for i, r in enumerate(rows):
            if r.slot < 0:  # (taken as it is)
                out[i] = 0
                out[i, : len(r.block_table)] = r.block_table
        return out, np.array(ends, np.int64)

    def _grow(self, slots: int, width: int) -> None:
        """Room for `slots` slots (as many as asked: the runner's max_num_seqs from the start) of `width` blocks
        (doubling: a few copies over a server's life)."""
        have_slots, have_width = self.tables.shape
        if slots <= have_slots and width <= have_width:
            return
        wide = have_width if width <= have_width else max(width, 2 * have_width)
        grown = np.zeros((max(slots, have_slots), wide), np.int64)
        grown[:have_slots, :have_width] = self.tables
        self.tables, more = grown, grown.shape[0] - have_slots
        self.lens += [0] * more
        self.owners += [None] * more

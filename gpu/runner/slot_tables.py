"""SlotTables: each slot's block table as its rows left it, so that a row carries only the blocks that changed.

A row of slot s >= 0 holds its sequence's blocks from `blocks_from` on (gpu/batch.py); the blocks before are the
ones this slot's earlier rows left (the scheduler counts what it sent: actors/engine/block_manager.py `unsent`).
Its table becomes `kept[:blocks_from] + row.block_table`: appended blocks, a shortened table (rejected lookahead),
or a whole new one (`blocks_from` 0: a new sequence in the slot, a recompute, every row built outside the
scheduler). A row of slot < 0 (the graphs' pad rows, the memory profile's) is taken as it is and leaves nothing.
TablesDisagree refuses a step where the two sides cannot agree: a row that keeps blocks (`blocks_from` > 0) of a
slot whose last row was another request's, or more than the slot holds, or two rows of one slot (the step fails
blaming nobody, the worker is reset, every table is sent whole again).

Steady decoding then sends one block per row per `block_size` tokens instead of the whole table each step, and the
step's [rows, width] table is one gather instead of a copy per row from Python lists. A decode step of 256 rows of
1,024-token contexts (64 blocks each; 2-core EPYC, one thread): the ExecuteStep's encode + decode 573 -> 146 us, its
table 325 -> 57 us (128 blocks: 1,000 -> 144 and 619 -> 64). Memory: 8 bytes per slot per block of the longest table
(up to twice that: the width doubles as it grows; 256 slots of 32k-token contexts: 4-8 MiB).
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from gpu.batch import ScheduledRow


class TablesDisagree(ValueError):
    """The scheduler's rows and the kept tables do not fit together (a bookkeeping bug, no request's fault)."""


class SlotTables:
    def __init__(self, slots: int = 0) -> None:
        self.tables = np.zeros((slots, 0), np.int64)  # [slots, width]: slot s's blocks in tables[s, : lens[s]]
        self.lens = np.zeros(slots, np.int64)
        self.owners = np.full(slots, None, object)  # the request of each slot's last row

    def resolve(self, step: int, rows: list[ScheduledRow]) -> tuple[np.ndarray, np.ndarray]:
        """The rows' whole block tables [rows, longest], zero past each row's end, and their lengths; the slots'
        kept tables updated."""
        slots = np.array([r.slot for r in rows], np.int64)
        froms = np.array([r.blocks_from for r in rows], np.int64)
        sent = np.array([len(r.block_table) for r in rows], np.int64)
        ends, kept, width = froms + sent, slots >= 0, int((froms + sent).max(initial=0))
        self._grow(int(slots.max(initial=-1)) + 1, width)
        held, ids = np.zeros_like(ends), np.array([r.request_id for r in rows], object)
        held[kept] = self.lens[slots[kept]]
        strangers = np.zeros_like(kept)
        strangers[kept] = self.owners[slots[kept]] != ids[kept]
        if (bad := np.flatnonzero(kept & (froms > 0) & ((froms > held) | strangers))).size:
            r, i = rows[bad[0]], bad[0]
            raise TablesDisagree(f"step {step}: {r.request_id}'s row keeps {r.blocks_from} blocks of slot {r.slot}, "
                                 f"which holds {held[i]} of {self.owners[r.slot]}")  # fmt: skip
        if np.unique(slots[kept]).size < kept.sum():
            raise TablesDisagree(f"step {step}: two rows of one slot")
        for i in np.flatnonzero(kept & (ends < held)):  # (a shorter table: the kept ones stay zero past their end)
            self.tables[slots[i], ends[i] : held[i]] = 0
        values = np.fromiter(chain.from_iterable(r.block_table for r in rows), np.int64, int(sent.sum()))
        row_of = np.repeat(np.arange(len(rows)), sent)
        cols = np.arange(values.size) - np.repeat(np.cumsum(sent) - sent, sent) + froms[row_of]
        mine = kept[row_of]
        self.tables[slots[row_of[mine]], cols[mine]] = values[mine]
        self.lens[slots[kept]], self.owners[slots[kept]] = ends[kept], ids[kept]
        if kept.all():
            return self.tables[slots, :width], ends
        out = np.zeros((len(rows), width), np.int64)
        out[kept] = self.tables[slots[kept], :width]
        out[row_of[~mine], cols[~mine]] = values[~mine]
        return out, ends

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
        self.lens = np.concatenate([self.lens, np.zeros(more, np.int64)])
        self.owners = np.concatenate([self.owners, np.full(more, None, object)])

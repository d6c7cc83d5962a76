"""A row sends only the blocks its slot lacks (gpu/runner/slot_tables.py, BlockManager.unsent): the tables the
runner resolves equal the sequences' whole tables through appends, lookahead trimmed, frees, forks and slots
reused, against the BlockManager's own tables; a row that skips blocks is refused. The engine's every test runs
on these rows (the scheduler builds them so); the engine on static buffers (tests/test_triton_engine.py) fails if
a graph's pad rows kept a slot's table."""

from __future__ import annotations

import random

import numpy as np
import pytest

from actors.engine.block_manager import BlockManager
from actors.engine.request import EngineRequest
from gpu.batch import ScheduledRow
from gpu.runner.slot_tables import SlotTables, TablesDisagree
from messages.sampling_params import SamplingParams


def row(seq: EngineRequest, blocks: BlockManager) -> ScheduledRow:
    sent, tail = blocks.unsent(seq)
    return ScheduledRow(seq.request_id, seq.slot, [1], seq.num_computed_tokens, tail, True, blocks_from=sent)


def test_random_lives_of_sequences_resolve_to_their_whole_tables():
    rng, blocks, tables = random.Random(5), BlockManager(400, 4), SlotTables()
    seqs = [EngineRequest(f"r{i}", [1] * rng.randrange(1, 30), SamplingParams()) for i in range(12)]
    for i, seq in enumerate(seqs):
        seq.slot = i
    sent_total = whole_total = 0
    for step in range(300):
        live = [s for s in seqs if rng.random() < 0.8]
        for seq in live:
            event = rng.random()
            if event < 0.05 and seq.block_table:  # finished / preempted: its slot's next holder starts anew
                blocks.free(seq)
                seq.num_computed_tokens = 0
            elif event < 0.15 and seq.num_computed_tokens > 4:  # lookahead rejected
                seq.num_computed_tokens -= rng.randrange(1, 4)
                blocks.trim(seq)
            if not seq.block_table:
                blocks.allocate(seq, rng.randrange(1, 12))
            else:
                blocks.append_slots(seq, rng.randrange(1, 6))
            seq.num_computed_tokens = min(len(seq.block_table) * 4, seq.num_computed_tokens + rng.randrange(0, 6))
        rows = [row(seq, blocks) for seq in live]
        resolved, lens = tables.resolve(step, rows)
        width = max((len(s.block_table) for s in live), default=0)
        expected = np.zeros((len(live), width), np.int64)
        for i, seq in enumerate(live):
            expected[i, : len(seq.block_table)] = seq.block_table
        assert np.array_equal(resolved, expected) and lens.tolist() == [len(s.block_table) for s in live]
        sent_total += sum(len(r.block_table) for r in rows)
        whole_total += sum(len(s.block_table) for s in live)
    assert sent_total < whole_total / 3  # (what the rows carry: a fraction of the whole tables)


def test_a_forked_sequence_and_literal_rows_send_their_tables_whole():
    blocks, tables = BlockManager(64, 4), SlotTables()
    parent = EngineRequest("p", [1] * 12, SamplingParams())
    parent.slot = 0
    blocks.allocate(parent, 12)
    parent.num_computed_tokens = 12
    tables.resolve(0, [row(parent, blocks)])
    child = EngineRequest("c", [1] * 12, SamplingParams())
    child.slot = 1
    blocks.fork(child, parent, 2)
    first = row(child, blocks)
    assert (first.blocks_from, first.block_table) == (0, parent.block_table[:2])
    pad = ScheduledRow("<pad>", -1, [0], 0, [63], False)  # (a graph's pad row: no slot kept)
    resolved, lens = tables.resolve(1, [first, pad, row(parent, blocks)])
    assert resolved.tolist() == [[*parent.block_table[:2], 0], [63, 0, 0], parent.block_table]
    assert lens.tolist() == [2, 1, 3] and tables.lens[:2] == [3, 2]


def test_rows_that_cannot_fit_the_kept_tables_are_refused():
    tables = SlotTables()
    tables.resolve(0, [ScheduledRow("a", 3, [1], 0, [7, 8], True)])
    with pytest.raises(TablesDisagree, match="step 1: a's row keeps 3 blocks of slot 3, which holds 2 of a"):
        tables.resolve(1, [ScheduledRow("a", 3, [1], 8, [9], True, blocks_from=3)])  # (more than it holds)
    with pytest.raises(TablesDisagree, match="b's row keeps 1 blocks of slot 3, which holds 2 of a"):
        tables.resolve(1, [ScheduledRow("b", 3, [1], 4, [9], True, blocks_from=1)])  # (another request's)
    with pytest.raises(TablesDisagree, match="c's row keeps 1 blocks of slot -1"):
        tables.resolve(1, [ScheduledRow("c", -1, [1], 4, [9], True, blocks_from=1)])  # (a literal row keeps none)
    with pytest.raises(TablesDisagree, match="step 1: two rows of slot 3"):
        tables.resolve(
            1, [ScheduledRow("a", 3, [1], 8, [9], True, blocks_from=2), ScheduledRow("c", 3, [1], 0, [4], True)]
        )
    resolved, _ = tables.resolve(1, [ScheduledRow("b", 3, [1], 0, [9], True)])  # (whole: any request may take it)
    assert resolved.tolist() == [[9]] and tables.tables[3].tolist()[:2] == [9, 0]
    assert SlotTables().resolve(0, [ScheduledRow("<pad>", -1, [0], 0, [5], False)])[0].tolist() == [[5]]

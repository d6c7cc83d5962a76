"""BlockManager: block tables grow with the computed tokens, frees are idempotent, blocks are reused."""

import pytest

from actors.engine.block_manager import BlockManager
from actors.engine.request import EngineRequest
from messages.sampling_params import SamplingParams


def make_request(rid: str, n: int = 3) -> EngineRequest:
    return EngineRequest(rid, list(range(n)), SamplingParams())


def test_allocate_covers_tokens_and_usage():
    bm = BlockManager(num_blocks=8, block_size=4)
    req = make_request("a")
    assert bm.can_allocate([(32, [])]) and not bm.can_allocate([(33, [])])
    bm.allocate(req, 9)
    assert len(req.block_table) == 3 and len(set(req.block_table)) == 3
    assert bm.num_free_blocks == 5 and bm.usage == pytest.approx(3 / 8)


def test_append_slots_grows_only_at_block_boundaries():
    bm = BlockManager(num_blocks=4, block_size=4)
    req = make_request("a")
    bm.allocate(req, 4)
    req.num_computed_tokens = 4
    assert bm.may_append(req, 0)
    table = list(req.block_table)
    bm.append_slots(req, 1)  # position 4 opens the second block
    assert req.block_table[:1] == table and len(req.block_table) == 2
    req.num_computed_tokens = 5
    bm.append_slots(req, 3)  # positions 5..7 stay in it
    assert len(req.block_table) == 2 and bm.num_free_blocks == 2
    req.num_computed_tokens = 8
    assert bm.may_append(req, 8) and not bm.may_append(req, 9)
    with pytest.raises(RuntimeError):
        bm.append_slots(req, 9)
    assert bm.num_free_blocks == 2  # a failed append takes nothing


def test_free_is_idempotent_and_blocks_are_reused():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = make_request("a"), make_request("b")
    bm.allocate(a, 8)
    assert bm.num_free_blocks == 0 and not bm.can_allocate([(1, [])])
    blocks = set(a.block_table)
    bm.free(a)
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 4 and bm.usage == 0.0
    bm.allocate(b, 8)
    assert set(b.block_table) == blocks
    bm.free(b)
    assert sorted(bm.free_queue) == [0, 1, 2, 3]


def test_tables_of_live_requests_never_share_blocks():
    bm = BlockManager(num_blocks=10, block_size=3)
    reqs = [make_request(str(i)) for i in range(4)]
    for i, req in enumerate(reqs):
        bm.allocate(req, 2 + 2 * i)
    bm.free(reqs[1])
    bm.allocate(reqs[1], 7)
    used = [blk for r in reqs for blk in r.block_table]
    assert len(used) == len(set(used)) == bm.num_blocks - bm.num_free_blocks


def test_invalid_sizes_rejected():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 0)

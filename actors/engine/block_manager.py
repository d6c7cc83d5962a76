"""BlockManager: the paged KV cache's free list and per-request block tables (no prefix caching).

A request's `block_table` always covers its `num_computed_tokens` (tokens computed or scheduled);
before a step the scheduler grows it to cover the tokens it is about to feed.
"""

from __future__ import annotations

from collections import deque

from actors.engine.request import Companion, EngineRequest


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int, companion_tokens: int = 0) -> bool:
        """Whether a request without blocks (and its CFG companion) could get blocks for their first tokens."""
        return self.num_blocks_for(num_tokens) + self.num_blocks_for(companion_tokens) <= self.num_free_blocks

    def allocate(self, request: EngineRequest, num_tokens: int) -> None:
        """Give a request without blocks the blocks for its first `num_tokens` tokens."""
        assert not request.block_table and request.num_computed_tokens == 0, request.request_id
        self.append_slots(request, num_tokens)

    def may_append(self, request: EngineRequest, num_new_tokens: int, companion_tokens: int = 0) -> bool:
        """Whether the request (and its CFG companion) can grow by that many tokens."""
        missing = self._num_missing(request, num_new_tokens)
        if companion_tokens:
            missing += self._num_missing(request.companion, companion_tokens)
        return missing <= self.num_free_blocks

    def append_slots(self, request: EngineRequest | Companion, num_new_tokens: int) -> None:
        """Grow the block table to cover num_computed_tokens + num_new_tokens tokens."""
        missing = self._num_missing(request, num_new_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: {request.request_id} needs {missing}, {self.num_free_blocks} free")
        request.block_table.extend(self.free_block_ids.popleft() for _ in range(missing))

    def trim(self, request: EngineRequest) -> None:
        """Return the blocks past those covering num_computed_tokens (speculative lookahead not kept)."""
        keep = self.num_blocks_for(request.num_computed_tokens)
        self.free_block_ids.extend(request.block_table[keep:])
        del request.block_table[keep:]

    def free(self, request: EngineRequest | Companion) -> None:
        """Return the sequence's blocks to the free list (idempotent)."""
        self.free_block_ids.extend(request.block_table)
        request.block_table = []

    def _num_missing(self, request: EngineRequest | Companion, num_new_tokens: int) -> int:
        needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(request.block_table))

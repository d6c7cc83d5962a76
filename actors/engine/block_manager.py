"""BlockManager: the paged KV cache's blocks, per-sequence block tables, and automatic prefix caching (DESIGN 5b).

A sequence's `block_table` always covers its `num_computed_tokens` (tokens computed or scheduled); before a step
the scheduler grows it to cover the tokens it is about to feed.

Prefix caching (on unless `enable_caching=False`):
- A block is identified by a hash chained over its tokens and its parent block's hash (blake2b, 128 bits: a
  crafted collision could read another request's KV); a request's `cache_salt` and LoRA adapter stand for the first
  block's parent, so only requests with the same salt and adapter share (a tenant cannot probe another's prompts
  by timing). The chain is actors/prefix_hash.py's, which the replica router shares: `anchors` (8-byte truncations
  of the cached blocks at chain depths 2^i - 1) tell it which prefixes this cache holds. A KV entry depends on the
  token prefix and the adapter alone (one base model per engine), so any two sequences with the same token prefix
  (salt and adapter) share it, a CFG companion and its request included.
- A block is registered (cached) once it is full of known tokens (prompt and emitted output: never a pending
  sample or a draft) all of which are computed or scheduled: `cache_full_blocks`, after every row is planned. The
  device runs steps in order, so a block registered at scheduling is written before any later step reads it; a
  block being prefilled is not full, or its tokens are not all scheduled, so it is not shared yet.
- Several blocks may hold one hash (identical prompts prefilled in one step, before either was a hit): each is
  registered, a hit takes one in use if any (else the first registered), and evicting one leaves the others hits.
- A cached block is never written again: its tokens are below every sharer's `num_computed_tokens` (a request
  that takes cached blocks computes from their end; rollback and re-prefill only touch positions past its known
  tokens or in blocks of its own).
- Reference counts: each sequence whose table holds a block counts once. A block whose count drops to 0 goes to
  the free queue (oldest first), keeping its hash: it is evictable but still a hit until allocation takes it.
  A sequence's blocks are queued last block first, so its tail is evicted before its head.
- Idle invariant: no block referenced; every block free, cached or not. `ledger_error` checks the counts against
  every block table (the scheduler, after a request failed alone: actors/engine/isolation.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from actors.engine.request import Companion, EngineRequest
from actors.prefix_hash import ANCHOR_BYTES, extend, is_anchor

Sequence = EngineRequest | Companion  # (or a beam search's Beam: actors/engine/beams.py)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest first
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # hash -> the blocks holding it, first registered first (two identical prompts prefilled in one step hold
        # one each; a hit takes one in use, else the first): evicting one leaves the others hits. A list: 88 bytes
        # a hash (a dict's 224), 17 MB at 190k blocks (SmolLM2's KV in 70 GB)
        self.cached: dict[bytes, list[int]] = {}
        self.anchors: set[bytes] = set()  # the cached blocks' at anchor depths, truncated (actors/prefix_hash.py)
        self.queries = self.hits = 0  # prompt tokens looked up, and found cached (metrics)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---------------------------------------------------------------- prefix hits

    def computed_blocks(self, seq: Sequence, usable: bool = True) -> list[int]:
        """The longest run of cached blocks holding the sequence's known tokens from the start, leaving at least
        its last token to compute (it must be fed to sample); none when caching is off or not `usable`."""
        if not (self.enable_caching and usable):
            return []
        tokens = seq.all_token_ids
        hits = []
        for h in self._hashes(seq, tokens, (len(tokens) - 1) // self.block_size):
            holders = self.cached.get(h)
            if holders is None:
                break
            hits.append(next((b for b in holders if self.ref_counts[b]), holders[0]))  # (one in use: no free one taken)
        return hits

    def prefix_hits(self, req: EngineRequest) -> list[list[int]]:
        """Each of the request's sequences' cached prefix blocks, its num_computed_tokens set past them (a request
        asking for prompt logprobs needs every prompt position computed: no hits)."""
        hits = []
        for seq in req.sequences:
            blocks = self.computed_blocks(seq, usable=seq is not req or req.params.prompt_logprobs is None)
            seq.num_computed_tokens = len(blocks) * self.block_size
            hits.append(blocks)
        return hits

    def can_allocate(self, plan: list[tuple[int, list[int]]]) -> bool:
        """Whether sequences without blocks (a request's: its CFG companion, its beams), each taking its `hits` first,
        can get blocks for their (num_tokens, hits) more tokens: new blocks, and hit blocks that leave the free
        queue, come out of it."""
        need = sum(self.num_blocks_for(len(b) * self.block_size + n) - len(b) for n, b in plan)
        need += len({b for _, hits in plan for b in hits if not self.ref_counts[b]})  # (a block two hit counts once)
        return need <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> None:
        """Give a sequence without blocks its cached prefix `hits` (already counted in num_computed_tokens) and
        blocks for `num_tokens` more tokens."""
        assert not seq.block_table and seq.num_computed_tokens == len(hits) * self.block_size, seq.request_id
        for block in hits:
            if not self.ref_counts[block]:
                del self.free_queue[block]
            self.ref_counts[block] += 1
        seq.block_table, seq.sent_blocks = list(hits), 0
        self.append_slots(seq, num_tokens)

    def forget_cache(self) -> None:
        """Nothing cached is valid any more (the worker holding the KV was lost)."""
        self.cached.clear()
        self.anchors.clear()
        self.block_hash = [None] * self.num_blocks

    def ledger_error(self, tables: Iterable[list[int]]) -> str | None:
        """What is inconsistent, given every sequence's block table (O(blocks); after a failure, never per step):
        each block's reference count is the number of tables holding it, and it is in the free queue iff none does."""
        counts = [0] * self.num_blocks
        for table in tables:
            for block in table:
                counts[block] += 1
        if counts != self.ref_counts:
            return "a block's reference count is not the number of block tables holding it"
        if len(self.free_queue) != counts.count(0) or any(counts[block] for block in self.free_queue):
            return "the free queue is not the unreferenced blocks"
        return None

    # ---------------------------------------------------------------- growth and release

    def may_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the sequence can grow by that many tokens."""
        return self._num_missing(seq, num_new_tokens) <= self.num_free_blocks

    def may_grow(self, plan: list[tuple[Sequence, int]]) -> bool:
        """Whether a request's sequences (itself, its CFG companion; a beam group's beams) can grow by their counts."""
        missing = 0
        for seq, n in plan:
            missing += self._num_missing(seq, n)
        return missing <= len(self.free_queue)

    def grow(self, plan: list[tuple[Sequence, int]]) -> None:
        """append_slots for each sequence of the plan (what may_grow checked)."""
        for seq, n in plan:
            self.append_slots(seq, n)

    def try_grow(self, plan: list[tuple[Sequence, int]]) -> bool:
        """Grow the plan's sequences if all of it fits: whether it did (a decode row needs a block in 1 step of 16)."""
        missing = 0
        for seq, n in plan:
            missing += self._num_missing(seq, n)
        if missing > len(self.free_queue):
            return False
        if missing:
            self.grow(plan)
        return True

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the block table to cover num_computed_tokens + num_new_tokens tokens (evicting cached blocks from
        the front of the free queue as needed)."""
        missing = self._num_missing(seq, num_new_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: {seq.request_id} needs {missing}, {self.num_free_blocks} free")
        for _ in range(missing):
            block, _ = self.free_queue.popitem(last=False)
            if (h := self.block_hash[block]) is not None:
                holders = self.cached[h]
                holders.remove(block)
                if not holders:  # (the last block holding it)
                    del self.cached[h]
                    self.anchors.discard(h[:ANCHOR_BYTES])
                self.block_hash[block] = None
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def fork(self, seq: Sequence, parent: Sequence, num_blocks: int) -> None:
        """Give a sequence without blocks the parent's first `num_blocks` blocks, full ones, shared (a beam search's
        fork: both compute only past them, so neither writes them again)."""
        assert not seq.block_table and num_blocks * self.block_size <= parent.num_computed_tokens, seq.request_id
        seq.block_table, seq.block_hashes = parent.block_table[:num_blocks], parent.block_hashes[:num_blocks]
        seq.sent_blocks = 0
        for block in seq.block_table:
            self.ref_counts[block] += 1
        seq.num_computed_tokens = num_blocks * self.block_size

    def unsent(self, seq: Sequence) -> tuple[int, list[int]]:
        """A row's (blocks_from, block_table): the blocks its slot's rows have not sent (gpu/runner/slot_tables.py),
        counted sent from now on. Every change of a table is here: appended blocks are sent next, a trimmed table
        sends from its new end, a new one (allocated, forked, after a free) whole."""
        assert seq.sent_blocks <= len(seq.block_table), seq.request_id
        sent, seq.sent_blocks = seq.sent_blocks, len(seq.block_table)
        return sent, seq.block_table[sent:]

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's blocks that are full of known, computed-or-scheduled tokens (module docstring):
        the newest first, down to one registered already (a block whose hash others hold too, as a prefill beside an
        identical one, is one more holder of it). O(1) while the newest full block is registered (every decode step
        but one in block_size)."""
        if not self.enable_caching:
            return
        full = min(seq.num_computed_tokens, seq.num_known_tokens) // self.block_size
        if not full or self.block_hash[seq.block_table[full - 1]] is not None:
            return
        hashes = self._hashes(seq, seq.all_token_ids, full)
        for i in range(full - 1, -1, -1):
            block, h = seq.block_table[i], hashes[i]
            if self.block_hash[block] is not None:
                break
            self.block_hash[block] = h
            self.cached.setdefault(h, []).append(block)
            if is_anchor(i):
                self.anchors.add(h[:ANCHOR_BYTES])

    def trim(self, seq: Sequence) -> None:
        """Return the blocks past those covering num_computed_tokens (speculative lookahead not kept)."""
        keep = self.num_blocks_for(seq.num_computed_tokens)
        self._release(seq.block_table[keep:])
        del seq.block_table[keep:]
        seq.sent_blocks = min(seq.sent_blocks, keep)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks (idempotent); cached ones stay hits until evicted."""
        self._release(seq.block_table)
        seq.block_table, seq.sent_blocks = [], 0

    def _release(self, blocks: list[int]) -> None:
        for block in reversed(blocks):  # the tail is evicted first
            self.ref_counts[block] -= 1
            if not self.ref_counts[block]:
                self.free_queue[block] = None

    def _num_missing(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def _hashes(self, seq: Sequence, tokens: list[int], n: int) -> list[bytes]:
        """The chained hashes of the sequence's first n full blocks (computed once per block, kept on it)."""
        return extend(seq.block_hashes, tokens, self.block_size, n, seq.prefix_root)

"""Automatic prefix caching: the block manager's hash chain, registration, reference counts and LRU eviction
(unit), and the scheduler with caching on against the unbatched oracle on workloads that share prefixes, under
chunked prefill, preemption, one-ahead scheduling, speculation and aborts (tests.scheduler_harness: the fake
model reads every context back through the block tables, so a wrong shared block changes the output)."""

from __future__ import annotations

import random

import pytest

from actors.engine.block_manager import BlockManager
from actors.engine.request import Companion, EngineRequest
from messages.sampling_params import SamplingParams
from tests.scheduler_harness import EOS, VOCAB, Harness, expected

BS = 4


def request(rid: str, prompt: list[int]) -> EngineRequest:
    return EngineRequest(rid, list(prompt), SamplingParams())


def computed(bm: BlockManager, req: EngineRequest, n: int) -> None:
    """Allocate a request's first n tokens (taking its hits) and register its full blocks."""
    hits = bm.computed_blocks(req)
    req.num_computed_tokens = len(hits) * bm.block_size
    bm.allocate(req, n - req.num_computed_tokens, hits)
    req.num_computed_tokens = n
    bm.cache_full_blocks(req)


def test_hash_chain():
    bm = BlockManager(16, BS, enable_caching=True)
    a, b, c = (
        request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]),
        request("b", [1, 2, 3, 4, 5, 6, 7, 8]),
        request("c", [0, 2, 3, 4, 5, 6, 7, 8]),
    )
    ha, hb, hc = (bm._hashes(r, r.all_token_ids, 2) for r in (a, b, c))
    assert ha == hb and len(set(ha)) == 2  # same tokens, same chain; blocks differ
    assert hc[0] != ha[0] and hc[1] != ha[1]  # a different first block changes every later hash
    assert a.block_hashes == ha  # computed once, kept on the sequence


def test_registration_hits_and_the_last_token():
    """Only full blocks of computed, known tokens are registered; a hit leaves the last prompt token to compute."""
    bm = BlockManager(16, BS, enable_caching=True)
    a = request("a", list(range(10)))  # two full blocks and a partial one
    computed(bm, a, 6)  # mid prefill: one block full and computed
    assert len(bm.cached) == 1
    bm.append_slots(a, 4)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    assert len(bm.cached) == 2  # the partial third block is not
    b = request("b", [*range(10), 99])
    assert bm.computed_blocks(b) == a.block_table[:2]
    same = request("same", list(range(8)))  # exactly two blocks: the second must be recomputed for its last token
    assert bm.computed_blocks(same) == a.block_table[:1]
    assert bm.computed_blocks(b, usable=False) == []  # prompt logprobs
    assert BlockManager(16, BS).computed_blocks(b) == []  # caching off


def test_blocks_register_as_they_fill_and_again_after_the_cache_is_forgotten():
    """Decoding registers each block as it fills (a later prompt with those tokens hits them all); a block whose hash
    another block holds is a second holder of it (hits take the first); once the cache is forgotten (a failure:
    isolation.py), the sequence's next registration gives back every full block it holds, not only the newest."""
    bm = BlockManager(32, BS, enable_caching=True)
    a, twin = request("a", list(range(6))), request("twin", list(range(6)))
    computed(bm, a, 6)
    bm.allocate(twin, 6)  # (admitted beside a's prefill, before a's blocks registered: no hits)
    twin.num_computed_tokens = 6
    bm.cache_full_blocks(twin)  # its first block's hash is a's block's
    assert list(bm.cached[a.block_hashes[0]]) == [a.block_table[0], twin.block_table[0]]
    assert bm.block_hash[twin.block_table[0]] == a.block_hashes[0]
    for token in range(100, 110):  # a decodes: each block registers as it fills
        a.output_token_ids.append(token)
        bm.append_slots(a, 1)
        a.num_computed_tokens += 1
        bm.cache_full_blocks(a)
    assert len(a.block_table) == 4 and holders(bm) == {*a.block_table[:4], twin.block_table[0]}
    assert bm.computed_blocks(request("b", [*a.all_token_ids, 7])) == a.block_table[:4]
    bm.forget_cache()
    bm.cache_full_blocks(a)
    assert holders(bm) == set(a.block_table[:4])


def holders(bm: BlockManager) -> set[int]:
    return {block for blocks in bm.cached.values() for block in blocks}


def test_a_twin_prefill_keeps_the_chain_when_the_first_holder_is_evicted():
    """x and y share a prompt, admitted together (no hits): x registers blocks 0-3 (first chunk), y (one chunk) all
    eight of its own, a second holder of 0-3; x ends and is evicted from its block 3 up: y's blocks are still hits,
    the whole chain. (Before, a block whose hash another held was never registered: x's eviction left a hole at 3,
    which only a later request computing it filled.)"""
    bm = BlockManager(16, BS, enable_caching=True)
    prompt = list(range(33))
    x, y = request("x", prompt), request("y", prompt)
    bm.allocate(x, 16)
    x.num_computed_tokens = 16
    bm.cache_full_blocks(x)
    bm.allocate(y, 32)
    y.num_computed_tokens = 32
    bm.cache_full_blocks(y)
    bm.append_slots(x, 16)
    x.num_computed_tokens = 32
    bm.cache_full_blocks(x)
    bm.free(x)
    z = request("z", [99] * 20)
    bm.allocate(z, 20)  # evicts x's blocks 7..3
    bm.free(z)
    c = request("c", prompt)
    assert bm.computed_blocks(c) == y.block_table[:8]  # (x's 0-2 are cached and free: y's, in use, are taken)


def test_reference_counts_and_lru_eviction():
    """Shared blocks are counted per holder; freed blocks queue tail first and keep hitting until evicted, oldest
    first; the idle invariant is every block free."""
    bm = BlockManager(6, BS, enable_caching=True)
    a = request("a", list(range(13)))
    computed(bm, a, 13)  # blocks 0-3, 0-2 registered (full)
    b = request("b", [*range(13), 50])
    computed(bm, b, 14)  # a's 3 cached blocks + block 4
    assert (a.block_table, b.block_table, bm.num_free_blocks) == ([0, 1, 2, 3], [0, 1, 2, 4], 1)
    bm.free(a)
    assert bm.num_free_blocks == 2 and bm.computed_blocks(request("c", list(range(13)))) == [0, 1, 2]
    bm.free(b)  # the queue: 5 (never used), 3, then b's blocks tail first: 4, 2, 1, 0
    assert list(bm.free_queue) == [5, 3, 4, 2, 1, 0] and all(c == 0 for c in bm.ref_counts)
    d = request("d", [7] * 12)
    computed(bm, d, 12)  # three blocks from the front: 5, 3, 4 (uncached), then cached block 2 is evicted
    assert d.block_table == [5, 3, 4] and bm.computed_blocks(request("e", list(range(13)))) == [0, 1, 2]
    f = request("f", [8] * 4)
    computed(bm, f, 4)
    assert f.block_table == [2] and bm.computed_blocks(request("e", list(range(13)))) == [0, 1]  # the tail went
    for r in (d, f):
        bm.free(r)
    assert bm.num_free_blocks == bm.num_blocks and all(c == 0 for c in bm.ref_counts)


def shared_prompts(n: int, seed: int) -> list[list[int]]:
    """Multi-turn chats and a common system prompt: each prompt extends one of a few shared prefixes."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB - 1) for _ in range(9)]
    out = []
    for _ in range(n):
        base = rng.choice([system, *(p for p in out[-3:] if len(p) < 24)])
        out.append(base + [rng.randrange(VOCAB - 1) for _ in range(rng.randint(1, 8))])
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("one_ahead", [False, True], ids=["sync", "one_ahead"])
@pytest.mark.parametrize("num_blocks", [64, 12], ids=["roomy", "preempting"])
def test_outputs_equal_the_oracle_with_sharing(seed, one_ahead, num_blocks):
    """Prompts sharing prefixes arrive over time, some aborted, on a 12-token budget (chunked prefill): every
    output equals the unbatched oracle, the cache hits, and the engine ends idle (no block referenced)."""
    rng = random.Random(seed)
    h = Harness(one_ahead=one_ahead, num_blocks=num_blocks, max_num_seqs=4, budget=12, max_model_len=48, caching=True)
    reqs = []
    for i, prompt in enumerate(shared_prompts(16, seed)):
        p = {"max_tokens": rng.randint(1, 12), "ignore_eos": rng.random() < 0.5}
        reqs.append((f"r{i}", prompt, p, rng.randint(0, 40), rng.choice([None, None, None, rng.randint(0, 50)])))
    h.traffic(reqs, 150)
    for rid, prompt, p, *_ in reqs:
        want = expected(prompt, SamplingParams(**p), 48, (EOS,))
        if rid in h.finish:
            assert (h.tokens[rid], h.finish[rid]) == want, rid
        else:
            assert rid in h.acks and h.tokens[rid] == want[0][: len(h.tokens[rid])]
    assert h.sched.block_manager.hits > 0
    if num_blocks == 12:
        assert h.sched.num_preemptions > 0


def test_speculation_with_caching():
    """Drafts (some wrong) are fed and rolled back: a block holding a rejected draft is never registered, and
    outputs equal the oracle."""
    from tests.scheduler_harness import next_token

    def noisy(req, k):
        seq = req.all_token_ids
        drafts = []
        for j in range(k):
            drafts.append(next_token(seq + drafts) if j % 2 == 0 else 5)
        return drafts

    h = Harness(one_ahead=False, num_blocks=40, max_num_seqs=4, budget=24, proposer=noisy, caching=True)
    prompts = shared_prompts(8, 7)
    for i, prompt in enumerate(prompts):
        h.add(f"r{i}", prompt, max_tokens=15, ignore_eos=True)
    h.run()
    for i, prompt in enumerate(prompts):
        assert h.tokens[f"r{i}"] == expected(prompt, SamplingParams(max_tokens=15, ignore_eos=True), 64)[0]
    assert h.sched.block_manager.hits > 0


def test_a_long_shared_prefix_computes_only_its_tail():
    """A second request with the same 1,000-token prefix reports >= 992 cached tokens and its rows feed only the
    rest (counted from the scheduled rows)."""
    h = Harness(num_blocks=600, block_size=16, max_num_seqs=2, budget=2048, max_model_len=1100, caching=True)
    prefix = [random.Random(1).randrange(VOCAB - 1) for _ in range(1000)]
    h.add("first", [*prefix, 1, 2, 3], max_tokens=2, ignore_eos=True)
    h.run()
    start = len(h.batches)
    h.add("second", [*prefix, 4, 5], max_tokens=2, ignore_eos=True)
    req = h.sched.requests["second"]
    h.run()
    fed = sum(len(r.token_ids) for b in h.batches[start:] for r in b.rows)
    assert req.num_cached_tokens >= 992 and fed == 1002 - req.num_cached_tokens + 1  # the tail, then one decode
    assert h.tokens["second"] == expected([*prefix, 4, 5], SamplingParams(max_tokens=2, ignore_eos=True), 1100)[0]


def test_a_companion_keeps_its_cached_prefix_while_its_parent_takes_new_blocks():
    """A guided request's companion hits its negative prompt's cached blocks at the front of the free queue, and
    its parent's new blocks come from that front: admission takes every hit before any new block (it once gave
    the parent the companion's hits, evicted, and the companion read the parent's prompt as its own; the harness
    checks every row's context after each step)."""
    h = Harness(num_blocks=6, block_size=4, max_num_seqs=2, budget=32, max_model_len=20, caching=True)
    negative = list(range(10, 19))  # two full blocks and one token
    h.add("x", negative, max_tokens=1, ignore_eos=True)  # blocks 0-2, freed first
    h.add("y", list(range(40, 49)), max_tokens=3, ignore_eos=True)  # blocks 3-5, freed after x's
    h.run()
    assert list(h.sched.block_manager.free_queue) == [2, 1, 0, 5, 4, 3]
    start = len(h.batches)
    h.add("b", list(range(60, 69)), negative, max_tokens=2, ignore_eos=True)  # the parent needs three new blocks
    h.run()
    companion = next(r for r in h.batches[start].rows if r.guidance_scale is not None)
    assert companion.num_computed == 8 and companion.block_table[:2] == [0, 1]  # x's cached blocks, kept
    assert h.tokens["b"] == expected(list(range(60, 69)), SamplingParams(max_tokens=2, ignore_eos=True), 20)[0]


def test_a_cache_salt_shares_only_with_the_same_salt():
    """vLLM's cache_salt: the salt stands for the first block's parent, so the same tokens under another salt (or
    none) are another chain; a CFG companion salts with its request's."""
    bm = BlockManager(16, BS, enable_caching=True)

    def salted(rid: str, salt: str | None) -> EngineRequest:
        return EngineRequest(rid, list(range(9)), SamplingParams(cache_salt=salt))

    a = salted("a", "tenant-1")
    computed(bm, a, 9)
    assert bm.computed_blocks(salted("b", "tenant-1")) == a.block_table[:2]
    assert bm.computed_blocks(salted("c", "tenant-2")) == [] and bm.computed_blocks(salted("d", None)) == []
    plain = salted("e", None)
    computed(bm, plain, 9)
    assert bm.computed_blocks(salted("f", None)) == plain.block_table[:2]
    assert bm.computed_blocks(Companion(salted("g", "tenant-1"), list(range(9)))) == a.block_table[:2]

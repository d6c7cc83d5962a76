"""Scheduler progress (actors/engine/scheduler.py, "Progress"), on caches too small for the workload to run at once:
every admitted request ends within the workload's step bound (Harness.step_bound) with the unbatched oracle's
tokens; a CFG pair that may outgrow the whole cache is refused before it runs (it used to preempt everyone, then
itself, and re-prefill forever); the oldest request keeps its blocks; drafts never cost a row (tests.scheduler_harness).
"""

import copy
from types import SimpleNamespace

import pytest

from actors.engine.block_manager import BlockManager
from actors.engine.config import EngineConfig
from actors.engine.guidance import guidance_error
from messages.sampling_params import ParamError, SamplingParams
from tests.scheduler_harness import VOCAB, Harness, chain, expected

# (prompt, negative prompt, max_tokens, max_model_len, blocks of 4 tokens the pair holds at its longest), by hand:
# each half holds its prompt and its output but the last token; the output ends at max_tokens or where the longer
# prompt reaches max_model_len
PAIRS = [
    (13, 6, 8, 32, 9),  # 13 + 7 = 20 tokens: 5 blocks; 6 + 7 = 13: 4
    (5, 20, 100, 32, 12),  # 12 output tokens (20 + 12 = 32): 5 + 11 = 16 tokens, 4 blocks; 20 + 11 = 31, 8
    (9, 1, 40, 32, 14),  # 23 output tokens (BOS alone as the negative prompt): 9 + 22 = 31, 8 blocks; 1 + 22, 6
]


def ids(n: int, first: int) -> list[int]:
    return [(first + i) % (VOCAB - 1) for i in range(n)]


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("one_ahead", [False, True])
@pytest.mark.parametrize(("prompt", "negative", "max_tokens", "max_model_len", "need"), PAIRS)
def test_a_pair_that_may_outgrow_the_cache_is_refused_and_one_that_fits_it_runs(
    one_ahead, caching, prompt, negative, max_tokens, max_model_len, need
):
    """With one block fewer than the pair needs at its longest, it is refused (guidance_scale named, with the
    numbers) and a plain request beside it runs; it used to be admitted, and then did not end in any number of
    steps. With exactly the blocks it needs, it runs beside the plain request and, at its end, fills the cache."""
    plain = SamplingParams(max_tokens=20, ignore_eos=True)
    for blocks in (need - 1, need):
        h = Harness(one_ahead, blocks, 4, budget=8, max_model_len=max_model_len, caching=caching)
        h.add("plain", ids(6, 40), max_tokens=20, ignore_eos=True)
        refusal = None
        try:
            h.add("pair", ids(prompt, 0), ids(negative, 60), max_tokens=max_tokens, ignore_eos=True)
        except ParamError as e:
            refusal = e
        h.run(h.step_bound())
        assert (h.tokens["plain"], h.finish["plain"]) == expected(ids(6, 40), plain, max_model_len)
        if blocks < need:
            assert refusal.param == "guidance_scale" and f"needs {need} KV blocks" in str(refusal), refusal
            assert f"the KV cache has {blocks}" in str(refusal) and "pair" not in h.tokens
        else:
            assert refusal is None and h.peak_blocks == need  # (the count is exact: the pair fills the cache)
            overhang = max(0, negative - prompt)  # (the companion reaches max_model_len first)
            want = expected(
                ids(prompt, 0), SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_model_len - overhang
            )
            assert (h.tokens["pair"], h.finish["pair"]) == want


def test_the_intake_refuses_the_pair_naming_guidance_scale():
    """guidance_error, the engine intake's check, refuses what the scheduler would (the first and last PAIRS cases;
    without a negative prompt the companion is BOS alone)."""
    config = EngineConfig(model="m", block_size=4, max_model_len=32)
    model = SimpleNamespace(bos_token_id=1, max_model_len=32)
    params = SamplingParams(max_tokens=8, guidance_scale=2.0)
    params.negative_prompt_token_ids = ids(6, 60)
    assert guidance_error(params, config, model, 13, BlockManager(9, 4)) is None
    refusal = guidance_error(params, config, model, 13, BlockManager(8, 4))
    assert refusal.param == "guidance_scale" and "needs 9 KV blocks" in str(refusal)
    bos = SamplingParams(max_tokens=40, guidance_scale=2.0)
    assert guidance_error(bos, config, model, 9, BlockManager(14, 4)) is None
    assert "needs 14 KV blocks" in str(guidance_error(bos, config, model, 9, BlockManager(13, 4)))


def test_the_oldest_request_waits_for_blocks_freed_in_flight_rather_than_preempt_itself():
    """One ahead: the oldest request, whose end needs the whole cache, reaches a block boundary with no block free
    just as the younger request holding the rest is aborted with a step in flight (its blocks are freed when that
    step reports). The oldest waits for them, keeping its own; it used to preempt itself and recompute."""
    h = Harness(one_ahead=True, num_blocks=8, block_size=4, max_model_len=32)
    h.add("old", ids(4, 0), max_tokens=27, ignore_eos=True)  # 4 + 26 = 30 tokens at its end: 8 blocks
    h.add("young", ids(4, 50), max_tokens=27, ignore_eos=True)
    old, bm = h.requests["old"], h.sched.block_manager
    while not (bm.num_free_blocks == 0 and old.num_computed_tokens == 4 * len(old.block_table)):
        h.step()
    assert h.requests["young"].num_inflight_steps and h.sched.abort("young")
    h.run(h.step_bound())
    assert h.sched.num_preemptions == 0 and h.acks == ["young"]
    assert (h.tokens["old"], h.finish["old"]) == expected(ids(4, 0), SamplingParams(max_tokens=27, ignore_eos=True), 32)


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("one_ahead", [False, True])
@pytest.mark.parametrize("guided", [False, True])
def test_n_choices_each_needing_the_whole_cache_end_oldest_first(one_ahead, caching, guided):
    """n = 5 choices (separate requests) of one prompt, each needing the whole cache at its end (plain: 6 + 23 = 29
    tokens, 8 blocks of 4; guided against BOS alone: 6 + 11 = 17 tokens, 5 blocks, and 1 + 11 = 12, 3): the
    youngest are preempted, the oldest ends first, all within the bound with the oracle's tokens."""
    max_tokens = 12 if guided else 24
    h = Harness(one_ahead, num_blocks=8, block_size=4, max_model_len=32, caching=caching)
    for i in range(5):
        h.add(f"c{i}", ids(6, 0), [1] if guided else None, max_tokens=max_tokens, ignore_eos=True)
    h.run(h.step_bound())
    assert list(h.finish) == [f"c{i}" for i in range(5)] and h.sched.num_preemptions > 0
    want = expected(ids(6, 0), SamplingParams(max_tokens=max_tokens, ignore_eos=True), 32)
    assert all((h.tokens[f"c{i}"], h.finish[f"c{i}"]) == want for i in range(5))


def drafts_right_then_wrong(req, k: int) -> list[int]:
    """k drafts: the model's own next tokens but the last (so each row accepts k - 1 of them)."""
    right = chain(req.all_token_ids, k)
    return [*right[:-1], (right[-1] + 1) % VOCAB]


@pytest.mark.parametrize("one_ahead", [False, True])
def test_drafts_never_cost_a_row_its_tokens_nor_anyone_its_blocks(one_ahead):
    """Each step is also planned without drafts, on a copy of the scheduler: the rows of the requests running feed
    the same tokens of their own, and the same requests are preempted. Four requests (one guided), a budget of 8,
    16 blocks: the first rows' drafts used to take the budget (the others waited out their speculation) and
    blocks a younger row then preempted for."""
    h = Harness(one_ahead, 16, 4, max_num_seqs=5, budget=8, max_model_len=40, proposer=drafts_right_then_wrong)
    for i in range(4):
        h.add(f"r{i}", ids(5 + 3 * i, 10 * i), [1] if i == 1 else None, max_tokens=24, ignore_eos=True)
    drafted = 0
    for _ in range(h.step_bound()):
        if not (h.sched.has_unfinished() or h.queue):
            break
        running = {r.request_id for r in h.sched.running}
        plain = copy.deepcopy(h.sched)
        without = [own_tokens(r) for r in plain.schedule(None).rows if r.request_id in running]
        batch = h.step()
        assert [own_tokens(r) for r in batch.rows if r.request_id in running] == without, batch.step
        assert h.preempted == running - {r.request_id for r in plain.running}, batch.step
        drafted += sum(len(r.draft_token_ids) for r in batch.rows)
    h.run(0)  # (nothing left: within the bound)
    assert drafted > 0 and h.sched.num_preemptions > 0 and h.sched.spec.num_accepted_tokens > 0
    for i in range(4):
        want = expected(ids(5 + 3 * i, 10 * i), SamplingParams(max_tokens=24, ignore_eos=True), 40)
        assert (h.tokens[f"r{i}"], h.finish[f"r{i}"]) == want


def own_tokens(row) -> tuple:
    """What a row feeds of its own sequence: who, from where, which tokens (its drafts left out)."""
    fed = len(row.token_ids) - len(row.draft_token_ids)
    return row.request_id, row.guidance_scale, row.num_computed, row.token_ids[:fed]

"""Beam search in the scheduler (actors/engine/beams.py), against a fake paged-KV model whose next-token distribution
hashes the context it reads back through the block tables: a wrong fork, shared block or recompute changes the
answer. The answers are checked against an exhaustive search (a width that prunes nothing), a reference beam search
written from HF's rule, and greedy decoding (width 1)."""

import math
import random
from fractions import Fraction
from itertools import count

import pytest
from msgspec.structs import replace

from actors.engine.block_manager import BlockManager
from actors.engine.metrics import idle_details
from actors.engine.request import EngineRequest
from actors.engine.scheduler import Scheduler
from gpu.runner.slot_tables import SlotTables
from messages.sampling_params import BeamSearch, SamplingParams
from messages.wire import TokenLogprobs

EOS = 3


def dist(ctx: list[int], vocab: int) -> list[float]:
    """The fake model's next-token logprobs after `ctx` (EOS is token 3, a little less likely than the others)."""
    rng = random.Random(str(ctx))
    logits = [rng.gauss(0.0, 2.0) - 1.5 * (t == EOS) for t in range(vocab)]
    top = max(logits)
    lse = top + math.log(sum(math.exp(x - top) for x in logits))
    return [x - lse for x in logits]


class FakeModel:
    """Writes fed tokens into a paged KV dict; samples greedily (sorted logprobs) from the context read back."""

    def __init__(self, block_size: int, vocab: int):
        self.bs, self.vocab, self.kv, self.tables = block_size, vocab, {}, SlotTables()  # (rows send what slots lack)

    def execute(self, batch) -> tuple[list[int], TokenLogprobs]:
        out = TokenLogprobs(sampled=[], ranks=[], top_ids=[], top_logprobs=[])
        resolved, lens = self.tables.resolve(batch.step, batch.rows)
        tables = [t[:n] for t, n in zip(resolved.tolist(), lens.tolist(), strict=True)]
        for row, table in zip(batch.rows, tables, strict=True):
            for pos, tok in enumerate(row.token_ids, row.num_computed):
                self.kv[table[pos // self.bs], pos % self.bs] = tok
        for row, table in zip(batch.rows, tables, strict=True):  # (a device writes every row's KV before any reads)
            if row.sample:
                end = row.num_computed + len(row.token_ids)
                lps = dist([self.kv[table[p // self.bs], p % self.bs] for p in range(end)], self.vocab)
                order = sorted(range(self.vocab), key=lambda t: -lps[t])
                out.sampled.append(lps[order[0]])
                out.ranks.append(1)
                out.top_ids.append(order)
                out.top_logprobs.append([lps[t] for t in order])
        return [ids[0] for ids in out.top_ids], out


class Engine:
    def __init__(
        self, vocab=4, num_blocks=256, block_size=4, max_num_seqs=8, budget=64, max_model_len=64, caching=False
    ):
        blocks = BlockManager(num_blocks, block_size, caching)
        self.sched = Scheduler(blocks, max_num_seqs, budget, max_model_len, [EOS])
        self.model = FakeModel(block_size, vocab)
        self.answers: dict[str, tuple[list[int], str]] = {}  # a member's whole answer; a plain request's output
        self.acks: list[str] = []
        self.cached: dict[str, int | None] = {}  # each request's num_cached_tokens
        self.ids = count()

    def search(self, prompt, n=1, width=None, max_tokens=6, lp=1.0, es=False, **params) -> list[str]:
        """A prompt's n choices, each a member of one search (as the frontend sends them)."""
        group, rids = f"g{next(self.ids)}", []
        for rank in range(n):
            spec = BeamSearch(width=width or n, length_penalty=lp, early_stopping=es, group=group, rank=rank)
            rid = f"{group}/{rank}"
            p = SamplingParams(max_tokens=max_tokens, beam=spec, **params)
            self.sched.add_request(EngineRequest(rid, list(prompt), p))
            rids.append(rid)
        return rids

    def step(self) -> None:
        batch = self.sched.schedule()
        if batch.rows:
            sampled, lp = self.model.execute(batch)
            for out in self.sched.update(batch, sampled, None, lp):
                tokens, _ = self.answers.get(out.request_id, ([], None))
                assert out.seq == len(tokens) and (out.finish_reason or "/" not in out.request_id)
                self.answers[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
                self.cached[out.request_id] = out.num_cached_tokens
        self.acks += self.drained_now()

    def drained_now(self) -> list[str]:
        """The AbortAcks due now (a request aborted silently has none)."""
        return [r.request_id for r in self.sched.drain_aborted() if r.abort_reason is not None]

    def run(self, max_steps=500) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished(), "livelock"
        assert set(idle_details(self.sched).values()) == {0}, idle_details(self.sched)
        bm = self.sched.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def score(cum, length, lp):  # vLLM's cum / length ** lp: exact for an integer lp (a Fraction: it never overflows)
    return Fraction(cum) / Fraction(length) ** lp


def exhaustive(prompt, max_tokens, lp, vocab=4):
    """Every complete output (ended by EOS, or at max_tokens), best first."""
    found = []

    def walk(out, cum):
        lps = dist(prompt + out, vocab)
        for tok in range(vocab):
            seq, c = [*out, tok], cum + lps[tok]
            if tok == EOS:
                found.append((score(c, len(prompt) + len(seq) - 1, lp), seq, "stop"))
            elif len(seq) == max_tokens:
                found.append((score(c, len(prompt) + len(seq), lp), seq, "length"))
            else:
                walk(seq, c)

    walk([], 0.0)
    return sorted(found, key=lambda h: -h[0])


def reference(prompt, width, max_tokens, lp, es, vocab=4):
    """Beam search as HF's BeamSearchScorer runs it (with vLLM's lengths), over whole contexts."""
    beams, ended = [([], 0.0)], []
    for _ in range(max_tokens):
        ranked = []
        for out, cum in beams:
            lps = dist(prompt + out, vocab)
            ranked += [(cum + lps[t], [*out, t]) for t in sorted(range(vocab), key=lambda t: -lps[t])[: 2 * width]]
        ranked.sort(key=lambda c: -c[0])
        beams = []
        for rank, (cum, seq) in enumerate(ranked):
            if seq[-1] == EOS and rank < width:
                ended.append((score(cum, len(prompt) + len(seq) - 1, lp), seq, "stop"))
            elif seq[-1] != EOS and len(beams) < width:
                beams.append((seq, cum))
        ended = sorted(ended, key=lambda h: -h[0])[:width]
        longest = len(prompt) + (max_tokens if es == "never" and lp > 0 else len(beams[0][0])) if beams else 1
        if not beams or (len(ended) >= width and (es is True or ended[-1][0] >= score(beams[0][1], longest, lp))):
            break  # (done: the running beams do not compete)
        if len(beams[0][0]) == max_tokens:
            ended += [(score(cum, len(prompt) + len(seq), lp), seq, "length") for seq, cum in beams]
            break
    return sorted(ended, key=lambda h: -h[0])[:width]


@pytest.mark.parametrize("lp", [0.0, 1.0, 2.0])
def test_a_width_that_prunes_nothing_finds_the_exhaustive_best(lp):
    """4 tokens, 3 steps: at most 3 x 3 = 9 running beams and 36 candidates, so a width of 36 keeps all of them:
    early_stopping "never" (exact for any length_penalty >= 0) then returns the exhaustive top n."""
    eng = Engine(max_num_seqs=36, num_blocks=512)
    prompt = [1, 2, 0, 1, 2]
    rids = eng.search(prompt, n=5, width=36, max_tokens=3, lp=lp, es="never")
    eng.run()
    best = exhaustive(prompt, 3, lp)[:5]
    assert [eng.answers[r] for r in rids] == [(seq, why) for _, seq, why in best]


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("es", [False, True, "never"])
@pytest.mark.parametrize("lp", [0.0, 1.0, 1.5])
def test_pruning_searches_match_the_reference(lp, es, caching):
    """Widths 2 and 3 over 8 steps, several prompts at once (their searches share the steps): the answers of a
    reference run over whole contexts, in rank order."""
    eng = Engine(vocab=12, caching=caching, max_num_seqs=12)
    prompts = [[1, 2, 0, 1, 2, 0, 1], [0, 0, 1], [2, 1, 0, 2, 1, 0, 2, 1, 0, 1]]
    runs = [
        (p, w, eng.search(p, n=2, width=w, max_tokens=8, lp=lp, es=es)) for p, w in zip(prompts, (2, 3, 3), strict=True)
    ]
    eng.run()
    for prompt, width, rids in runs:
        want = reference(prompt, width, 8, lp, es, vocab=12)
        assert [eng.answers[r] for r in rids] == [(seq, why) for _, seq, why in want[:2]], prompt


def greedy(prompt, max_tokens, vocab):
    out = []
    while len(out) < max_tokens and EOS not in out:
        lps = dist(prompt + out, vocab)
        out.append(max(range(vocab), key=lambda t: lps[t]))
    return out, "stop" if out[-1] == EOS else "length"


def test_width_one_is_greedy_decoding():
    eng = Engine(vocab=12)
    prompts = [[1, 2, 0, 1], [0], [2, 2, 1, 0, 1, 2, 0]]
    rids = [eng.search(p, max_tokens=12)[0] for p in prompts]
    eng.run()
    assert [eng.answers[r] for r in rids] == [greedy(p, 12, 12) for p in prompts]


def test_forked_beams_share_the_prompt_blocks():
    """Once the root forks, every beam's table starts with the prompt's full blocks, each held once per beam."""
    eng = Engine(vocab=12)
    eng.search(list(range(3)) * 3, n=3, max_tokens=8)  # 9 prompt tokens: 2 full blocks
    eng.step()  # the prompt, sampled: the search forks three beams
    (group,) = eng.sched.running
    assert len(group.beams.live) == 3
    heads = {tuple(b.block_table[:2]) for b in group.beams.live}
    assert len(heads) == 1 and [eng.sched.block_manager.ref_counts[b] for b in heads.pop()] == [3, 3]
    # the first child continues its parent in its partial block; the others recompute theirs from the shared end
    assert [(len(b.block_table), b.num_computed_tokens) for b in group.beams.live] == [(3, 9), (2, 8), (2, 8)]
    eng.run()


@pytest.mark.parametrize("caching", [False, True])
def test_a_preempted_search_recomputes_its_beams_and_answers_the_same(caching):
    """Two searches in a KV cache too small for both at their longest: the younger is preempted, recomputes every
    beam (from the prefix cache too), and both answer as searches run alone."""
    prompts = [[0, 1, 2, 0, 1, 2], [2, 1, 0, 2, 1, 0, 2, 1, 0]]
    want = []
    for prompt in prompts:
        alone = Engine(vocab=12)
        want += [alone.answers[r] for r in alone.search(prompt, n=2, width=3, max_tokens=10) if alone.run() or True]
    eng = Engine(vocab=12, num_blocks=14, max_model_len=40, caching=caching)
    rids = [r for prompt in prompts for r in eng.search(prompt, n=2, width=3, max_tokens=10)]
    eng.run()
    assert eng.sched.num_preemptions > 0
    assert [eng.answers[r] for r in rids] == want


def test_a_search_the_worker_lost_recomputes_and_answers_the_same():
    """The worker's KV cache is lost mid-search (a worker death): every beam is recomputed from its tokens."""
    prompt = [2, 1, 0, 2, 1, 0, 2, 1, 0]
    alone = Engine(vocab=12)
    want = alone.search(prompt, n=2, width=3, max_tokens=10)
    alone.run()
    eng = Engine(vocab=12)
    rids = eng.search(prompt, n=2, width=3, max_tokens=10)
    for _ in range(5):
        eng.step()
    eng.sched.forget_device_state()
    eng.model.kv.clear()
    eng.run()
    assert [eng.answers[r] for r in rids] == [alone.answers[r] for r in want]


def test_aborted_members_are_acked_at_once_and_the_last_one_ends_the_search():
    eng = Engine(vocab=12)
    a, b = eng.search([1, 2, 0, 1], n=2, width=2, max_tokens=20)
    eng.step()
    eng.step()
    assert eng.sched.abort(a) and eng.drained_now() == [a]
    eng.step()
    (group,) = eng.sched.running  # b still searches
    assert list(group.beams.members) == [1]
    assert eng.sched.abort(b) and not eng.sched.abort(b)  # (a second abort is late)
    assert eng.drained_now() == [b] and not eng.sched.running
    c, d = eng.search([1, 2, 0, 1], n=2, width=2, max_tokens=20)
    eng.step()
    (group,) = eng.sched.running
    assert eng.sched.abort(group.request_id, "shutdown")  # (what shutdown does): every member acked
    assert sorted(eng.drained_now()) == [c, d]
    eng.run()
    assert not eng.answers


def test_only_the_choices_of_one_search_share_it():
    """Two prompts' choices under one group name (a client's mistake, or the offline API's unnamed searches) and a
    second copy of a rank each get a search of their own."""
    eng = Engine(vocab=12)
    spec = BeamSearch(width=2, group="same")
    for rid, prompt, rank in (("a", [1, 2, 0], 0), ("b", [2, 0, 1], 1), ("c", [1, 2, 0], 0)):
        eng.sched.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=6, beam=replace(spec, rank=rank))))
    assert len(eng.sched.waiting) == 3
    eng.run()
    assert eng.answers["a"] == eng.answers["c"] == tuple(reference([1, 2, 0], 2, 6, 1.0, False, vocab=12)[0][1:])
    assert eng.answers["b"] == tuple(reference([2, 0, 1], 2, 6, 1.0, False, vocab=12)[1][1:])


def test_a_failed_search_fails_each_of_its_choices():
    """A search the worker keeps failing (a poison request) ends each member with the error."""
    eng = Engine(vocab=12)
    a, b = eng.search([1, 2, 0, 1], n=2, max_tokens=8)
    eng.step()
    (group,) = eng.sched.running
    outs = eng.sched.fail(group, "the worker failed 2 steps of this request")
    assert [(o.request_id, o.finish_reason, o.error) for o in outs] == [(r, "error", outs[0].error) for r in (a, b)]
    eng.run()


def test_a_search_reports_the_prompt_tokens_it_found_cached():
    eng = Engine(vocab=12, caching=True)
    prompt = [1, 2, 0] * 4  # (12 tokens: the first 2 blocks are hits, the last must be computed)
    first = eng.search(prompt, n=2, width=2, max_tokens=4)
    eng.run()
    again = eng.search(prompt, n=2, width=2, max_tokens=4)
    eng.run()
    assert [eng.cached[r] for r in first + again] == [0, 0, 8, 8]
    assert [eng.answers[r] for r in first] == [eng.answers[r] for r in again]

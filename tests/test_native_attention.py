"""The native paged attention kernel (gpu/kernels/native/csrc/attention.cpp): each ISA's build against a float64
reference
on awkward shapes (head dims off the vector width, odd block sizes, contexts across the softmax's chunks, grouped
query heads, sliding windows, a soft-cap), with every cache slot no query may read poisoned with NaN, and a NaN or
inf in a key that queries read spreading as in the reference (exactly to the heads that see it); bitwise batch
invariance (a token's result alone as a decode row, in a prefill, a chunk or any batch) and across ISAs; refusals of
metadata that would read outside the cache."""

import math

import pytest
import torch

from gpu.kernels import native

BUILT = [isa for isa in native.cpu_isas() if native.ops(isa) is not None]
pytestmark = pytest.mark.skipif(not BUILT, reason="no native CPU kernels built for this CPU (make setup builds them)")


class Case:
    """Rows of (query count, key count) over a paged cache whose blocks are handed out shuffled; every slot past a
    row's keys, and every block no row holds, is NaN."""

    def __init__(self, rows, heads=4, kv_heads=2, dim=24, block_size=5, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.rows, self.heads, self.kv_heads, self.dim, self.block_size = rows, heads, kv_heads, dim, block_size
        need = [math.ceil(k / block_size) for _, k in rows]
        order = torch.randperm(sum(need) + 3, generator=g)  # (3 blocks nobody holds)
        self.k = torch.full((len(order), block_size, kv_heads, dim), float("nan"))
        self.v = torch.full_like(self.k, float("nan"))
        self.tables = torch.zeros(len(rows), max(need), dtype=torch.int64)
        self.keys, self.values = [], []
        for r, ((_, keys), blocks) in enumerate(zip(rows, need, strict=True)):
            start = sum(need[:r])
            self.tables[r, :blocks] = order[start : start + blocks]
            k, v = (torch.randn(keys, kv_heads, dim, generator=g) for _ in range(2))
            self.keys.append(k), self.values.append(v)
            for j in range(keys):
                b, o = self.tables[r, j // block_size], j % block_size
                self.k[b, o], self.v[b, o] = k[j], v[j]
        self.q = torch.randn(sum(q for q, _ in rows), heads, dim, generator=g)
        self.qsl = torch.tensor([0] + [q for q, _ in rows]).cumsum(0)
        self.seq_lens = torch.tensor([k for _, k in rows])

    def run(self, isa, scale=0.3, window=0, softcap=0.0, q=None):
        args = (self.qsl, self.seq_lens, self.tables, scale, window, softcap)
        return native.ops(isa).paged_attention(self.q if q is None else q, self.k, self.v, *args)

    def reference(self, scale=0.3, window=0, softcap=0.0) -> torch.Tensor:
        out, group = [], self.heads // self.kv_heads
        for (num_q, num_k), k, v, start in zip(self.rows, self.keys, self.values, self.qsl[:-1], strict=True):
            for i in range(num_q):
                p = num_k - num_q + i  # this query's position
                first = max(0, p - window + 1) if window else 0
                kk = k[first : p + 1].double().repeat_interleave(group, 1)  # [keys, heads, dim]
                vv = v[first : p + 1].double().repeat_interleave(group, 1)
                s = torch.einsum("hd,khd->hk", self.q[start + i].double(), kk) * scale
                s = softcap * torch.tanh(s / softcap) if softcap else s
                out.append(torch.einsum("hk,khd->hd", s.softmax(-1), vv))
        return torch.stack(out)


SHAPES = [  # rows (queries, keys), heads, kv heads, head dim, block size
    ([(1, 1)], 1, 1, 1, 1),
    ([(1, 17), (3, 3), (1, 40), (7, 50)], 4, 2, 24, 5),
    ([(1, 33), (12, 12), (2, 100)], 9, 3, 64, 16),
    ([(5, 70), (1, 16), (1, 32)], 8, 1, 16, 16),
    ([(2, 9)], 4, 4, 256, 3),
    ([(1, 20), (4, 31)], 16, 1, 80, 7),
]


@pytest.mark.parametrize("isa", BUILT)
@pytest.mark.parametrize("rows, heads, kv_heads, dim, block_size", SHAPES)
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (6, 0.0), (0, 2.0), (17, 5.0)])
def test_attention_matches_a_float64_reference(isa, rows, heads, kv_heads, dim, block_size, window, softcap):
    case = Case(rows, heads, kv_heads, dim, block_size, seed=dim + block_size)
    out = case.run(isa, window=window, softcap=softcap)
    want = case.reference(window=window, softcap=softcap)
    assert not out.isnan().any()
    assert (out.double() - want).abs().max() <= 1e-5 * want.abs().max().clamp(min=1)


@pytest.mark.parametrize("isa", BUILT)
def test_a_tokens_result_is_the_same_alone_in_a_prefill_a_chunk_or_any_batch(isa):
    """A 45-token prompt prefilled whole, in 7-token chunks, and token by token as decode rows, beside other rows in
    any order: each token's output is the same bits (the softmax's chunks are at fixed key positions)."""
    prompt, others = 45, [(1, 30), (4, 60), (1, 1)]
    whole = Case([(prompt, prompt), *others], heads=9, kv_heads=3, dim=64, block_size=16, seed=1)
    want = whole.run(isa, window=20)[:prompt]

    def rows_out(case_rows, picks):  # the same caches and queries, other row splits: (queries, keys) of the prompt
        case = Case([*case_rows, *others], heads=9, kv_heads=3, dim=64, block_size=16, seed=1)
        case.k, case.v, case.tables[: len(case_rows)], case.tables[len(case_rows) :] = (
            whole.k, whole.v, whole.tables[0], whole.tables[1:]
        )  # fmt: skip
        q = torch.cat([whole.q[:prompt][picks], whole.q[prompt:]])
        return case.run(isa, window=20, q=q)[: len(picks)]

    chunks = [(min(7, prompt - s), min(s + 7, prompt)) for s in range(0, prompt, 7)]
    assert torch.equal(rows_out(chunks, list(range(prompt))), want)
    for p in (0, 15, 16, 17, 44):
        assert torch.equal(rows_out([(1, p + 1)], [p]), want[p : p + 1])
    decodes = [(1, p + 1) for p in range(prompt)][::-1]  # every position as a decode row, in reverse order
    assert torch.equal(rows_out(decodes, list(range(prompt))[::-1]), want.flip(0))


def test_every_isa_computes_the_same_bits():
    if len(BUILT) < 2:
        pytest.skip("this CPU runs one ISA's build")
    case = Case([(1, 40), (6, 6), (3, 77)], heads=6, kv_heads=2, dim=40, block_size=16, seed=5)
    results = [case.run(isa, window=9, softcap=3.0) for isa in BUILT]
    assert all(torch.equal(r, results[0]) for r in results[1:])


@pytest.mark.parametrize("isa", BUILT)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (3, 0.0), (0, 2.0)])
def test_a_non_finite_key_spreads_as_in_the_reference(isa, bad, window, softcap):
    """One element of one key (a decode row's, and one amid a prefill's) non-finite: exactly the query heads that see
    it give NaN, as torch's softmax does for a NaN or +inf score (inf - inf; -inf weighs 0, a soft-cap caps +-inf);
    the queries before it or past its window, and the other heads, keep their values. (Every slot no query may read
    is NaN, as in every Case: it changes nothing.)"""
    case = Case([(1, 17), (7, 50), (1, 40)], heads=4, kv_heads=2, dim=24, block_size=5, seed=7)
    for r, j, h, d in ((0, 3, 1, 5), (1, 45, 0, 20)):  # (row 1's queries sit at positions 43 .. 49)
        case.keys[r][j, h, d] = bad
        case.k[case.tables[r, j // case.block_size], j % case.block_size, h, d] = bad
    out, want = case.run(isa, window=window, softcap=softcap), case.reference(window=window, softcap=softcap)
    nan = want.isnan()
    assert nan.any() == (math.isnan(bad) or not softcap) and not nan.all()
    assert torch.equal(out.isnan(), nan)
    ok = want[~nan]
    assert (out[~nan].double() - ok).abs().max() <= 1e-5 * ok.abs().max().clamp(min=1)


def test_the_reference_check_fails_a_wrong_kernel():
    """Power: the float64 check above tells a window off by one (and a missing soft-cap) from the right answer."""
    case = Case([(1, 17), (3, 3), (7, 50)], seed=2)
    want = case.reference(window=6, softcap=2.0)
    for wrong in (case.run(BUILT[0], window=7, softcap=2.0), case.run(BUILT[0], window=6, softcap=0.0)):
        assert (wrong.double() - want).abs().max() > 1e-5 * want.abs().max().clamp(min=1)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c.seq_lens.fill_(1000), "disagree"),  # keys past the block table
        (lambda c: c.tables.__setitem__((1, 0), 10_000), "outside the cache"),
        (lambda c: c.tables.__setitem__((0, 0), -1), "outside the cache"),
        (lambda c: c.qsl.__setitem__(-1, 2), "spans"),  # queries that are not q's tokens
        (lambda c: setattr(c, "tables", c.tables.int()), "int64"),
        (lambda c: setattr(c, "q", c.q.double()), "float32 q"),
    ],
)
def test_metadata_that_would_read_outside_the_cache_is_refused(change, message):
    case = Case([(1, 17), (3, 3)], seed=3)
    change(case)
    with pytest.raises(RuntimeError, match=message):
        case.run(BUILT[0])

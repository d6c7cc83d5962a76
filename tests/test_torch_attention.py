"""The torch attention path (gpu/attention/torch_backend.py: padded segments, the reference backend) reads no slot its
row does not
hold: with every slot no row holds poisoned with NaN (the padding of each row's last block, the blocks nobody in the
step holds) and block 0, where a shorter row's block table points past its blocks, holding another row's keys or a
request's outside the step, each row of a mixed prefill + decode step is a float64 reference's over its own keys
alone; a non-finite key that a row's queries all read still spreads, exactly to the heads that see it (the native
kernel's contract, tests/test_native_attention.py). The caches and the reference are that file's `Case`."""

import math

import numpy as np
import pytest
import torch

from gpu.attention.metadata import AttentionMetadata
from gpu.attention.torch_backend import TorchAttention
from tests.test_native_attention import Case

ROWS = [(1, 9), (5, 50), (1, 17), (3, 3), (1, 40), (4, 4)]  # (queries, keys): decodes and (chunked) prefills
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def torch_path(case: Case, dtype: torch.dtype, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """The case's step on the torch backend, its inputs in `dtype` (planned, uploaded and called as the runner
    does)."""
    query_lens = np.array([q for q, _ in case.rows])
    qsl, seq_lens, tables = (t.numpy() for t in (case.qsl, case.seq_lens, case.tables))
    backend = TorchAttention(torch.device("cpu"), dtype, case.block_size)
    plans = backend.plan(query_lens, seq_lens, qsl, tables)
    meta = AttentionMetadata(torch.empty(0), case.qsl, case.seq_lens, case.tables, int(query_lens.max()), 0)
    backend.finish(meta, plans, [{n: torch.from_numpy(a) for n, a in p.arrays.items()} for p in plans])
    kv = (case.k.to(dtype), case.v.to(dtype))
    return backend(case.q.to(dtype), kv, meta, 0.3, window or None, softcap or None).float()


def holds(case: Case) -> torch.Tensor:
    """[rows, table width]: the table entries that name a block of the row (the rest is padding: block 0)."""
    return torch.arange(case.tables.shape[1]) < torch.tensor([-(-k // case.block_size) for _, k in case.rows])[:, None]


def as_block_zero(case: Case, block: int) -> None:
    """Swap block ids `block` and 0 in the cache and in the rows' tables (their padding still reads block 0)."""
    held, tables = holds(case), case.tables.clone()
    tables[held & (case.tables == block)], tables[held & (case.tables == 0)] = 0, block
    case.tables = tables
    for cache in (case.k, case.v):
        cache[[0, block]] = cache[[block, 0]]


def rounded(case: Case, dtype: torch.dtype) -> Case:
    """The case's queries, keys and values rounded to `dtype`: the reference sees what the path is given."""
    r = lambda x: x.to(dtype).float()  # noqa: E731
    case.q, case.k, case.v = r(case.q), r(case.k), r(case.v)
    case.keys, case.values = [r(k) for k in case.keys], [r(v) for v in case.values]
    return case


def check(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """NaN exactly where the reference has NaN; elsewhere within TOL[dtype] of it, relative to its largest magnitude."""
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan)
    ok = want[~nan]
    assert (out[~nan].double() - ok).abs().max() <= TOL[dtype] * ok.abs().max().clamp(min=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (6, 0.0), (0, 2.0), (17, 5.0)])
def test_no_row_reads_a_slot_it_does_not_hold(dtype, window, softcap):
    """Block 0 is a NaN block of a request outside the step, and every row's last block has NaN past its keys."""
    case = rounded(Case(ROWS, heads=9, kv_heads=3, dim=64, block_size=5, seed=11), dtype)
    held = set(case.tables[holds(case)].tolist())
    as_block_zero(case, next(b for b in range(len(case.k)) if b not in held))
    assert case.k[0].isnan().all() and (case.tables[~holds(case)] == 0).any()
    want = case.reference(window=window, softcap=softcap)
    assert not want.isnan().any()
    check(torch_path(case, dtype, window, softcap), want, dtype)


@pytest.mark.parametrize(  # (bfloat16 SDPA on a CPU gives an infinite score a finite result: torch's kernel)
    "dtype, bad", [*((torch.float32, b) for b in (math.nan, math.inf, -math.inf)), (torch.bfloat16, math.nan)]
)
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (8, 0.0), (0, 2.0)])
def test_a_non_finite_key_its_row_reads_spreads_to_that_row_alone(dtype, bad, window, softcap):
    """One element of one key of the 9-key decode row and one of the prefill's context (position 42: every one of
    its queries, at 45 .. 49, reads it, within a window of 8 too), the block holding the latter made block 0, which
    the shorter rows' tables point at past their blocks: exactly the heads that see a bad key give NaN, as torch's
    softmax does for a NaN or +inf score (inf - inf; -inf weighs 0, a soft-cap caps +-inf); every other row is the
    reference's."""
    case = rounded(Case(ROWS, heads=9, kv_heads=3, dim=64, block_size=5, seed=11), dtype)
    for r, j, h, d in ((0, 5, 1, 7), (1, 42, 2, 40)):
        case.keys[r][j, h, d] = bad
        case.k[case.tables[r, j // case.block_size], j % case.block_size, h, d] = bad
    as_block_zero(case, int(case.tables[1, 42 // case.block_size]))
    want = case.reference(window=window, softcap=softcap)
    nan = want.isnan()
    assert nan.any() == (math.isnan(bad) or not softcap) and not nan[case.qsl[2] :].any()
    check(torch_path(case, dtype, window, softcap), want, dtype)

"""Temperature, min-p, top-k, top-p and the draw, without sorting the vocabulary and without a host sync.

Measured on CPU (1 thread, one row of 128k float32 logits): torch.argmax ~0.25 ms, torch.topk(256) ~0.6 ms, a
full sort ~12 ms, exponential noise over the row ~6 ms, but amax / sum / exp over contiguous memory ~0.03-0.05 ms.
So everything here is made of block reductions over the logits viewed as [B, nb, BLOCK]:

- `Blocks.argmax`: the block maxima locate the first maximum exactly (torch.argmax semantics) after one amax pass.
- `Blocks.top`: the exact top-K window reads only K blocks: a row's K largest logits lie in its K blocks with the
  largest maxima (every block ranked above a token's block holds a distinct larger-or-equal logit). It costs
  ~1 us per K at 128k (K = 64: ~0.3x argmax), hence a small first window.
- A draw inverts the CDF with one float64 uniform per row: inside the window for truncating rows (`draw_window`),
  block by block over the whole vocabulary for untruncated rows (`draw_vocab`). A seeded row's uniform is a
  counter-based function of (seed, output position) (`counter_uniforms`): its tokens depend on neither the batch
  nor how the request was scheduled.
- A truncating row whose kept set does not fit the window (a nucleus wider than K tokens, a min-p threshold below
  the K-th logit, K < top_k) is drawn from a wider window that provably holds its kept set: on CPU an 8K window,
  then the logits above a lower bound of the kept set (`kept_lower_bound`, `threshold_window`); elsewhere its
  sorted row.
"""

from __future__ import annotations

import numpy as np
import torch

try:
    from flashinfer.sampling import top_k_top_p_sampling_from_logits as _flashinfer_top_k_top_p
except ImportError:
    _flashinfer_top_k_top_p = None

BLOCK = 64


SMALL = 1 << 16  # below this many logits torch.argmax beats the block argmax's fixed op overhead

# Columns of the per-row tensor the draws take ([n, 6] float64): SamplingMetadata.params, then the row's uniform
# and its whole-vocabulary mass (0 where not measured).
T, TOP_K, TOP_P, MIN_P, U, MASS = range(6)


class Blocks:
    """Logits [B, nb * BLOCK] (padded with -inf to whole blocks) as blocks, with their maxima."""

    def __init__(self, x: torch.Tensor):
        self.x = x
        self.blocks = x.view(x.shape[0], x.shape[1] // BLOCK, BLOCK)
        self.maxima = self.blocks.amax(-1)  # [B, nb]; NaN if the block holds a NaN
        self.row_max = self.maxima.amax(-1)  # [B]

    def argmax(self) -> torch.Tensor:
        """torch.argmax(x, -1) exactly: the first maximum, or the first NaN (NaN counts as the maximum)."""
        if self.x.numel() < SMALL:
            return self.x.argmax(-1)
        top = self.row_max[:, None]
        blk = ((self.maxima == top) | self.maxima.isnan()).int().argmax(-1)  # first block holding it
        vals = self.blocks[torch.arange(len(blk), device=blk.device), blk]
        return blk * BLOCK + ((vals == top) | vals.isnan()).int().argmax(-1)

    def top(self, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact top-k logits of `rows`, sorted descending, and their token ids (ties in any order)."""
        blk = self.maxima[rows].topk(min(k, self.maxima.shape[1]), -1).indices  # [n, m]
        cand = self.blocks[rows[:, None], blk].flatten(1)  # [n, m * BLOCK]
        values, j = cand.topk(min(k, cand.shape[1]), -1)
        return values, blk.gather(1, j // BLOCK) * BLOCK + j % BLOCK


def invert_cdf(w: torch.Tensor, u: torch.Tensor, residual: bool = False):
    """For non-negative float64 weights w [n, m] and uniforms u [n] in [0, 1): the index i [n] with
    C[i-1] <= u*C[-1] < C[i] (C = cumsum(w)); with `residual`, also (u*C[-1] - C[i-1]) / w[i], a fresh uniform
    for a second-level draw. Rounding never lands on a zero-weight entry: i is capped at the last positive weight.
    """
    c = w.cumsum(-1)
    total = c[:, -1:].contiguous()
    t = u[:, None] * total
    last = torch.searchsorted(c, total)  # first index reaching the total: the last positive weight
    i = torch.minimum(torch.searchsorted(c, t, right=True), last).clamp_(max=w.shape[1] - 1)
    if not residual:
        return i.squeeze(1)
    wi = w.gather(1, i)
    return i.squeeze(1), ((t - c.gather(1, i) + wi) / wi).clamp_(0.0, 1.0).squeeze(1)


def kept_weights(values: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, min-p, top-k and top-p over the rows' window (logits sorted descending, [n, k]): the kept
    tokens' weights exp((x - max) / T) (float64, 0 where dropped) and `fits`, False where the kept set may reach
    beyond the window.

    Each truncation keeps a prefix of the sorted window, so a row keeps its first n tokens. Top-k keeps every token
    tied with the k-th largest logit (as vLLM), so which of tied tokens survive never depends on kernel order; a tie
    that runs past the window makes the row not fit (on CPU it is then drawn from a wider window; the static device
    path, which never reads values back, cuts such a tie, of more than the window's 64 tokens, there). A MASS > 0
    marks a top-p-only row: its nucleus is measured against the whole-vocabulary mass.
    """
    t, top_k, top_p, min_p, _, mass = cols.unbind(1)
    k = values.shape[1]
    e = ((values - values[:, :1]) / t[:, None]).exp()  # probability relative to the top token (float64)
    c = e.cumsum(-1)
    kth = values.gather(1, (top_k.long() - 1).clamp_(0, k - 1)[:, None])  # top-k keeps every logit >= the k-th
    n = torch.minimum((e >= min_p[:, None]).sum(-1), (values >= kth).sum(-1)).clamp_(1, k)  # min-p, then top-k
    top_p_only = mass > 0
    pz = top_p * torch.where(top_p_only, mass, c.gather(1, n[:, None] - 1).squeeze(1))
    n = torch.minimum(n, (c - e < pz[:, None]).sum(-1)).clamp_(min=1)  # top-p keeps the token that crosses p
    top_k_fits = (top_k <= k) & (values[:, -1] < kth.squeeze(1))  # (no tie with the k-th beyond the window)
    fits = torch.where(top_p_only, c[:, -1] >= pz, top_k_fits | (e[:, -1] < min_p))
    return e.masked_fill_(torch.arange(k, device=e.device) >= n[:, None], 0.0), fits


def draw_window(
    values: torch.Tensor, ids: torch.Tensor, cols: torch.Tensor, whole_row: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw from the rows' window (logits sorted descending, [n, k], see `kept_weights`) with each row's uniform.
    Returns (token ids, fits): where not `fits`, the token must come from a wider window.

    The draw inverts the CDF of the kept set in token-id order, not value order: the model's logits move in the
    last bits with the batch composition (CPU matmuls are not batch-invariant), and near-tied tokens swapping
    places would otherwise move a seeded row's token whenever its uniform fell in either of them. With
    `whole_row` (ids: a permutation of the row, i.e. a sorted row), the weights are laid out by id in O(V)
    instead of sorting the ids.
    """
    kept, fits = kept_weights(values, cols)
    u = cols[:, U]
    if whole_row:
        return invert_cdf(torch.zeros_like(kept).scatter_(1, ids, kept), u), fits
    order = ids.argsort(-1)
    return ids.gather(1, order.gather(1, invert_cdf(kept.gather(1, order), u)[:, None])).squeeze(1), fits


def kept_lower_bound(blocks: Blocks, rows: torch.Tensor, cols: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A logit below which no token of the row's kept set lies (per row, [n]):
    - min-p keeps e = exp((x - max) / T) >= min_p;
    - a top-p-only row keeps its nucleus inside e >= (1 - p) S / V (S = MASS): the tokens below that bound hold
      less than (1 - p) S together, so the tokens above already reach p S;
    - top-k keeps logits >= the top_k-th largest block maximum (that many blocks each hold a logit >= it).
    """
    t, top_k, top_p, min_p, _, mass = cols.unbind(1)
    e_bound = torch.where(mass > 0, (1.0 - top_p) * mass / vocab_size, min_p)
    theta = blocks.row_max[rows] + t * (e_bound.log() - 1e-4)  # the margin absorbs exp/log rounding
    maxima = blocks.maxima[rows].sort(-1, descending=True).values
    nb = maxima.shape[1]
    kth = maxima.gather(1, (top_k.long() - 1).clamp(max=nb - 1)[:, None]).squeeze(1)
    return torch.maximum(theta, torch.where(top_k <= nb, kth, float("-inf")))


def threshold_window(blocks: Blocks, rows: torch.Tensor, theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every logit >= theta of each row, sorted descending, padded with at least one -inf column.

    CPU only: the width depends on the data (reading a host tensor synchronises nothing). It reads only the blocks
    whose maximum reaches theta and sorts only the candidates, instead of sorting the whole row (~50x argmax).
    """
    r, b = (blocks.maxima[rows] >= theta[:, None]).nonzero(as_tuple=True)
    vals = blocks.blocks[rows[r], b]  # [candidate blocks, BLOCK]
    j, pos = (vals >= theta[r, None]).nonzero(as_tuple=True)
    r = r[j]  # non-decreasing: nonzero is row-major
    counts = torch.bincount(r, minlength=len(rows))
    width = int(counts.max()) + 1 if len(r) else 1
    col = torch.arange(len(r)) - (counts.cumsum(0) - counts)[r]
    values = torch.full((len(rows), width), float("-inf"))
    ids = torch.zeros((len(rows), width), dtype=torch.int64)
    values[r, col], ids[r, col] = vals[j, pos], b[j] * BLOCK + pos
    order = torch.from_numpy(np.argsort(-values.numpy(), axis=-1))  # numpy sorts ~4x faster than torch on CPU
    return values.gather(1, order), ids.gather(1, order)


def vocab_mass(blocks: Blocks, rows: torch.Tensor, cols: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """exp((x - max) / T) of the whole rows into out ([n, nb * BLOCK], float32); returns their block sums [n, nb]."""
    e = torch.index_select(blocks.x, 0, rows, out=out)
    e.sub_(blocks.row_max[rows, None]).div_(cols[:, T, None].float()).exp_()
    return e.view(len(rows), -1, BLOCK).sum(-1).double()


def draw_vocab(e: torch.Tensor, block_mass: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Draw over the whole vocabulary (e, block_mass from `vocab_mass`): a block by its mass, then a token inside
    it with the residual uniform."""
    blk, r = invert_cdf(block_mass, cols[:, U], residual=True)
    w = e.view(len(e), -1, BLOCK)[torch.arange(len(e), device=e.device), blk].double()  # [n, BLOCK]
    return blk * BLOCK + invert_cdf(w, r)


def flashinfer_available(x: torch.Tensor) -> bool:
    return _flashinfer_top_k_top_p is not None and x.is_cuda


def draw_flashinfer(x: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """FlashInfer's sorting-free rejection sampler (CUDA, unseeded batches); min-p is applied as a logit mask."""
    t, top_k, top_p, min_p = params.float().unbind(1)
    x = x / t[:, None]
    x = x.masked_fill(x < x.amax(-1, keepdim=True) + min_p.log()[:, None], float("-inf"))
    return _flashinfer_top_k_top_p(x, top_k.int(), top_p, deterministic=True).long()


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (multiplication wraps): a bijection that scatters every input bit."""
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _M1, _M2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def counter_uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """float64 uniforms in [0, 1), a pure function of (seed, output position, stream): a seeded request draws the
    same uniform for its n-th token however it is scheduled (batch, speculation, preemption, a restarted engine).
    Streams other than 0 serve speculation's extra draws (draft tokens, acceptance tests, residual draws)."""
    z = _mix(_mix(seeds + _GOLDEN) + positions * _GOLDEN + _signed(stream * _M1 % (1 << 64)))
    return _shr(z, 11).double() * 2.0**-53


def uniforms(
    n: int, seeded_rows: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, stream: int = 0
) -> torch.Tensor:
    """One float64 uniform per row; a seeded row's is keyed by its seed and the output position it samples."""
    u = torch.rand(n, dtype=torch.float64, device=seeds.device)
    if seeds.numel():
        u.index_copy_(0, seeded_rows, counter_uniforms(seeds, positions, stream))
    return u

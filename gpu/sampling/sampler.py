"""The sampler: logits [B, V] + SamplingMetadata -> one token id per row (+ raw logprobs), with no host sync.

This module is the torch path (CPU's, and the reference); on CUDA the default is the fused sampler
(fused_triton.py: the same order of operations in a few Triton launches, the logits left unmodified), chosen in
`Sampler.__call__` (`fused`); FlashInfer and `sort_free` then apply only to the torch path.

Before the sampler (DESIGN 5a; actors/engine/executor.py, StepExecutor.run): CFG for guided rows, then the grammar
bitmask for constrained rows (disallowed tokens -inf; actors/engine/grammar.py). Raw logprobs are of those logits.

Order of operations (part of correctness; each step is one line of `Sampler.__call__`):
  float32 cast -> raw logprobs (if requested) -> allowed-token mask -> bad words -> min_tokens (EOS / stop ids
  masked) -> logit bias (+-100) -> repetition / presence / frequency penalties -> greedy argmax (an all-greedy
  batch returns here) -> temperature (greedy rows divide by 1) -> min-p -> top-k -> top-p (keeping the boundary
  token) -> draw -> per-row where(greedy, argmax, draw) -> the sampled token's logprob, its rank and the top-N.

Logprobs are raw (above; vLLM's default) or, with logprobs_mode "processed_logprobs", those of the distribution
each row samples from: a random row's after the processors, temperature, min-p, top-k and top-p (-inf where
truncated); a greedy row's after the processors alone (log_softmax at temperature 1, untruncated: its true
distribution is a point mass, whose logprobs say nothing), as vLLM reports them. Computed before the draw from
each logprob row's sorted logits (~50x an argmax on CPU: opt-in).

The processors before the argmax can move it; the transforms after it cannot, so greedy rows skip them.
Edge cases (defined, never a crash):
- A row whose maximum is not finite takes its argmax (torch.argmax semantics): with a NaN, the first NaN; else
  with +inf, the first +inf; with every token masked (all -inf, e.g. allowed_token_ids all banned), token 0.
- top_k >= vocab size is top-k off; allowed_token_ids of one token always yields that token.
- The logits are modified in place on this path (float32 input is the work buffer; reused scratch memory does the
  rest); the fused path leaves them as they were.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from messages.sampling_params import LogprobsMode

from .logprobs import LogprobsTensors, gather_logprobs, log_softmax_into
from .metadata import SamplingMetadata
from .penalties import apply_allowed, apply_ban, apply_logit_bias, apply_penalties
from .threshold import threshold_draw
from .topk_topp import (
    BLOCK,
    MASS,
    Blocks,
    draw_flashinfer,
    draw_vocab,
    draw_window,
    flashinfer_available,
    kept_lower_bound,
    kept_weights,
    threshold_window,
    uniforms,
    vocab_mass,
)


def _processors(meta: SamplingMetadata) -> bool:
    """Whether metadata carries the torch path's processor entries (built without `edits`)."""
    return any(e is not None for e in (meta.allowed, meta.bad_words, meta.min_tokens, meta.logit_bias, meta.penalties))


def _process(x: torch.Tensor, meta: SamplingMetadata) -> None:
    """The processors that can move the argmax, in place, in their order (the torch path's entries)."""
    assert meta.edits is None, "a step's edits table is applied by the fused sampler"
    apply_allowed(x, meta.allowed)
    apply_ban(x, meta.bad_words)
    apply_ban(x, meta.min_tokens)
    apply_logit_bias(x, meta.logit_bias)
    apply_penalties(x, meta.penalties)


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [B] int64, on the logits' device
    logprobs: LogprobsTensors | None = None


class Sampler:
    """Called once per step by the model runner.

    dynamic_fallback: how truncating rows whose kept set outgrows the top-K window are drawn exactly.
    True (default on CPU, where the tensors already live on the host and selecting rows by value syncs nothing):
    exactly the rows that did not fit, from the logits above a lower bound of their kept set. False (default
    elsewhere): every row the window does not always cover (top_k > K or off) is drawn from its sorted row; the
    rows are chosen from the parameters alone, so nothing is read back.
    flashinfer: draw unseeded CUDA batches with FlashInfer's kernel when it is installed (False: the torch path).
    sort_free: draw every random row by a threshold search over its logits instead (`threshold`: no window, no
    sort, no host sync): "triton" (one fused kernel; the interpreter on CPU), "torch" (the same search in torch
    ops, the kernel's reference) or "off"; FlashInfer first, where it applies. None: "triton" on CUDA, "off"
    elsewhere (on CPU the window path is ~2x argmax; the search's 64 full-row passes in torch are ~100x, measured
    in scripts/bench_sampler.py).
    logprobs_mode: what the logprobs report (module docstring).
    fused: sample in a few Triton launches (gpu/sampling/fused_triton.py: the processors, the argmax, the sort-free
    draw and the raw logprobs for any mix of rows, no host sync), given metadata built with `edits` (`fuses` says
    whether to build it so) or without processors; never with processed logprobs. None: on CUDA.
    """

    def __init__(
        self,
        dynamic_fallback: bool | None = None,
        flashinfer: bool = True,
        logprobs_mode: LogprobsMode = "raw_logprobs",
        sort_free: str | None = None,
        row_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
        fused: bool | None = None,
    ):
        assert sort_free in (None, "off", "torch", "triton"), sort_free
        self.fused = fused
        self.dynamic_fallback = dynamic_fallback
        self.flashinfer = flashinfer
        self.sort_free = sort_free
        self.processed = logprobs_mode == "processed_logprobs"
        self._buffers: dict[str, torch.Tensor] = {}
        self.row_sum = row_sum  # the logprobs' normalizer (logprobs.log_softmax_into)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        assert logits.shape[1] == meta.vocab_size, "one logit per vocabulary entry"
        wants_logprobs = meta.max_num_logprobs is not None
        if self.fuses(logits.device) and not _processors(meta):
            from .fused_triton import fused_sample  # imports Triton: only once chosen

            return SamplerOutput(*fused_sample(logits, meta, self._buffer("fused", len(logits), logits)))
        x = logits.float().contiguous()
        lp = self._raw_logprobs(x, meta) if wants_logprobs and not self.processed else None
        x = self._whole_blocks(x)
        _process(x, meta)
        if wants_logprobs and self.processed:
            lp = self._processed_logprobs(x, meta, meta.logprob_rows)
        blocks = Blocks(x)
        argmax = blocks.argmax()
        if meta.all_greedy:
            sampled = argmax
        else:
            draw = self._draw(blocks, meta, argmax)
            sampled = torch.where(meta.greedy | ~blocks.row_max.isfinite(), argmax, draw)
        return SamplerOutput(sampled, None if lp is None else self._logprobs(lp, sampled, meta))

    @torch.inference_mode()
    def probs(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The distribution each row samples from, dense ([B, V] float64, rows sum to 1): the same pipeline as
        __call__, with greedy (and non-finite) rows a point mass on their argmax. Exact through each random row's
        sorted logits (~50x an argmax on CPU): for verifying draft-model speculation, where q is not a point mass."""
        x = logits.float().clone()
        _process(x, meta)
        point = torch.zeros(x.shape, dtype=torch.float64, device=x.device).scatter_(1, x.argmax(-1, keepdim=True), 1.0)
        rows = meta.random_rows  # host-known: the greedy rows are a point mass
        if not rows.numel():
            return point
        dense, finite = _truncated(x[rows], meta.params[rows])
        return point.index_copy(0, rows, torch.where(finite, dense, point[rows]))

    @torch.inference_mode()
    def logprobs_of(
        self, logits: torch.Tensor, token_ids: torch.Tensor, n: int, meta: SamplingMetadata | None = None
    ) -> LogprobsTensors:
        """Logprobs of token_ids [T] under logits [T, V], their ranks and the top-n: raw (prompt logprobs), or, given
        the rows' metadata, in this sampler's mode (tokens chosen outside the draw: draft verification)."""
        if meta is None or not self.processed:
            return gather_logprobs(self._log_softmax(logits), logits.shape[1], token_ids, n)
        x = self._whole_blocks(logits.float().clone())
        _process(x, meta)
        lp = self._processed_logprobs(x, meta, torch.arange(len(x), device=x.device))
        return gather_logprobs(lp, logits.shape[1], token_ids, n)

    def _draw(self, blocks: Blocks, meta: SamplingMetadata, argmax: torch.Tensor) -> torch.Tensor:
        """Temperature -> min-p -> top-k -> top-p -> draw for the random rows (the others keep their argmax): all of
        them by the sort-free search where it is chosen; else in `draw_vocab` for untruncated rows, in
        `draw_window` for the others (first the top-K window, then, for the rows whose kept set may outgrow it, a
        wider exact window)."""
        if self.flashinfer and flashinfer_available(blocks.x) and not meta.seeds.numel():
            return draw_flashinfer(blocks.x, meta.params)
        u = uniforms(len(argmax), meta.seeded_rows, meta.seeds, meta.positions)
        cols = torch.cat([meta.params, u[:, None], torch.zeros_like(u)[:, None]], 1)  # [B, 6]: see topk_topp
        sort_free = self.sort_free_draw(blocks.x)
        if sort_free is not None:
            return argmax.index_copy(0, meta.random_rows, sort_free(blocks.x, blocks.row_max, cols, meta))
        draw = argmax.clone()
        rows = meta.mass_rows  # drawn over the whole vocabulary; top-p-only rows are redrawn in their window below
        if rows.numel():
            sub, e = cols.index_select(0, rows), self._buffer("vocab", rows.numel(), blocks.x)
            block_mass = vocab_mass(blocks, rows, sub, out=e)
            cols[:, MASS].index_copy_(0, rows, block_mass.sum(-1))
            draw.index_copy_(0, rows, draw_vocab(e, block_mass, sub))
        dynamic = blocks.x.is_cpu if self.dynamic_fallback is None else self.dynamic_fallback
        if dynamic:  # the rows that did not fit, level by level (data-dependent subsets: CPU only)
            rows = meta.window_rows
            for k in (meta.window, 8 * meta.window):
                rows = rows[~self._window(blocks, rows, k, cols, draw)] if rows.numel() else rows
        else:  # covered rows always fit: nothing is read back (a boolean mask would sync the device)
            if meta.covered_rows.numel():
                self._window(blocks, meta.covered_rows, meta.window, cols, draw)
            rows = meta.uncovered_rows
        if rows.numel():  # a window that holds the whole kept set, however wide
            sub = cols.index_select(0, rows)
            if dynamic:
                values, ids = threshold_window(blocks, rows, kept_lower_bound(blocks, rows, sub, meta.vocab_size))
            else:
                values, ids = blocks.x[rows].sort(-1, descending=True)
            draw.index_copy_(0, rows, draw_window(values, ids, sub, whole_row=not dynamic)[0])
        return draw

    def fuses(self, device: torch.device) -> bool:
        """Whether this sampler samples on `device` by the fused kernels (the executor then builds edits)."""
        return not self.processed and (device.type == "cuda" if self.fused is None else self.fused)

    def sort_free_draw(self, x: torch.Tensor):
        """The sort-free draw this sampler uses for logits on x's device, or None (the window path): the one place
        the choice is made (class docstring)."""
        choice = self.sort_free or ("triton" if x.is_cuda else "off")
        if choice == "torch":
            return threshold_draw
        if choice == "triton":
            from .threshold_triton import threshold_draw_triton  # imports Triton: only once chosen

            return threshold_draw_triton
        return None

    @staticmethod
    def _window(blocks: Blocks, rows: torch.Tensor, k: int, cols: torch.Tensor, draw: torch.Tensor) -> torch.Tensor:
        """Draw `rows` (not empty) from their top-k window into `draw`; returns whether each one's kept set fits it."""
        values, ids = blocks.top(rows, k)
        token, fits = draw_window(values, ids, cols.index_select(0, rows))
        draw.index_copy_(0, rows, token)
        return fits

    def _whole_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """x itself when its width is whole blocks, else a copy padded with -inf (never sampled)."""
        v = x.shape[1]
        if v % BLOCK == 0:
            return x
        padded = self._buffer("padded", x.shape[0], x)
        padded[:, :v] = x
        padded[:, v:] = float("-inf")
        return padded

    def _processed_logprobs(self, x: torch.Tensor, meta: SamplingMetadata, rows: torch.Tensor) -> torch.Tensor:
        """Processed logprobs of `rows` of x (processed, whole blocks): module docstring."""
        sub = x.index_select(0, rows)
        dense, finite = _truncated(sub, meta.params[rows])
        truncated = dense.log_().float()
        untruncated = self._log_softmax(sub)  # a greedy (or non-finite) row's
        return untruncated.copy_(torch.where(meta.greedy[rows, None] | ~finite, untruncated, truncated))

    def _raw_logprobs(self, x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        rows = meta.logprob_rows
        return self._log_softmax(x if rows.numel() == len(x) else x.index_select(0, rows))

    def _log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        """log_softmax of x into a reused buffer, valid until the next call (callers gather from it at once)."""
        return log_softmax_into(x, self._buffer("logprobs", len(x), x), self._buffer("vocab", len(x), x), self.row_sum)

    def _logprobs(self, lp: torch.Tensor, sampled: torch.Tensor, meta: SamplingMetadata) -> LogprobsTensors:
        rows, n = meta.logprob_rows, meta.max_num_logprobs
        if rows.numel() == len(sampled):
            return gather_logprobs(lp, meta.vocab_size, sampled, n)
        part = gather_logprobs(lp, meta.vocab_size, sampled.index_select(0, rows), n)
        tensors = (part.sampled, part.ranks, part.top_ids, part.top_logprobs)
        return LogprobsTensors(*(t.new_zeros((len(sampled), *t.shape[1:])).index_copy_(0, rows, t) for t in tensors))

    def _buffer(self, name: str, rows: int, like: torch.Tensor) -> torch.Tensor:
        """A reused float32 [rows, like's width rounded up to whole blocks] buffer on like's device: a fresh B x V
        tensor every step would page-fault its way in (~1 GB/s measured; glibc maps large blocks afresh)."""
        width = math.ceil(like.shape[1] / BLOCK) * BLOCK
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < rows * width or buf.device != like.device:
            buf = self._buffers[name] = torch.empty(rows * width, dtype=torch.float32, device=like.device)
        return buf[: rows * width].view(rows, width)


def _truncated(x: torch.Tensor, params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distribution rows x [n, V] (processed logits) are drawn from under their params [n, 4] (temperature,
    top-k, top-p, min-p), exact through their sorted logits: float64 [n, V], and whether each row's maximum is
    finite (where it is not, the row takes its argmax and the distribution is meaningless)."""
    values, ids = x.sort(-1, descending=True)
    kept, _ = kept_weights(values, torch.cat([params, params.new_zeros(len(x), 2)], 1))
    dense = torch.zeros_like(kept).scatter_(1, ids, kept)
    return dense / dense.sum(-1, keepdim=True), values[:, :1].isfinite()

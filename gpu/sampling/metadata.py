"""SamplingMetadata: one step's per-row sampling parameters as tensors, built once per step from host lists.

Everything the sampler's branches depend on (all_greedy; which rows are drawn over the whole vocabulary, in the
window, or keyed by their seed; the largest logprobs count) is decided here on the host, so the sampler never
reads a tensor value back to choose a path.
Per-token work here is proportional to the ids a row names (bias, allowed ids, bad words, penalty tokens), never to
the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from messages.sampling_params import SamplingParams

from .edits import Edits, build_edits, penalty_ids, row_ids

WINDOW = 64  # top-K window: exact whenever a row's kept set fits (wider exact windows take the other rows)


def reads_output(p: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a row's sampling reads its output so far (penalties, bad words, min_tokens not reached yet)."""
    return num_output_tokens < p.reads_output_until


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]  # or an int64 numpy array kept per request: no per-step conversion then
    output_token_ids: list[int]
    # the index of the output token this row samples (None: len(output_token_ids)); keys a seeded row's uniform
    position: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def sample_position(self) -> int:
        return len(self.output_token_ids) if self.position is None else self.position


@dataclass
class TokenEntries:
    """Sparse (row, token[, value]) entries: the tokens a row names, never a vocabulary-wide mask."""

    rows: torch.Tensor  # [N] int64
    tokens: torch.Tensor  # [N] int64
    values: torch.Tensor | None = None  # [N] float32
    row_ids: torch.Tensor | None = None  # the distinct rows (allowed-token mask)


@dataclass
class PenaltyTokens:
    """The ids penalised in each row that has penalties: prompt + output ids (prompt ids only where the repetition
    penalty is on), padded to one length. Rows with no such id are left out.

    Padding repeats the row's last id with zero output weight: it is never counted, and it rewrites the value that
    id gets, so duplicate writes agree.
    """

    rows: torch.Tensor  # [P] int64
    token_ids: torch.Tensor  # [P, L] int64
    output_weight: torch.Tensor  # [P, L] float32: 1 at the output tokens (presence / frequency count them)
    repetition: torch.Tensor  # [P, 1] float32
    presence: torch.Tensor  # [P, 1] float32
    frequency: torch.Tensor  # [P, 1] float32


@dataclass
class SamplingMetadata:
    vocab_size: int
    # [B, 4] float64, one row per request: temperature (greedy rows hold 1.0, the zero guard), top_k (off = vocab
    # size), top_p (off = 1.0), min_p (off = 0.0); one tensor so that a row subset is one index_select
    params: torch.Tensor
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    window: int  # K of the top-K window the truncating rows are drawn from
    random_rows: torch.Tensor  # the rows that are not greedy (host-known index tensors from here on)
    # Random rows by how they are drawn:
    mass_rows: torch.Tensor  # no top-k / min-p: need the whole-vocabulary mass (and without top-p, a draw over it)
    window_rows: torch.Tensor  # top-k / top-p / min-p: drawn inside the top-K window
    covered_rows: torch.Tensor  # the window rows with top_k <= K: the window always holds their kept set
    uncovered_rows: torch.Tensor  # the other window rows: their kept set may reach beyond the window
    # Random rows by the truncations the sort-free draw searches a threshold for:
    top_k_rows: torch.Tensor  # top_k below the vocabulary size
    top_p_rows: torch.Tensor  # top_p below 1
    seeded_rows: torch.Tensor  # the random rows with a seed ...
    seeds: torch.Tensor  # ... their seeds [S] int64 ...
    positions: torch.Tensor  # ... and the output positions they sample [S] int64 (set afresh every step)
    seed_index: torch.Tensor  # [B] int64: each row's index into seeds and positions (-1: not seeded)
    logprob_rows: torch.Tensor  # the rows that asked for logprobs
    max_num_logprobs: int | None  # N of the top-N logprobs (the largest asked); None = no row asked
    allowed: TokenEntries | None = None
    bad_words: TokenEntries | None = None
    min_tokens: TokenEntries | None = None
    logit_bias: TokenEntries | None = None
    penalties: PenaltyTokens | None = None
    edits: Edits | None = None  # with edits=True: every processor's ids as one table (the five above None)

    @classmethod
    def build(
        cls,
        rows: list[SamplingRow],
        vocab_size: int,
        device: torch.device | str,
        window: int = WINDOW,
        edits: bool = False,
    ) -> SamplingMetadata:
        """The step's metadata; with `edits`, the processors' ids as the fused sampler's table (gpu/sampling/edits.py)
        instead of the torch path's entries."""
        ps = [r.params for r in rows]
        greedy = [p.greedy for p in ps]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in ps]
        random = [i for i, g in enumerate(greedy) if not g]
        untruncated = [i for i in random if top_k[i] == vocab_size and ps[i].min_p == 0.0]
        window_rows = sorted(set(random) - {i for i in untruncated if ps[i].top_p >= 1.0})
        seeded = [i for i, p in enumerate(ps) if _seeded(p)]
        logprob_rows = [i for i, p in enumerate(ps) if p.logprobs is not None]
        params = [(1.0 if g else p.temperature, k, p.top_p, p.min_p) for p, g, k in zip(ps, greedy, top_k, strict=True)]
        entries = [_Entries() for _ in range(4)]  # allowed, bad words, min_tokens, logit bias
        for i, r in enumerate([] if edits else rows):
            *ids, bias = row_ids(r)
            for kind, ids_k in zip(entries, [*ids, list(bias)], strict=True):
                kind.add(i, ids_k)
            entries[3].values += bias.values()
        allowed, bad_words, min_tokens, logit_bias = (e.tensors(device) for e in entries)
        seed_index = np.full(len(rows), -1, np.int64)
        seed_index[seeded] = np.arange(len(seeded))
        return cls(
            vocab_size=vocab_size,
            params=to_device(params, torch.float64, device).view(-1, 4),
            greedy=to_device(greedy, torch.bool, device),
            all_greedy=not random,
            window=window,
            random_rows=to_device(random, torch.int64, device),
            mass_rows=to_device(untruncated, torch.int64, device),
            window_rows=to_device(window_rows, torch.int64, device),
            covered_rows=to_device([i for i in window_rows if top_k[i] <= window], torch.int64, device),
            uncovered_rows=to_device([i for i in window_rows if top_k[i] > window], torch.int64, device),
            top_k_rows=to_device([i for i in random if top_k[i] < vocab_size], torch.int64, device),
            top_p_rows=to_device([i for i in random if ps[i].top_p < 1.0], torch.int64, device),
            seeded_rows=to_device(seeded, torch.int64, device),
            seeds=to_device([ps[i].seed for i in seeded], torch.int64, device),
            positions=to_device([rows[i].sample_position for i in seeded], torch.int64, device),
            seed_index=to_device(seed_index, torch.int64, device),
            logprob_rows=to_device(logprob_rows, torch.int64, device),
            max_num_logprobs=max((ps[i].logprobs for i in logprob_rows), default=None),
            allowed=allowed,
            bad_words=bad_words,
            min_tokens=min_tokens,
            logit_bias=logit_bias,
            penalties=None if edits else _penalties(rows, device),
            edits=build_edits(rows, device) if edits else None,
        )


class MetadataCache:
    """SamplingMetadata.build, reusing the last step's metadata while the batch holds the same requests in the same
    rows and none of them reads its output (penalties, bad words, min_tokens not reached): then nothing in it can
    have changed. Decode steps of a steady batch build nothing. Rows are compared by the identity of their
    request's output list (one per request, even where requests share a params object) and params; the cache
    holds the last rows, so no id can be reused meanwhile. The seeded rows' positions are set afresh each step."""

    def __init__(self, vocab_size: int, device: torch.device | str, edits: bool = False):
        self.vocab_size, self.device, self.edits = vocab_size, device, edits  # (edits: SamplingMetadata.build's)
        self._rows: list[SamplingRow] = []
        self._meta: SamplingMetadata | None = None

    def build(self, rows: list[SamplingRow]) -> SamplingMetadata:
        same = len(rows) == len(self._rows) and all(
            a.output_token_ids is b.output_token_ids and a.params is b.params
            for a, b in zip(rows, self._rows, strict=True)
        )
        if not same or self._meta is None:
            meta = SamplingMetadata.build(rows, self.vocab_size, self.device, edits=self.edits)
            static = not any(reads_output(r.params, len(r.output_token_ids)) for r in rows)
            self._rows, self._meta = (rows, meta) if static else ([], None)
            return meta
        meta = self._meta
        if meta.seeds.numel():
            positions = [r.sample_position for r in rows if _seeded(r.params)]
            meta.positions = to_device(positions, torch.int64, self.device)
        return meta


class _Entries:
    """Collects (row, token[, value]) entries on the host."""

    def __init__(self):
        self.rows, self.tokens, self.values = [], [], []

    def add(self, row: int, tokens: list[int]) -> None:
        self.rows += [row] * len(tokens)
        self.tokens += tokens

    def tensors(self, device) -> TokenEntries | None:
        if not self.rows:
            return None
        return TokenEntries(
            rows=to_device(self.rows, torch.int64, device),
            tokens=to_device(self.tokens, torch.int64, device),
            values=to_device(self.values, torch.float32, device) if self.values else None,
            row_ids=to_device(sorted(set(self.rows)), torch.int64, device),
        )


def _penalties(rows: list[SamplingRow], device) -> PenaltyTokens | None:
    idx, seqs, outs = [], [], []
    for i, r in enumerate(rows):
        seq = penalty_ids(r)
        if seq is not None and len(seq):
            idx.append(i)
            seqs.append(seq)
            outs.append(len(r.output_token_ids))
    if not idx:
        return None
    lengths = np.array([len(s) for s in seqs])
    token_ids = np.zeros((len(seqs), lengths.max()), np.int64)
    for j, s in enumerate(seqs):
        token_ids[j, : len(s)] = s
        token_ids[j, len(s) :] = s[-1]
    pos = torch.arange(token_ids.shape[1], device=device)
    end = to_device(lengths, torch.int64, device)[:, None]
    ps = [rows[i].params for i in idx]

    def column(values) -> torch.Tensor:
        return to_device(values, torch.float32, device)[:, None]

    return PenaltyTokens(
        rows=to_device(idx, torch.int64, device),
        token_ids=to_device(token_ids, torch.int64, device),
        output_weight=((pos >= end - to_device(outs, torch.int64, device)[:, None]) & (pos < end)).float(),
        repetition=column([p.repetition_penalty for p in ps]),
        presence=column([p.presence_penalty for p in ps]),
        frequency=column([p.frequency_penalty for p in ps]),
    )


def _seeded(p: SamplingParams) -> bool:
    """A random row with a seed: its uniforms are keyed by (seed, output position)."""
    return p.seed is not None and not p.greedy


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """Host values as a tensor on `device`, without a host sync (torch.tensor(..., device=cuda) synchronizes)."""
    return torch.as_tensor(np.asarray(values), dtype=dtype).to(device, non_blocking=True)

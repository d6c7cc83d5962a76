"""Speculative decoding on the host: the n-gram (prompt lookup) proposer and the acceptance counters.

The proposer drafts tokens from the request's own prompt and output.
The longest suffix n-gram of the sequence (n from prompt_lookup_max down to prompt_lookup_min) is
looked up earlier in the sequence; the tokens that followed its most recent earlier occurrence are
the draft. The draft distribution q is a point mass on them, so verification needs no draft
probabilities (gpu/sampling/spec.py). Host-side numpy: O(length x n) compares per request and step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from actors.engine.config import SpeculativeConfig
from actors.engine.request import EngineRequest


def propose_ngram(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k draft tokens continuing `tokens` (int64, prompt + output); [] when no n-gram recurs."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        windows = sliding_window_view(tokens[:-1], n)  # start i in [0, length - 1 - n]: a token follows each
        hits = np.flatnonzero((windows == tokens[-n:]).all(1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


def ngram_proposer(config: SpeculativeConfig) -> Callable[[EngineRequest, int], list[int]]:
    """The scheduler's proposer: (request, at most k) -> up to min(k, K) draft tokens."""
    lo, hi, big_k = config.prompt_lookup_min, config.prompt_lookup_max, config.num_speculative_tokens

    def propose(req: EngineRequest, k: int) -> list[int]:
        tokens = np.fromiter((*req.prompt_token_ids, *req.output_token_ids), np.int64)
        return propose_ngram(tokens, min(k, big_k), lo, hi)

    return propose


@dataclass
class SpecStats:
    """vLLM's spec_decode counters: rows that verified drafts, draft tokens, accepted ones (and per position)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i

    def observe(self, num_drafts: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        self.accepted_per_pos.extend([0] * (num_drafts - len(self.accepted_per_pos)))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

"""Speculative decoding on the host: the n-gram (prompt lookup) proposer, drafting tokens from the
request's own prompt and output.
The longest suffix n-gram of the sequence (n from prompt_lookup_max down to prompt_lookup_min) is
looked up earlier in the sequence; the tokens that followed its most recent earlier occurrence are
the draft. The draft distribution q is a point mass on them, so verification needs no draft
probabilities (gpu/sampling/spec.py). Host-side numpy: O(length x n) compares per request and step.
"""

from __future__ import annotations

from collections.abc import Callable

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

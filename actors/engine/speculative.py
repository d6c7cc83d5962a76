"""Speculative decoding on the host: the n-gram (prompt lookup) proposer, drafting tokens from the
request's own prompt and output, and `make_proposer` (the draft-model proposer is actors/engine/draft.py).

The longest suffix n-gram of the sequence (n from prompt_lookup_max down to prompt_lookup_min) is
looked up earlier in the sequence; the tokens that followed its most recent earlier occurrence are
the draft. The draft distribution q is a point mass on them, so verification needs no draft
probabilities (gpu/sampling/spec.py). Host-side numpy: O(length x n) compares per request and step.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from actors.engine.config import EngineConfig, SpeculativeConfig
from actors.engine.draft import DraftProposer
from actors.engine.request import EngineRequest
from gpu.loading.config import ModelConfig


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


class NgramProposer:
    """The scheduler's proposer for method "ngram" (the draft-model one is actors/engine/draft.py)."""

    def __init__(self, config: SpeculativeConfig):
        self.lo, self.hi, self.k = config.prompt_lookup_min, config.prompt_lookup_max, config.num_speculative_tokens

    def propose(self, items: list[tuple[EngineRequest, int]]) -> dict[str, list[int]]:
        """Up to min(k, K) drafts for each (request, k)."""
        out = {}
        for req, k in items:
            tokens = np.fromiter((*req.prompt_token_ids, *req.output_token_ids), np.int64)
            out[req.request_id] = propose_ngram(tokens, min(k, self.k), self.lo, self.hi)
        return out

    def release(self, request_id: str) -> None:
        """Nothing is kept per request."""


def make_proposer(config: EngineConfig, model: ModelConfig, num_blocks: int) -> NgramProposer | DraftProposer | None:
    """The proposer `config.speculative` asks for (None: no speculation). Loads a draft model: call it on the
    device thread."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec)
    return DraftProposer(config, model, num_blocks)

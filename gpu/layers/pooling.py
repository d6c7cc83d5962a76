"""Pooling: each input's hidden states [n, hidden] (inputs packed one after another) to one embedding.

CLS: the first token's state; MEAN: the mean over the input's tokens; MAX: the per-dimension max; LAST: the last
token's (a causal model's embedding). Then, where asked, L2 normalization (torch's `F.normalize`, eps 1e-12, as
sentence-transformers' Normalize). Each input is reduced alone, so its embedding does not depend on the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pool(hidden: torch.Tensor, lens: list[int], pooling_type: str, normalize: bool) -> torch.Tensor:
    """[len(lens), hidden] embeddings of the inputs packed in `hidden` ([sum(lens), hidden])."""
    rows = []
    for x in hidden.split(lens):
        if pooling_type == "CLS":
            rows.append(x[0])
        elif pooling_type == "LAST":
            rows.append(x[-1])
        elif pooling_type == "MEAN":
            rows.append(x.sum(0) / len(x))
        else:
            rows.append(x.amax(0))
    out = torch.stack(rows)
    return F.normalize(out, p=2, dim=-1) if normalize else out

"""The logit processors that can move the argmax: allowed ids, bans, logit bias, penalties.

All of them are sparse: they touch only the (row, token) pairs the requests name, so their cost follows the number
of ids involved, never B x V. They modify the float32 logits in place.
"""

from __future__ import annotations

import torch

from .metadata import PenaltyTokens, TokenEntries


def apply_allowed(x: torch.Tensor, allowed: TokenEntries | None) -> None:
    """Rows with allowed_token_ids keep only those ids (the others become -inf)."""
    if allowed is None:
        return
    kept = x[allowed.rows, allowed.tokens]
    x.index_fill_(0, allowed.row_ids, float("-inf"))
    x.index_put_((allowed.rows, allowed.tokens), kept)


def apply_ban(x: torch.Tensor, banned: TokenEntries | None) -> None:
    """Banned ids (bad words, EOS / stop ids before min_tokens) become -inf."""
    if banned is not None:
        x.index_put_((banned.rows, banned.tokens), x.new_full((), float("-inf")))


def apply_logit_bias(x: torch.Tensor, bias: TokenEntries | None) -> None:
    """OpenAI logit_bias: added to the logits (already clamped to +-100 on the host)."""
    if bias is not None:
        x.index_put_((bias.rows, bias.tokens), bias.values, accumulate=True)


def apply_penalties(x: torch.Tensor, p: PenaltyTokens | None) -> None:
    """vLLM semantics: repetition over prompt + output ids (positive logits divided, others multiplied), then
    frequency (times the output count) and presence (once per id seen in the output) subtracted."""
    if p is None:
        return
    ids = p.token_ids
    rows = p.rows[:, None].expand_as(ids)
    count = output_counts(ids, p.output_weight)
    v = x[rows, ids]  # every position holds an id of its row's prompt or output: all get the repetition penalty
    v = torch.where(v > 0, v / p.repetition, v * p.repetition) - p.frequency * count - p.presence * (count > 0)
    x.index_put_((rows, ids), v)  # duplicate ids of a row carry identical values


def output_counts(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """For every position of ids [P, L]: the weight summed over the positions of its row holding the same id.

    Counting by sorted runs costs O(L log L) per row; a dense [P, V] count would cost a zeroed B x V buffer per step.
    """
    sorted_ids, order = ids.sort(-1)
    c = torch.nn.functional.pad(weight.gather(1, order).cumsum(-1), (1, 0))  # c[:, j] = weight of the first j
    hi = torch.searchsorted(sorted_ids, ids, right=True)
    return c.gather(1, hi) - c.gather(1, torch.searchsorted(sorted_ids, ids))

"""Raw logprobs (log_softmax of the unprocessed float32 logits, vLLM's default) of the sampled tokens: their
logprob, their rank, and the top-N of the row."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .topk_topp import Blocks


@dataclass
class LogprobsTensors:
    sampled: torch.Tensor  # [B] float32: the sampled token's raw logprob
    ranks: torch.Tensor  # [B] int64: how many tokens have a raw logprob >= the sampled token's (vLLM's rank)
    top_ids: torch.Tensor  # [B, N] int64, by decreasing logprob (each row trims to its own N)
    top_logprobs: torch.Tensor  # [B, N] float32


def log_softmax_into(
    x: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor, row_sum: Callable[[torch.Tensor], torch.Tensor] | None
) -> torch.Tensor:
    """log_softmax of x [n, V] written into out [n, Vp] (Vp: whole blocks, the padding -inf). row_sum: [n, V] ->
    [n, 1], torch's sum where None (batch-invariant mode: gpu/kernels/native's row_sum; torch splits one row's sum over
    the threads, several rows' not).

    out and scratch are reused buffers: a fresh B x V tensor per step costs page faults at large B x V.
    """
    v = x.shape[1]
    lp = out[:, :v]
    torch.sub(x, x.amax(-1, keepdim=True), out=lp)
    e = torch.exp(lp, out=scratch[:, :v])
    lp.sub_((e.sum(-1, keepdim=True) if row_sum is None else row_sum(e)).log_())
    out[:, v:] = float("-inf")
    return out


def gather_logprobs(lp: torch.Tensor, vocab_size: int, token_ids: torch.Tensor, n: int) -> LogprobsTensors:
    """Logprob and rank of token_ids [n_rows] under lp [n_rows, Vp] (from log_softmax_into), and the top-n."""
    sampled = lp.gather(1, token_ids[:, None]).squeeze(1)
    ranks = (lp[:, :vocab_size] >= sampled[:, None]).sum(-1)
    top_logprobs, top_ids = Blocks(lp).top(torch.arange(lp.shape[0], device=lp.device), n)
    return LogprobsTensors(sampled, ranks, top_ids, top_logprobs)

"""Tensor-parallel sharding of the blocks: which part of each checkpoint tensor a rank holds, and the embedding
whose vocabulary is split. The blocks call these with the group of their process (gpu/distributed/group.py); a
family file never sees the world size. At size 1 every shard is the whole tensor and nothing changes.

| block                         | sharded as                                  | after it                             |
|-------------------------------|---------------------------------------------|--------------------------------------|
| q / k / v, gate / up (stacked | column-parallel: each rank its heads (KV    | nothing: each rank attends over (or  |
| or fused in the checkpoint)   | heads replicated where ranks > KV heads),   | activates) its own part              |
|                               | its slice of the intermediate dim           |                                      |
| o_proj, down_proj, experts'   | row-parallel: the matching input columns;   | one all-reduce (the block's forward) |
| down                          | a bias on the first rank only               |                                      |
| embed_tokens, lm_head         | vocab-parallel: ceil(V / N) rows each, the  | embedding: all-reduce; logits:       |
|                               | last rank's padded with zeros               | gathered on the first rank, cut to V |
| norms, router, rotary         | replicated                                  |                                      |

A module keeps its parameters' shards in `module.shards` (parameter name -> Shard); the loader (gpu/weights.py)
reads only those ranges of a tensor from safetensors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from gpu.distributed.group import TensorParallel, current


@dataclass(frozen=True)
class Shard:
    """This rank's part of a checkpoint tensor: along `dim`, the (start, length) `ranges`, concatenated, at the front
    of the parameter (the rest of it zero-filled); `full`, the tensor's size along `dim` in the checkpoint."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    full: int

    def read(self, tensor) -> torch.Tensor:
        """The ranges of a safetensors slice (or a tensor), concatenated along dim."""
        lead = (slice(None),) * self.dim
        return torch.cat([tensor[(*lead, slice(start, start + n))] for start, n in self.ranges], self.dim)


def split(n: int, what: str, tp: TensorParallel) -> tuple[int, int]:
    """(start, length) of this rank's equal share of n."""
    if n % tp.size:
        raise ValueError(f"tensor_parallel_size {tp.size} does not divide the model's {what} ({n})")
    return tp.rank * (n // tp.size), n // tp.size


def kv_heads(num_heads: int, num_kv: int, tp: TensorParallel) -> tuple[int, int]:
    """(first, count) of the KV heads a rank holds: its share, or where ranks outnumber them, the one its query heads
    read (replicated)."""
    split(num_heads, "attention heads", tp)
    if num_kv >= tp.size:
        return split(num_kv, "key-value heads", tp)
    if tp.size % num_kv:
        raise ValueError(f"tensor_parallel_size {tp.size} is not a multiple of the model's {num_kv} key-value heads")
    return tp.rank * num_kv // tp.size, 1


def local_config(c, tp: TensorParallel):
    """A model config with the heads one rank holds (its KV cache's shape)."""
    heads = split(c.num_attention_heads, "attention heads", tp)[1]
    return replace(
        c, num_attention_heads=heads, num_key_value_heads=kv_heads(c.num_attention_heads, c.num_key_value_heads, tp)[1]
    )


def shard(module: nn.Module, **shards: Shard) -> nn.Module:
    module.shards = {**getattr(module, "shards", {}), **shards}
    return module


def column(module: nn.Module, ranges: list[tuple[int, int]], full: int) -> nn.Module:
    """A column-parallel linear: these output rows of the checkpoint's weight (and bias)."""
    rows = Shard(0, tuple(ranges), full)
    return shard(module, weight=rows, **({"bias": rows} if getattr(module, "bias", None) is not None else {}))


def row(module: nn.Module, ranges: list[tuple[int, int]], full: int, tp: TensorParallel) -> nn.Module:
    """A row-parallel linear: these input columns of the weight; its bias added once, by the first rank."""
    shard(module, weight=Shard(1, tuple(ranges), full))
    if getattr(module, "bias", None) is not None:
        out = module.bias.shape[0]
        shard(module, bias=Shard(0, ((0, out),) if tp.first else (), out))
    return module


def vocab_range(vocab: int, tp: TensorParallel) -> tuple[int, int, int]:
    """(first id, ids held, rows per rank) of this rank's vocabulary share."""
    per = -(-vocab // tp.size)
    start = min(vocab, tp.rank * per)
    return start, min(vocab, start + per) - start, per


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab: int, hidden: int) -> None:
        self.tp = current()
        self.start, held, per = vocab_range(vocab, self.tp)
        super().__init__(per, hidden)
        shard(self, weight=Shard(0, ((self.start, held),), vocab))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0))

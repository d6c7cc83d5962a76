"""Tensor-parallel sharding of the blocks: which part of each checkpoint tensor a rank holds, and the embedding
whose vocabulary is split. The blocks call these with the group of their process (gpu/distributed/group.py); a
family file never sees the world size. At size 1 every shard is the whole tensor and nothing changes.

| block                         | sharded as                                  | after it                             |
|-------------------------------|---------------------------------------------|--------------------------------------|
| q / k / v, gate / up (stacked | column-parallel: each rank its KV groups    | nothing: each rank attends over (or  |
| or fused in the checkpoint)   | (KV heads replicated where ranks > KV       | activates) its own part              |
|                               | heads), its slice of the intermediate dim   |                                      |
| o_proj, down_proj, experts'   | row-parallel: the matching input columns;   | one all-reduce (the block's forward) |
| down                          | a bias on the first rank only               |                                      |
| embed_tokens, lm_head         | vocab-parallel: ceil(V / N) rows each, the  | embedding: all-reduce; logits:       |
|                               | last rank's padded with zeros               | gathered on the first rank, cut to V |
| norms, router, rotary         | replicated                                  |                                      |

Shares need not be equal (9 heads over 2 ranks), only each rank's non-empty: the first ranks take the larger ones.
A module keeps its parameters' shards in `module.shards` (parameter name -> one Shard per checkpoint tensor stacked
into it by rows: q, k and v into one qkv_proj, gate and up into gate_up_proj; `stacked`); the loader
(gpu/loading/weights.py) reads only those ranges of each tensor, the parts one after the other.
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

    @property
    def length(self) -> int:
        return sum(n for _, n in self.ranges)

    def read(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ranges of a tensor, concatenated along dim (a view where there is one)."""
        parts = [tensor.narrow(self.dim, start, n) for start, n in self.ranges] or [tensor.narrow(self.dim, 0, 0)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, self.dim)


def split(n: int, what: str, tp: TensorParallel) -> tuple[int, int]:
    """(start, length) of this rank's share of n: as even as can be, the first ranks' the larger (the first rank's is
    the largest: its KV cache sizes every rank's block count)."""
    if n < tp.size:
        raise ValueError(f"tensor_parallel_size {tp.size} exceeds the model's {what} ({n})")
    start, end = -(-tp.rank * n // tp.size), -(-(tp.rank + 1) * n // tp.size)
    return start, end - start


@dataclass(frozen=True)
class Heads:
    """The attention heads a rank holds: query heads [q, q + num_q), KV heads [kv, kv + num_kv)."""

    q: int
    num_q: int
    kv: int
    num_kv: int


def heads(num_heads: int, num_kv: int, tp: TensorParallel) -> Heads:
    """A rank's heads: whole KV groups (a KV head and the query heads that read it), split as evenly as can be
    (SmolLM2's 3 groups over 2 ranks: 2 and 1); where ranks outnumber the KV heads, each KV head is replicated on
    tp.size / num_kv ranks, which split its group's query heads."""
    group = num_heads // num_kv
    if num_kv >= tp.size:
        kv, n = split(num_kv, "key-value heads", tp)
        return Heads(kv * group, n * group, kv, n)
    if tp.size % num_kv:
        raise ValueError(f"tensor_parallel_size {tp.size} is neither at most nor a multiple of the model's {num_kv} "
                         "key-value heads")  # fmt: skip
    per_head = tp.size // num_kv  # ranks sharing a KV head
    kv = tp.rank // per_head
    q, n = split(group, "query heads per key-value head", TensorParallel(tp.rank % per_head, per_head))
    return Heads(kv * group + q, n, kv, 1)


def local_config(c, tp: TensorParallel):
    """A model config with the heads one rank holds (its KV cache's shape)."""
    h = heads(c.num_attention_heads, c.num_key_value_heads, tp)
    return replace(c, num_attention_heads=h.num_q, num_key_value_heads=h.num_kv)


def shard(module: nn.Module, **shards: Shard | tuple[Shard, ...]) -> nn.Module:
    parts = {name: s if isinstance(s, tuple) else (s,) for name, s in shards.items()}
    module.shards = {**getattr(module, "shards", {}), **parts}
    return module


def stacked(module: nn.Module, parts: list[tuple[list[tuple[int, int]], int]]) -> nn.Module:
    """A column-parallel linear whose weight (and bias) stacks several checkpoint tensors by rows: of each part's
    tensor (ranges, full size), these output rows."""
    rows = tuple(Shard(0, tuple(ranges), full) for ranges, full in parts)
    return shard(module, weight=rows, **({"bias": rows} if getattr(module, "bias", None) is not None else {}))


def column(module: nn.Module, ranges: list[tuple[int, int]], full: int) -> nn.Module:
    """A column-parallel linear: these output rows of the checkpoint's weight (and bias)."""
    return stacked(module, [(ranges, full)])


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

    def reset_parameters(self) -> None:
        """Skipped on meta (the loader's build: the checkpoint fills it), where `init.normal_` imports torch._dynamo:
        a second of every start."""
        if not self.weight.is_meta:
            super().reset_parameters()

    rows = None  # the tied LM head's `rows`, once its native panels hold the table's one copy (read_from)
    widen_to: torch.dtype | None = None  # the activations' dtype, where the table is held in a narrower one (hold_in)

    def read_from(self, head) -> None:
        """Look rows up in `head` (the tied LM head, gpu/layers/linear.py, in its native panels) and hold no table
        (before the load: the loader writes the checkpoint's table into the head)."""
        self.rows = head.rows  # (a bound method, not the module: head is not registered as a child)
        self.weight = nn.Parameter(torch.empty(self.weight.shape, device="meta"), requires_grad=False)
        self.placed = {"weight": None}  # (left on meta by the loader's materialize)

    def hold_in(self, dtype: torch.dtype, activations: torch.dtype) -> None:
        """Hold the table in `dtype` (a 16-bit checkpoint's, on CPU), its rows widened to `activations` as they are
        looked up (before the load)."""
        self.placed, self.widen_to = {"weight": dtype}, activations

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:
            return self.rows(ids)
        x = F.embedding(ids, self.weight)
        return x if self.widen_to is None else x.to(self.widen_to)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.lookup(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = self.lookup(local.masked_fill(outside, 0))
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0))

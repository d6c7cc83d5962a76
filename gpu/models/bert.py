"""BERT-style encoders (BertModel, RobertaModel, XLMRobertaModel, MPNetModel, and the encoder of their *For* and
sentence-transformers checkpoints): absolute positions (RoBERTa's and MPNet's counted from the padding id) and token
types (MPNet has none) added to the word embeddings, then post-norm layers of bidirectional attention over each input
alone and a GELU MLP. MPNet's attention adds a learned bias per head and relative-position bucket (T5's bidirectional
buckets: `relative_buckets`), shared by every layer. Prefill-only, for pooling (gpu/layers/pooling.py): no KV cache.

Inputs come packed: the tokens of every input one after another, with each input's length; attention runs per input,
the linear layers over all tokens at once. On the native kernels (the linear layers' weights held in their panels)
attention is their packed kernel too (csrc/encoder_attention.cpp), and each row's result is the same bits in any
batch; else torch's SDPA per input.
`config`: a gpu/loading/encoder_config.py EncoderConfig (the layer above: not imported).
Checkpoint names are HF's less the head's prefix (`checkpoint_name`); a head's own tensors (MLM, NSP, the BERT
pooler's dense layer, a classifier) are skipped by name.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from gpu.layers.linear import Linear

HEADS = re.compile(r"^(cls|pooler|classifier|lm_head)\.|position_ids$")  # (heads' tensors; a buffer some files keep)
CLASSIFIER = tuple((re.compile(p), to) for p, to in (  # (BERT's pooler and classifier; RoBERTa's classifier head)
    (r"^classifier\.dense\.", "head.dense."), (r"^classifier\.out_proj\.", "head.classifier."),
    (r"^pooler\.dense\.", "head.dense."), (r"^classifier\.", "head.classifier."),
))  # fmt: skip
RENAMES = (
    (re.compile(r"\.attention\.self\.(query|key|value)\."), lambda m: f".{m[1][0]}."),
    (re.compile(r"\.attention\.output\.dense\.|\.attention\.attn\.o\."), ".o."),
    (re.compile(r"\.attention\.attn\.([qkv])\."), r".\1."),  # (MPNet's)
    (re.compile(r"\.attention\.(output\.)?LayerNorm\."), ".attn_norm."),
    (re.compile(r"\.intermediate\.dense\."), ".up."),
    (re.compile(r"\.output\.dense\."), ".down."),
    (re.compile(r"\.output\.LayerNorm\."), ".mlp_norm."),
    (re.compile(r"^encoder\.layer\."), "layers."),
    (re.compile(r"^encoder\.relative_attention_bias\."), "relative_attention_bias."),
    (re.compile(r"^embeddings\.LayerNorm\."), "embeddings.norm."),
)


class EncoderLayer(nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        h = c.hidden_size
        self.heads, self.act = c.num_attention_heads, c.hidden_act
        self.q, self.k, self.v, self.o = (Linear(h, h) for _ in range(4))
        self.up, self.down = Linear(h, c.intermediate_size), Linear(c.intermediate_size, h)
        self.attn_norm, self.mlp_norm = nn.LayerNorm(h, c.layer_norm_eps), nn.LayerNorm(h, c.layer_norm_eps)

    def forward(self, x: torch.Tensor, lens: list[int], bias: torch.Tensor | None) -> torch.Tensor:
        """`bias`: BertModel.position_bias's, or None."""
        q, k, v = self.q(x), self.k(x), self.v(x)
        if (ops := self.q.native_ops) is not None:  # (held in the native panels: their attention too)
            attn = ops.encoder_attention(q, k, v, lens, self.heads, 1 / math.sqrt(x.shape[1] // self.heads), bias)
        else:
            attn = self.torch_attention(q, k, v, lens, bias)
        x = self.attn_norm(x + self.o(attn))
        return self.mlp_norm(x + self.down(self.up.activated(x, self.act)))

    def torch_attention(self, q, k, v, lens: list[int], bias: torch.Tensor | None) -> torch.Tensor:
        t, h = q.shape
        q, k, v = (z.view(t, self.heads, h // self.heads).transpose(0, 1) for z in (q, k, v))
        parts = []
        for qi, ki, vi in zip(q.split(lens, 1), k.split(lens, 1), v.split(lens, 1), strict=True):
            n = qi.shape[1]
            mask = None if bias is None else bias[:, offsets(n) + (bias.shape[1] - 1) // 2].unsqueeze(0)
            parts.append(F.scaled_dot_product_attention(*(z.unsqueeze(0) for z in (qi, ki, vi)), attn_mask=mask)[0])
        return torch.cat(parts, 1).transpose(0, 1).reshape(t, h)  # (4-D: the CPU's flash kernel, not the math path)


class Embeddings(nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size) if c.type_vocab_size else None
        self.norm = nn.LayerNorm(c.hidden_size, c.layer_norm_eps)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, types: torch.Tensor | None) -> torch.Tensor:
        x = self.word_embeddings(ids) + self.position_embeddings(positions)
        if (table := self.token_type_embeddings) is not None:
            x = x + (table.weight[0] if types is None else table(types))
        return self.norm(x)


class ClassifierHead(nn.Module):
    """A cross-encoder's: BERT's pooler (dense and tanh over an input's first token), then the classifier."""

    def __init__(self, c) -> None:
        super().__init__()
        self.dense, self.classifier = Linear(c.hidden_size, c.hidden_size), Linear(c.hidden_size, len(c.labels))

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.dense(first)))


class BertModel(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))
        self.head = ClassifierHead(config) if config.labels else None
        buckets, heads = config.relative_buckets, config.num_attention_heads
        self.relative_attention_bias = nn.Embedding(buckets, heads) if buckets else None

    def checkpoint_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor loads into; None for a tensor of a head not served (skipped)."""
        name = re.sub(r"^(bert|roberta|mpnet)\.", "", name)
        for pattern, to in CLASSIFIER if self.head is not None else ():
            if pattern.match(name):
                return pattern.sub(to, name)
        if HEADS.search(name):
            return None
        for pattern, to in RENAMES:
            name = pattern.sub(to, name)
        return name

    def forward(self, ids: torch.Tensor, lens: list[int], types: torch.Tensor | None = None) -> torch.Tensor:
        """The last hidden states [len(ids), hidden] of the inputs packed in `ids` (their lengths `lens`; `types`:
        each token's segment, a pair's second text 1; None: all 0)."""
        pad = self.config.pad_positions
        if pad is None:
            positions = torch.cat([torch.arange(n, device=ids.device) for n in lens])
        else:  # (RoBERTa's: counted from pad + 1 over the tokens that are not padding, which keep pad's)
            real = (ids != pad).int()
            positions = torch.cat([(m.cumsum(0) * m) for m in real.split(lens)]) + pad
        x = self.embeddings(ids, positions, types)
        bias = self.position_bias(max(lens))
        for layer in self.layers:
            x = layer(x, lens, bias)
        return x

    def position_bias(self, longest: int) -> torch.Tensor | None:
        """MPNet's attention bias by offset, [heads, 2 longest - 1]: key j's score from query i gets column j - i +
        longest - 1 of its head's row; None for a model without one."""
        if self.relative_attention_bias is None:
            return None
        offset = torch.arange(1 - longest, longest)
        return self.relative_attention_bias(relative_buckets(offset)).t().contiguous()

    def classify(self, hidden: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """A cross-encoder's logits [len(lens), labels] from the hidden states `forward` gave."""
        starts = torch.tensor([0, *lens[:-1]]).cumsum(0)
        return self.head(hidden[starts])


def offsets(n: int) -> torch.Tensor:
    """Each key's offset from its query, j - i, [n, n]."""
    return torch.arange(n)[None, :] - torch.arange(n)[:, None]


def relative_buckets(offset: torch.Tensor, buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """The bucket of each key's offset from its query (T5's bidirectional buckets, as HF's MPNet computes them: always
    32): half the buckets for keys after the query; in a half, the offsets under a quarter of the buckets exactly,
    then log-spaced up to max_distance, the last bucket beyond."""
    half = buckets // 2
    exact, far = half // 2, offset.abs()
    spaced = exact + (torch.log(far.clamp(min=1) / exact) / math.log(max_distance / exact) * (half - exact)).long()
    return (offset > 0).long() * half + torch.where(far < exact, far, spaced.clamp(max=half - 1))

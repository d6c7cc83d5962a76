"""BERT-style encoders (BertModel, RobertaModel, XLMRobertaModel, and the encoder of their *For* and
sentence-transformers checkpoints): absolute positions (RoBERTa's counted from its padding id) and token types added to the word embeddings, then post-norm layers of bidirectional attention over each
input alone and a GELU MLP. Prefill-only, for pooling (gpu/layers/pooling.py): no KV cache is kept.

Inputs come packed: the tokens of every input one after another, with each input's length; attention runs per input,
the linear layers over all tokens at once (on the native kernels each row's result is the same bits in any batch).
`config`: a gpu/loading/encoder_config.py EncoderConfig (the layer above: not imported).
Checkpoint names are HF's less the head's prefix (`checkpoint_name`); a head's own tensors (MLM, NSP, the BERT
pooler's dense layer, a classifier) are skipped by name.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from gpu.kernels.reference import ACTIVATIONS
from gpu.layers.linear import Linear

HEADS = re.compile(r"^(cls|pooler|classifier|lm_head)\.|position_ids$")  # (heads' tensors; a buffer some files keep)
CLASSIFIER = tuple((re.compile(p), to) for p, to in (  # (BERT's pooler and classifier; RoBERTa's classifier head)
    (r"^classifier\.dense\.", "head.dense."), (r"^classifier\.out_proj\.", "head.classifier."),
    (r"^pooler\.dense\.", "head.dense."), (r"^classifier\.", "head.classifier."),
))  # fmt: skip
RENAMES = (
    (re.compile(r"\.attention\.self\.(query|key|value)\."), lambda m: f".{m[1][0]}."),
    (re.compile(r"\.attention\.output\.dense\."), ".o."),
    (re.compile(r"\.attention\.output\.LayerNorm\."), ".attn_norm."),
    (re.compile(r"\.intermediate\.dense\."), ".up."),
    (re.compile(r"\.output\.dense\."), ".down."),
    (re.compile(r"\.output\.LayerNorm\."), ".mlp_norm."),
    (re.compile(r"^encoder\.layer\."), "layers."),
    (re.compile(r"^embeddings\.LayerNorm\."), "embeddings.norm."),
)


class EncoderLayer(nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        h = c.hidden_size
        self.heads, self.act = c.num_attention_heads, ACTIVATIONS[c.hidden_act]
        self.q, self.k, self.v, self.o = (Linear(h, h) for _ in range(4))
        self.up, self.down = Linear(h, c.intermediate_size), Linear(c.intermediate_size, h)
        self.attn_norm, self.mlp_norm = nn.LayerNorm(h, c.layer_norm_eps), nn.LayerNorm(h, c.layer_norm_eps)

    def forward(self, x: torch.Tensor, lens: list[int]) -> torch.Tensor:
        t, h = x.shape
        q, k, v = (p(x).view(t, self.heads, h // self.heads).transpose(0, 1) for p in (self.q, self.k, self.v))
        split = zip(q.split(lens, 1), k.split(lens, 1), v.split(lens, 1), strict=True)
        parts = [F.scaled_dot_product_attention(*(z.unsqueeze(0) for z in qkv))[0] for qkv in split]  # (4-D: the
        attn = torch.cat(parts, 1).transpose(0, 1).reshape(t, h)  # CPU's flash kernel, not the math path)
        x = self.attn_norm(x + self.o(attn))
        return self.mlp_norm(x + self.down(self.act(self.up(x))))


class Embeddings(nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.norm = nn.LayerNorm(c.hidden_size, c.layer_norm_eps)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, types: torch.Tensor | None) -> torch.Tensor:
        typed = self.token_type_embeddings.weight[0] if types is None else self.token_type_embeddings(types)
        return self.norm(self.word_embeddings(ids) + typed + self.position_embeddings(positions))


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

    def checkpoint_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor loads into; None for a tensor of a head not served (skipped)."""
        name = re.sub(r"^(bert|roberta)\.", "", name)
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
        for layer in self.layers:
            x = layer(x, lens)
        return x

    def classify(self, hidden: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """A cross-encoder's logits [len(lens), labels] from the hidden states `forward` gave."""
        starts = torch.tensor([0, *lens[:-1]]).cumsum(0)
        return self.head(hidden[starts])

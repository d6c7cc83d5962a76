"""The decoder-only causal LM every family is built from (Llama's shape), over a flat token batch.

Tokens of all rows are concatenated ([num_tokens, hidden]); rows only meet in attention, through the paged KV cache and
the AttentionMetadata. Module names mirror the HF checkpoints, so weights load by name (gpu/loading/weights.py; a family
maps names that differ in `checkpoint_name`). A family subclasses `CausalLM` and says only what differs:

| class attribute   | Llama          | what it changes                                                          |
|-------------------|----------------|--------------------------------------------------------------------------|
| attention         | Attention      | FusedQKVAttention: Phi-3's one qkv_proj                                  |
| norm_offset       | 0              | 1: RMSNorm scales by (1 + w) (Gemma)                                     |
| sandwich          | False          | True: the attention and MLP outputs are normed too, before the residual |
| scale_embeddings  | False          | True: embeddings x sqrt(hidden) in the model's dtype (Gemma)             |
| mlp_name          | "mlp"          | the MLP's module name ("block_sparse_moe": Mixtral)                      |
| tie_default       | False          | True: embeddings tied unless config.json says otherwise (Gemma)          |
and `make_mlp(c, layer)` (a dense or MoE MLP per layer), `quirks(raw)` (the config fields the family reads:
gpu/loading/config.py), `layer_types(raw)` (which layers slide when config.json has no `layer_types`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from gpu.attention.kv_cache import KVCache
from gpu.attention.metadata import AttentionMetadata
from gpu.distributed.group import current
from gpu.layers.attention import Attention
from gpu.layers.linear import Linear
from gpu.layers.mlp import GatedMLP
from gpu.layers.moe import SparseMoE, expert_weight
from gpu.layers.norm import RMSNorm
from gpu.layers.parallel import VocabParallelEmbedding, column, vocab_range
from gpu.layers.rotary import RotaryEmbedding

# a checkpoint's q/k/v or gate/up tensor, held in the rows of one stacked projection (gpu/layers/attention.py, mlp.py)
_STACKED = re.compile(r"(.*\.)(q|k|v|gate|up)_proj\.(weight|bias)$")
_STACKS = {"q": ("qkv_proj", 0), "k": ("qkv_proj", 1), "v": ("qkv_proj", 2), "gate": ("gate_up_proj", 0),
           "up": ("gate_up_proj", 1)}  # fmt: skip


class DecoderLayer(nn.Module):
    def __init__(self, family: type[CausalLM], c, layer: int) -> None:
        super().__init__()
        norm = lambda: RMSNorm(c.hidden_size, c.rms_norm_eps, family.norm_offset)  # noqa: E731
        self.self_attn = family.attention(c, layer, family.norm_offset)
        self.mlp_name = family.mlp_name
        self.add_module(family.mlp_name, family.make_mlp(c, layer))
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        if family.sandwich:  # post_attention_layernorm normalises the attention's output; two more around the MLP
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.sandwich = family.sandwich
        self.rope = 1 if c.local_rope and c.layer_windows[layer] else 0  # which of the model's rotaries

    def forward(self, h, residual, ropes, meta: AttentionMetadata, kv: tuple[torch.Tensor, torch.Tensor]):
        """(h, residual) -> this layer's (h, residual); the stream is residual + h, the add deferred into the next
        norm (one fused step with it); residual None before the first layer."""
        h, residual = self.input_layernorm.add(h, residual)
        h = self.self_attn(h, ropes[self.rope], meta, kv)
        mlp = getattr(self, self.mlp_name)
        if not self.sandwich:
            h, residual = self.post_attention_layernorm.add(h, residual)
            return mlp(h), residual
        h, residual = self.pre_feedforward_layernorm.add(self.post_attention_layernorm(h), residual)
        return self.post_feedforward_layernorm(mlp(h)), residual


class DecoderModel(nn.Module):
    def __init__(self, family: type[CausalLM], c) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(family, c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, family.norm_offset)
        rotary_dim = int(c.head_dim * c.partial_rotary_factor)
        ropes = [(c.rope_theta, c.rope_scaling), *([c.local_rope] if c.local_rope else [])]
        self.rotaries = [
            RotaryEmbedding(rotary_dim, theta, s, c.max_position_embeddings, c.max_model_len) for theta, s in ropes
        ]
        self.embed_scale = c.hidden_size**0.5 if family.scale_embeddings else None
        self.native_loop = None  # the layer loop as one native call, for the steps it takes (gpu/runner/native_loop.py)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        ropes = [rotary(positions, x.dtype) for rotary in self.rotaries]
        if self.native_loop is not None and self.native_loop.takes(meta):
            return self.native_loop(x, ropes, meta, kv_cache)
        residual = None
        for layer, kv in zip(self.layers, kv_cache.layers, strict=True):
            x, residual = layer(x, residual, ropes, meta, kv)
        return self.norm.add(x, residual)[0]


class CausalLM(nn.Module):
    attention = Attention
    norm_offset = 0.0
    sandwich = False
    scale_embeddings = False
    mlp_name = "mlp"
    tie_default = False  # tie_word_embeddings when config.json omits it (HF's default for the family)

    @staticmethod
    def make_mlp(c, layer: int) -> nn.Module:
        if c.moe and c.moe.layers[layer]:
            return SparseMoE(c, c.moe.intermediate_size)
        return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, c.mlp_bias)

    @staticmethod
    def quirks(raw: dict) -> dict:
        """ModelConfig fields this family reads from config.json beyond the common ones."""
        return {"qkv_bias": bool(raw.get("attention_bias", False)), "o_bias": bool(raw.get("attention_bias", False))}

    @staticmethod
    def layer_types(raw: dict) -> list[str]:
        """Each layer's attention when config.json does not list them: a sliding_window, where given, slides all."""
        kind = "sliding_attention" if raw.get("sliding_window") else "full_attention"
        return [kind] * raw["num_hidden_layers"]

    @staticmethod
    def checkpoint_name(name: str) -> tuple[str, int | None, int]:
        """The parameter a checkpoint's tensor loads into, the index of an expert's in a stacked one (else None) and
        which of the tensors stacked by rows into it (q, k, v; gate, up) it is (else 0)."""
        expert = expert_weight(name)
        if expert:
            return *expert, 0
        m = _STACKED.match(name)
        if m is None:
            return name, None, 0
        stack, part = _STACKS[m[2]]
        return f"{m[1]}{stack}.{m[3]}", None, part

    @staticmethod
    def checkpoint_names(param: str, parts: int) -> list[str]:
        """The checkpoint's names of the tensors that load into `param` (of `parts` stacked ones): checkpoint_name's
        inverse, for the files whose names are the loader's to choose (GGUF: gpu/loading/gguf_file.py)."""
        module, _, leaf = param.rpartition(".")
        parent, _, stack = module.rpartition(".")
        names = [f"{parent}.{n}_proj.{leaf}" for n, (s, _) in _STACKS.items() if s == stack]
        return names if parts > 1 and len(names) == parts else [param]

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(type(self), config)
        self.tp = current()
        start, held, per = vocab_range(config.vocab_size, self.tp)
        self.lm_head = column(Linear(config.hidden_size, per, bias=False), [(start, held)], config.vocab_size)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share embed_tokens with lm_head if the config says so (again after any tensor conversion)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a flat batch; writes this step's K/V into `kv_cache`."""
        return self.model(input_ids, positions, meta, kv_cache)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits of `hidden` on the first rank (each rank's vocabulary share gathered there); None elsewhere."""
        logits = self.tp.gather_first(self.lm_head(hidden))
        if logits is None:
            return None
        logits = logits[:, : self.config.vocab_size]  # (the last share's padding)
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

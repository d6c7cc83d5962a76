"""The decoder's layer loop as one native call (gpu/kernels/native/csrc/decoder.cpp), for the steps it can take: the
same native ops in the same order on the same arguments as the Python loop, so the same bits, without the Python between
them (5-8 ms of a 15-33 ms batch-1 decode step of SmolLM2-135M on a 2-vCPU AMD EPYC: docs/performance-history.md,
"The layer loop as one native call, ..." (issue 36, sixth part); the step times with and without it:
docs/PERFORMANCE.md, "Native kernels and quantized formats").

`native_loop(model, attention, lora)` builds it at load where every layer is a plain one (Llama's shape: no sandwich norms,
no q/k norms, a dense gated MLP, one device) on the native backend, each linear layer on the native kernels (panels
or blocks: every row count); None elsewhere (the Python loop runs every step). Its `layers_done` counter is a process worker's
progress while it runs (the Python loop's is its layers' hooks: actors/engine/worker.py). A step goes to it (`takes`) when the native attention kernel takes
every row (gpu/attention/native_backend.py: rows of up to SHORT_ROW queries; every row in batch-invariant mode) and its LoRA rows, if any, run on the native LoRA kernel.
"""

from __future__ import annotations

import torch

from gpu.attention.kv_cache import KVCache
from gpu.attention.metadata import AttentionMetadata
from gpu.attention.native_backend import NativeAttention
from gpu.kernels.native.kernels import ACT_IDS
from gpu.layers.attention import Attention
from gpu.layers.linear import Linear
from gpu.layers.lora import LoraSlots
from gpu.layers.mlp import GatedMLP


class NativeLoop:
    def __init__(self, decoder, lora: LoraSlots, before: int = 0) -> None:
        """`before`: the layers the loop it replaces had run (its count goes on from there)."""
        self.decoder, self.lora, self.before = decoder, lora, before

    def takes(self, meta: AttentionMetadata) -> bool:
        return NativeAttention.takes_every_row(meta) and (self.lora.tokens is None or self.lora.ops is not None)

    def layers_done(self) -> int:
        """The layers it (and those it replaced) ran (any thread, while a forward runs too: a process worker's
        progress, which only grows)."""
        return self.before + self.decoder.layers_done()

    def __call__(self, x: torch.Tensor, ropes: list, meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        n = meta.native
        k, v = zip(*kv_cache.layers, strict=True)
        cos, sin = zip(*ropes, strict=True)
        return self.decoder.forward(
            x,
            list(cos),
            list(sin),
            list(k),
            list(v),
            meta.slot_mapping,
            n["qsl"],
            n["seq_lens"],
            n["tables"],
            self.lora.tokens,
        )


def native_loop(model, attention, lora: LoraSlots, replaces: NativeLoop | None = None) -> NativeLoop | None:
    """The loop of `model` (a CausalLM) as one native call, or None where a layer is not a plain one on the native
    kernels; with the LoRA slot tables its layers hold (`lora`: the model's), on the native LoRA kernel; `replaces`:
    the loop it is built to replace (its layers_done goes on)."""
    if not isinstance(attention, NativeAttention) or model.tp.size != 1:
        return None
    m = model.model
    norms = [m.norm, *(n for layer in m.layers for n in (layer.input_layernorm, layer.post_attention_layernorm))]
    if len({(n.eps, n.offset) for n in norms}) != 1:
        return None
    decoder = getattr(torch.classes, attention.ops.name).Decoder(m.norm.weight, m.norm.eps, m.norm.offset)
    for layer in m.layers:
        a, mlp = layer.self_attn, getattr(layer, layer.mlp_name)
        if layer.sandwich or not isinstance(a, Attention) or hasattr(a, "q_norm") or type(mlp) is not GatedMLP:
            return None
        if not all(add_linear(decoder, linear) for linear in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            return None
        q, k, v = a.sizes
        decoder.add_layer(
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight, q, k, v, a.head_dim, a.scale,
            a.window or 0, a.softcap or 0.0, ACT_IDS[mlp.act], layer.rope,
        )  # fmt: skip
    return NativeLoop(decoder, lora, replaces.layers_done() if replaces else 0)


def add_linear(decoder, linear) -> bool:
    """Hand `linear` to the decoder (False: it is not on the native kernels)."""
    if not isinstance(linear, Linear):
        return False
    if linear.blocks is not None:
        firsts, kinds, held = zip(*linear.blocks, strict=True)
        decoder.add_blocks(list(firsts), list(kinds), list(held), linear.out_features, linear.bias)
    elif linear.native is not None:
        decoder.add_linear(linear.native, linear.out_features, linear.bias)
    else:
        return False
    if linear.lora_a is not None:
        decoder.add_lora(linear.lora_a, linear.lora_b, linear.lora_parts)
    return True

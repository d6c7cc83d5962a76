"""LoRA deltas on the linear layers: for the tokens of the rows that run an adapter, y += (x·Aᵀ)·Bᵀ (the scale
folded into B: gpu/loading/lora.py), after the layer's base product, in every layer the adapter targets.

One `LoraSteps` per model: the adapters' weights, installed into the layers they target (each Linear's `loras`: the
adapter's digest -> its LayerDelta) and removed again, and each step's `groups` (the runner's: which tokens run
which adapter). A layer with an adapter present in the step computes punica's pair per adapter: one shrink product
for its stacked parts' A's, then one expand per part into that part's columns of y (q, k and v of a stacked qkv_proj,
each its own B); a step whose tokens all run one adapter skips the gather and scatter. Rows of the base model and
of adapters a layer is not targeted by get nothing added.

Memory: an adapter costs r x (in + out) numbers per targeted part, in the activations' dtype (SmolLM2-135M, rank
16, all seven projections: 19.6 MB in float32), held once. Torch's matmuls are the reference here; a native CPU and
a Triton pair are to come.
"""

from __future__ import annotations

import torch


class LoraSteps:
    def __init__(self) -> None:
        self.layers: dict[str, dict[str, object]] = {}  # adapter digest -> its layers (name -> the Linear)
        # this step's (adapter digest, the flat token indices that run it; None: every token), in batch order
        self.groups: list[tuple[str, torch.Tensor | None]] = []

    def install(self, model: torch.nn.Module, digest: str, deltas: dict) -> None:
        """Give the layers an adapter's deltas (layer name -> LayerDelta)."""
        layers = {name: model.get_submodule(name) for name in deltas}
        for name, layer in layers.items():
            layer.loras = {**(layer.loras or {}), digest: deltas[name]}
            layer.lora_steps = self
        self.layers[digest] = layers

    def remove(self, digest: str) -> None:
        for layer in self.layers.pop(digest, {}).values():
            del layer.loras[digest]

    def apply(self, loras: dict, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add to y [tokens, out] the deltas of the step's adapters in `loras` (a layer's) for x [tokens, in]."""
        for digest, rows in self.groups:
            if (delta := loras.get(digest)) is None:
                continue
            a, parts = delta
            xa = (x if rows is None else x.index_select(0, rows)) @ a.T
            for offset, ranks, b in parts:
                out, d = y.narrow(1, offset, b.shape[0]), xa[:, ranks] @ b.T
                if rows is None:
                    out += d
                else:
                    out.index_add_(0, rows, d)

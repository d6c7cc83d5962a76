"""LoRA deltas on the linear layers: for the tokens of the rows that run an adapter, y += (x·Aᵀ)·Bᵀ (the scale
folded into B: gpu/loading/lora.py), after the layer's base product, in every layer an adapter targets.

`LoraSlots` is the model's slot table: `slots` adapters held at once, each in a slot, at `rank` (a lower-rank
adapter zero-padded). Each layer some adapter targets holds, in the tables' dtype (--lora-dtype: by default the base
weights' float format; the sums are the activations' either way),

  lora_a [slots, P x rank, in]  its P stacked parts' A's (q, k and v of a stacked qkv_proj; one part elsewhere)
  lora_b [slots, rank, out]     Bᵀ: each output column's B row (of its part's adapter); lora_parts: the parts'
                                first rows (columns here) and out

so an adapter costs slots' share of rank x (P x in + out) numbers per targeted layer whatever it targets there
(SmolLM2-135M, all seven projections, rank 16: 19.6 MB a slot in float32, 9.8 in 16 bits), allocated when a first adapter targets
the layer (on CUDA every targetable layer's at start: `reserve`). The runner sets each step's `tokens` (the slot of
every token, -1 for the base model's; None: no LoRA row in the step) and, for the torch path, `groups` (each slot's
token indices). Backends, chosen once (`ops`: gpu/runner/adapters.py lora_kernels):
- native (CPU, float32 activations; float32, bfloat16 or float16 tables): gpu/kernels/native/csrc/lora.cpp, one call a layer for every adapter in the
  step, batch-invariant (a token's delta does not depend on the tokens around it), and inside the native layer loop
  (gpu/runner/native_loop.py) too;
- triton (CUDA): gpu/kernels/triton/lora.py, the same contract, its slots read on the device (graph-safe);
- torch: per slot present, one shrink and one expand per part (the reference, and CPU without the native kernels).
"""

from __future__ import annotations

import torch


class LoraSlots:
    def __init__(self, slots: int, rank: int, dtype: torch.dtype, device: torch.device, ops=None) -> None:
        self.rank, self.dtype, self.device, self.ops = rank, dtype, device, ops
        self.digests: list[str | None] = [None] * slots  # each slot's adapter (its digest)
        self.layers: dict[str, torch.nn.Module] = {}  # the layers with tables, by name
        self.tokens: torch.Tensor | None = None  # this step's (module docstring)
        self.groups: list[tuple[int, torch.Tensor | None]] = []  # (slot, its tokens' indices; None: every token)

    def slot_of(self, digest: str) -> int | None:
        return self.digests.index(digest) if digest in self.digests else None

    def install(self, model: torch.nn.Module, digest: str, images: dict) -> bool:
        """Put an adapter (layer name -> its slot image: gpu/loading/lora.py read_adapter, for this table's rank and
        dtype) in a free slot, a copy a table; True if a layer got its tables now."""
        if digest in self.digests or None not in self.digests:
            raise ValueError(f"LoRA adapter {digest}: held already, or no slot free of {len(self.digests)}")
        s, made = self.digests.index(None), False
        try:
            for name, (firsts, a, b) in images.items():
                layer = model.get_submodule(name)
                made = self.reserve(model, {name: firsts}) or made
                layer.lora_a[s].copy_(a)
                layer.lora_b[s].copy_(b)
        except BaseException:
            self._clear(s)  # (no half-written slot for the next adapter to inherit)
            raise
        self.digests[s] = digest
        return made

    def reserve(self, model: torch.nn.Module, layers: dict[str, list[int]]) -> bool:
        """Allocate the tables of these layers (name -> their parts' first rows and out) that lack them (True: some
        did). A CUDA runner reserves every targetable layer's at start (gpu/loading/lora.py `targetable`): its memory
        plan counts them, and its decode graphs capture them in place."""
        made = False
        for name, firsts in layers.items():
            layer = model.get_submodule(name)
            if layer.lora_a is None:
                shape = (len(self.digests), (len(firsts) - 1) * self.rank)
                layer.lora_a = torch.zeros(*shape, layer.in_features, dtype=self.dtype, device=self.device)
                layer.lora_b = torch.zeros(
                    shape[0], self.rank, layer.out_features, dtype=self.dtype, device=self.device
                )
                layer.lora_parts, layer.lora_slots, self.layers[name], made = firsts, self, layer, True
        return made

    def remove(self, digest: str) -> None:
        s = self.digests.index(digest)
        self._clear(s)
        self.digests[s] = None

    def _clear(self, s: int) -> None:
        for layer in self.layers.values():
            layer.lora_a[s].zero_()
            layer.lora_b[s].zero_()

    def add(self, layer, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add to y [tokens, out] the step's deltas of `layer` for x [tokens, in]."""
        if self.ops is not None:
            self.ops.lora_add(x, y, self.tokens, layer.lora_a, layer.lora_b, layer.lora_parts)
            return
        r, firsts = self.rank, layer.lora_parts
        for s, rows in self.groups:
            xa = (x if rows is None else x.index_select(0, rows)) @ layer.lora_a[s].T.to(x.dtype)
            for p in range(len(firsts) - 1):
                b = layer.lora_b[s, :, firsts[p] : firsts[p + 1]].to(x.dtype)
                out, d = y.narrow(1, firsts[p], b.shape[1]), xa[:, p * r : (p + 1) * r] @ b
                if rows is None:
                    out += d
                else:
                    out.index_add_(0, rows, d)

"""Linear layers, each weight held once in the format it is served in.

On CPU with the native kernels (gpu/kernels/native: the default where built; `--cpu-kernels torch` turns them off)
a layer holds its weight in their panels alone, float32, bfloat16 or float16, at every row count (`hold_panels`
before the load, which writes the checkpoint's rows in with `load_rows`, several tensors into one stacked weight):
16-bit weights are widened exactly as they stream, activations and sums are float32, and every row's result is the
same bits whatever the batch around it (batch invariance by construction). Speed: 1.07-1.3x torch's best for up to 64
rows (AMD EPYC, AVX2: docs/performance-history.md, "Native paged attention, and the native kernels by default (issue
36, third part)") and 0.85-0.95x MKL's at 128-512 rows (Intel Xeon, AVX-512, 2 threads, SmolLM2's shapes, torch 2.13).
A weight in one of GGUF's block formats (BLOCK_FORMATS: Q4_0 ... Q8_0, Q4_K, Q5_K, Q6_K) is held in the file's own
bytes instead (`hold_blocks`: [rows, row bytes] per stacked part, each part its own format; csrc/blocks.cpp: 8-bit activations,
integer dot products, batch-invariant too).
The [out, in] parameter is then a meta tensor (its shape alone); a tied embedding reads its rows from the panels or
blocks (`rows`). Elsewhere (CUDA, torch's kernels) the [out, in] parameter, in the model's dtype, on `F.linear`.
A layer LoRA adapters target adds their deltas to the base product (its slot tables: gpu/layers/lora.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from gpu.kernels.reference import ACTIVATIONS

Q = GGMLQuantizationType
NATIVE_ACTS = {"gelu": 1}  # the activations the native linear applies in its epilogue (csrc/linear.cpp's Act)
# (the native kernels': csrc/blocks.cpp)
BLOCK_FORMATS = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)


class Linear(nn.Linear):
    native_ops = None  # the native kernels (gpu/kernels/native) ...
    native: torch.Tensor | None = None  # ... and the weight in their layout (its only copy), for every row count
    # ... or its rows in GGUF blocks, per stacked part (first row, format: ggml's type id, [rows, row bytes])
    blocks: list[tuple[int, int, torch.Tensor]] | None = None
    # LoRA: the slot tables of the adapters that target it, its stacked parts' first rows, the model's LoraSlots
    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None
    lora_parts: list[int] | None = None
    lora_slots = None

    def hold_panels(self, native_ops, dtype: torch.dtype) -> None:
        """Hold the weight in the native panels, in `dtype` (zeros until `load_rows`); the parameter becomes its
        shape on meta."""
        self.native_ops, self.native = native_ops, native_ops.panels(self.out_features, self.in_features, dtype)
        self.weight = nn.Parameter(torch.empty(self.weight.shape, dtype=dtype, device="meta"), requires_grad=False)
        self.placed = {"weight": None}  # (left on meta by the loader's materialize)

    def hold_blocks(self, native_ops, parts: list[tuple[int, int]]) -> None:
        """Hold the weight in GGUF blocks: `parts`, (rows, format) in row order, each in its own format (a Q4_K_M
        file's q and k are Q4_K, its v Q6_K), uninitialised until `load_rows` (memory reserved, not touched: a
        file's blocks replace it)."""
        self.native_ops, self.blocks, offset = native_ops, [], 0
        for rows, kind in parts:
            elems, size = GGML_QUANT_SIZES[kind]
            held = native_ops.huge_empty([rows, self.in_features // elems * size], torch.uint8)
            self.blocks.append((offset, int(kind), held))
            offset += rows
        self.weight = nn.Parameter(torch.empty(self.weight.shape, device="meta"), requires_grad=False)
        self.placed = {"weight": None}

    def load_rows(self, rows: torch.Tensor, offset: int) -> None:
        """Write rows offset .. offset + len(rows) - 1 of the held weight (a checkpoint tensor's [n, in], any float
        dtype: converted to the panels'); for blocks, float rows are quantized into the part's format (--quantization),
        and a file's [n, row bytes] blocks become the part as they are (a view of the mapped file: held in place)."""
        if self.blocks is not None:
            i, (first, kind, held) = next((i, part) for i, part in enumerate(self.blocks) if part[0] == offset)
            if rows.dtype == torch.uint8:
                assert rows.shape == held.shape and rows.is_contiguous()
                self.blocks[i] = (first, kind, rows)  # (the reserved memory, never touched, goes)
            else:
                held.copy_(self.native_ops.quantize_rows(rows.float(), kind))
        else:
            self.native_ops.pack_into(self.native, rows.to(self.native.dtype), offset)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight in the panels or blocks, float32 (ids.shape + (in,)): a tied embedding's lookup."""
        if self.blocks is not None:  # (one part: an embedding's table)
            _, kind, held = self.blocks[0]
            return self.native_ops.block_rows(held, ids, kind, self.in_features)
        return self.native_ops.panel_rows(self.native, ids, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.lora_a is not None and self.lora_slots.tokens is not None:
            self.lora_slots.add(self, x.reshape(-1, self.in_features), y.view(-1, self.out_features))
        return y

    def activated(self, x: torch.Tensor, act: str) -> torch.Tensor:
        """ACTIVATIONS[act](self(x)): on the native panels, for an activation they have and no adapter, applied in
        the product's epilogue (each panel's sums while in cache: no pass of its own over the output)."""
        if self.native is None or act not in NATIVE_ACTS or self.lora_a is not None:
            return ACTIVATIONS[act](self(x))
        flat = x.reshape(-1, self.in_features).contiguous()
        y = self.native_ops.linear(flat, self.native, self.out_features, self.bias, NATIVE_ACTS[act])
        return y.view(*x.shape[:-1], self.out_features)

    def base(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is None and self.blocks is None:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, self.in_features).contiguous()
        if self.blocks is not None:
            y = flat.new_empty(flat.shape[0], self.out_features)
            for first, kind, held in self.blocks:  # (each part's columns of y)
                bias = None if self.bias is None else self.bias[first : first + held.shape[0]]
                self.native_ops.block_linear_out(flat, held, kind, bias, y.narrow(1, first, held.shape[0]))
        else:
            y = self.native_ops.linear(flat, self.native, self.out_features, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

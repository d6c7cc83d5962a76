"""Weight-only quantization of an HF checkpoint's linear layers on CPU (`--quantization q8_0 | q4_0 | q4_k`): each
weight quantized as it loads into one of GGUF's block formats, then held and run as a GGUF file's blocks are
(gpu/layers/linear.py `hold_blocks`; csrc/quantize.cpp as llama.cpp's reference quantizers, csrc/blocks.cpp's
kernels): one set of kernels for both, no float32 copy beside the blocks. (16-bit weights are `--dtype bfloat16` /
`float16`: the native kernels' 16-bit panels.)

| name | format (bytes a weight)          | where a layer's input width is not whole blocks of it    |
|------|----------------------------------|----------------------------------------------------------|
| q8_0 | Q8_0 (1.06)                      | the weights' panels (`--dtype`)                          |
| q4_0 | Q4_0 (0.56)                      | the weights' panels                                      |
| q4_k | Q4_K (0.56), super-blocks of 256 | Q5_0 (0.69) where it is whole blocks of 32, as llama.cpp |
|      |                                  | does (SmolLM2's 576-wide inputs), else the panels        |

A tied LM head (and an untied embedding table) is quantized as the layers are.
int8 and int4 (a per-channel and a per-group scheme of our own, each keeping a float32 copy beside the quantized
weight: 5 and 4.6 bytes a weight) were retired for q8_0 and q4_0 / q4_k (issue 50).
"""

from __future__ import annotations

from typing import Literal

from gguf import GGMLQuantizationType as Q
from torch import nn

from gpu.layers.linear import Linear

Quantization = Literal["q8_0", "q4_0", "q4_k"]
# each name's block formats, in preference order: a layer takes the first whose blocks its input width is whole of
BLOCK_QUANTIZATIONS: dict[str, tuple[int, ...]] = {
    "q8_0": (int(Q.Q8_0),),
    "q4_0": (int(Q.Q4_0),),
    "q4_k": (int(Q.Q4_K), int(Q.Q5_0)),
}


def check_invariant(model: nn.Module) -> None:
    """Batch-invariant mode: every linear layer on the native kernels (panels or blocks: each row computed alone at
    any row count), checked before the native layer loop is built (gpu/runner/model_runner.py). ValueError where a
    layer is not (not float32 activations on a CPU, or the kernels not built)."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    if not layers or any(m.native is None and m.blocks is None for m in layers):
        raise ValueError(
            "batch-invariant mode needs every linear layer on the native CPU kernels: float32 activations on a CPU, "
            "the kernels built (make setup)"
        )

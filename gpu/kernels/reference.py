"""The decoder's small steps as a kernel set, chosen with the attention backend (gpu/attention/backend.py) and handed
to every layer at load (gpu/loading/weights.py): each layer calls `self.kernels.<step>` and never asks which set it has.

| step                                        | TorchKernels (this module: the reference)     | TritonKernels | NativeKernels |
|---------------------------------------------|-----------------------------------------------|---------------|---------------|
| rms_norm(x, residual, weight, eps, offset)  | residual + x, then HF's RMSNorm of the sum    | one kernel    | one op        |
| rope_and_write_kv(q, k, v, cos, sin, kv, s) | apply_rope on q and k, write_kv                | one kernel    | one op        |
| act_and_mul(x, act)                         | act(gate) * up of a fused gate_up output       | one kernel    | one op        |

Each Triton kernel equals its torch step here, with its rounding order in bf16/fp16 (gpu/kernels/triton/fused.py);
the native set (gpu/kernels/native/kernels.py: CPU, float32, the native attention backend's) equals it up to float32
rounding, each row alone in a fixed order.

RMSNorm, as HF transformers computes it for each family: Llama style (offset 0) normalised in float32, cast back,
then scaled by the weight in the model's dtype; Gemma style (offset 1) scales by (1 + w) in float32 before the cast.
Float32 input is one fused op either way (the two orders round alike there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,  # (exact, erf: BERT's)
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class TorchKernels:
    @staticmethod
    def rms_norm(x, residual, weight, eps: float, offset: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual), x + residual) rounded to x's dtype; residual None: (RMSNorm(x), x). The sum is
        a new tensor here; other sets may write it into `residual`, which the caller must not read again."""
        x = x if residual is None else x + residual
        shape = weight.shape
        if x.dtype == torch.float32:
            return F.rms_norm(x, shape, weight + offset if offset else weight, eps), x
        if offset:
            return (F.rms_norm(x.float(), shape, eps=eps) * (weight.float() + offset)).to(x.dtype), x
        return weight * F.rms_norm(x.float(), shape, eps=eps).to(x.dtype), x

    @staticmethod
    def rope_and_write_kv(q, k, v, cos, sin, kv: tuple[torch.Tensor, torch.Tensor], slots) -> torch.Tensor:
        """Rotate q and k (apply_rope), store k and v at `slots` of the paged cache; returns the rotated q."""
        write_kv(kv, apply_rope(k, cos, sin), v, slots)
        return apply_rope(q, cos, sin)

    @staticmethod
    def act_and_mul(x: torch.Tensor, act: str) -> torch.Tensor:
        """act(gate) * up for x = [gate | up] along the last dim."""
        gate, up = x.chunk(2, dim=-1)
        return ACTIVATIONS[act](gate) * up


TORCH_KERNELS = TorchKernels()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's x * cos + rotate_half(x) * sin over the first cos.shape[-1] dims (the rest pass), with rotate_half(x) =
    (-x2, x1) as the halves swapped times the sign-folded sin (gpu/layers/rotary.py): three kernels instead of five."""
    d = cos.shape[-1]
    if d < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :d], cos, sin), x[..., d:]), -1)
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return torch.addcmul(x * cos, swapped, sin)


def write_kv(kv: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor):
    """Store new keys/values [num_tokens, num_kv_heads, head_dim] at their slots."""
    k_cache, v_cache = kv
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)

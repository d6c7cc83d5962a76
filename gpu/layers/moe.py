"""A sparse MoE block (Mixtral, Qwen3-MoE): a softmax router picks each token's top-k experts, their weights
renormalised to sum to 1 where the config says (`norm_topk_prob`; Mixtral always), and each expert is a SwiGLU
MLP. The experts' weights are stacked ([E, out, in]; the checkpoint's per-expert tensors are copied in at load,
`expert_weight`; on CPU in GGUF blocks, `hold_blocks`: a GGUF's stacked tensors in their bytes, an HF checkpoint's
quantized as they load under --quantization), and the tokens are grouped by expert: one pass per expert that got any
token, never a Python
loop over tokens. A token's k contributions are summed in expert order, whatever the batch around it. Under tensor
parallelism each rank holds every expert's slice of the intermediate dim and all-reduces the block's output (the
router is replicated)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from torch import nn

from gpu.distributed.group import current
from gpu.kernels.reference import ACTIVATIONS
from gpu.layers.linear import Linear
from gpu.layers.parallel import Shard, shard, split

# a checkpoint's per-expert tensor: "experts.<e>.<its projection>.weight", in either family's names
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")
_STACKED = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def expert_weight(name: str) -> tuple[str, int] | None:
    """The stacked parameter and expert index a checkpoint's per-expert tensor loads into (None: not an expert's)."""
    m = _EXPERT.match(name)
    return (f"{m[1]}.{_STACKED[m[3]]}", int(m[2])) if m else None


class Experts(nn.Module):
    native_ops = None  # the native kernels, where the experts are held in GGUF blocks ...
    blocks: dict[str, tuple[int, torch.Tensor]] | None = (
        None  # ... per projection: (format, [experts x out, row bytes])
    )

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        start, n = split(intermediate, "experts' intermediate size", current())
        self.gate = nn.Parameter(torch.empty(num_experts, n, hidden))
        self.up = nn.Parameter(torch.empty(num_experts, n, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, n))
        part = ((start, n),)  # (dims of one expert's checkpoint tensor)
        shard(
            self, gate=Shard(0, part, intermediate), up=Shard(0, part, intermediate), down=Shard(1, part, intermediate)
        )

    def hold_blocks(self, native_ops, kinds: dict[str, int]) -> None:
        """Hold each projection in GGUF blocks, `kinds` (projection -> format), uninitialised until `load_rows`: every
        expert's rows one after another (a GGUF file's layout); the parameters become meta shapes."""
        self.native_ops, self.blocks = native_ops, {}
        for proj, kind in kinds.items():
            p = getattr(self, proj)
            elems, size = GGML_QUANT_SIZES[kind]
            rows = native_ops.huge_empty([p.shape[0] * p.shape[1], p.shape[2] // elems * size], torch.uint8)
            self.blocks[proj] = (int(kind), rows)
            setattr(self, proj, nn.Parameter(torch.empty(p.shape, device="meta"), requires_grad=False))
        self.placed = dict.fromkeys(kinds)  # (left on meta by the loader's materialize)

    def project(self, proj: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x times expert `expert`'s weight of `proj` (gate, up or down)."""
        weight = getattr(self, proj)
        if self.blocks is None:
            return F.linear(x, weight[expert])
        kind, rows = self.blocks[proj]
        out = weight.shape[1]
        return self.native_ops.block_linear(x.contiguous(), rows[expert * out : (expert + 1) * out], kind, None)


@dataclass(frozen=True)
class ExpertRows:
    """One projection of held experts as the loader writes a layer (gpu/loading/weights.py): its blocks, and
    `load_rows` of a GGUF's stacked tensor's [experts x out, row bytes] or of an HF expert's float rows."""

    experts: Experts
    proj: str

    @property
    def blocks(self) -> tuple[int, torch.Tensor] | None:
        return self.experts.blocks[self.proj]

    def load_rows(self, rows: torch.Tensor, offset: int) -> None:
        """A GGUF's stacked blocks become the projection's as they are (a view of the mapping: held in place); an HF
        checkpoint's expert's float rows are quantized into rows offset .. (--quantization)."""
        kind, held = self.experts.blocks[self.proj]
        if rows.dtype == torch.uint8:
            assert rows.shape == held.shape and rows.is_contiguous()
            self.experts.blocks[self.proj] = (kind, rows)
        else:
            held[offset : offset + rows.shape[0]].copy_(self.experts.native_ops.quantize_rows(rows.float(), kind))


class SparseMoE(nn.Module):
    def __init__(self, c, intermediate: int) -> None:
        super().__init__()
        moe = c.moe
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = Linear(c.hidden_size, moe.num_experts, bias=False)  # the router
        self.experts = Experts(moe.num_experts, c.hidden_size, intermediate)
        self.act = ACTIVATIONS[c.hidden_act]
        self.tp = current()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.gate(x).softmax(-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype).flatten()
        order = chosen.flatten().argsort(stable=True)  # (token, k) pairs grouped by expert, tokens in order
        counts = torch.bincount(chosen.flatten(), minlength=self.experts.gate.shape[0]).tolist()
        out = torch.zeros_like(x)
        e = self.experts
        for expert, group in zip(range(len(counts)), order.split(counts), strict=True):
            if group.numel():
                token = group // self.top_k
                h = x[token]
                y = e.project("down", expert, self.act(e.project("gate", expert, h)) * e.project("up", expert, h))
                out.index_add_(0, token, y * weights[group, None])
        return self.tp.all_reduce(out)


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k weights divided by their sum
    layers: tuple[bool, ...]  # per layer: sparse (else the dense MLP of intermediate_size)

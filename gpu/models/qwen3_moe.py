"""Qwen3-MoE: Qwen3's attention; a sparse MoE MLP (router `gate`, experts gate/up/down_proj of
`moe_intermediate_size`) on every `decoder_sparse_step`-th layer not in `mlp_only_layers` (those are dense), top-k
weights renormalised iff `norm_topk_prob`."""

from gpu.layers.moe import MoESpec
from gpu.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @staticmethod
    def layer_types(raw: dict) -> list[str]:
        """Every layer slides where `use_sliding_window` is set (HF's Qwen3-MoE has no max_window_layers)."""
        kind = "sliding_attention" if raw.get("use_sliding_window") else "full_attention"
        return [kind] * raw["num_hidden_layers"]

    @staticmethod
    def quirks(raw: dict) -> dict:
        experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
        step, dense = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or ())
        layers = tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(raw["num_hidden_layers"]))
        spec = MoESpec(
            experts, raw["num_experts_per_tok"], raw["moe_intermediate_size"], raw.get("norm_topk_prob", False), layers
        )
        return {**Qwen3ForCausalLM.quirks(raw), "moe": spec}

"""Mixtral: Mistral with a sparse MoE block (`block_sparse_moe`: router `gate`, experts w1 gate / w3 up / w2 down) in
every layer, top-k weights always renormalised."""

from gpu.layers.moe import MoESpec
from gpu.models.decoder import CausalLM


class MixtralForCausalLM(CausalLM):
    mlp_name = "block_sparse_moe"

    @staticmethod
    def quirks(raw: dict) -> dict:
        n = raw["num_hidden_layers"]
        moe = MoESpec(raw["num_local_experts"], raw["num_experts_per_tok"], raw["intermediate_size"], True, (True,) * n)
        return {**CausalLM.quirks(raw), "moe": moe}

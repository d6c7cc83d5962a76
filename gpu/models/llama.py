"""Llama (and SmolLM, which is one): the base shape, nothing to add. `attention_bias` and `mlp_bias` as configured."""

from gpu.models.decoder import CausalLM


class LlamaForCausalLM(CausalLM):
    pass

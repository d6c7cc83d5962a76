"""Mistral: Llama's shape with an explicit head_dim and, where config.json gives one, a sliding window on every
layer (both read by gpu/loading/config.py for any family)."""

from gpu.models.decoder import CausalLM


class MistralForCausalLM(CausalLM):
    pass

"""Phi-3 / Phi-3.5: q, k and v in one `qkv_proj` weight and gate and up in one `gate_up_proj`, kept fused (one
matmul each); partial rotary (`partial_rotary_factor`) and longrope read by gpu/loading/config.py for any family."""

from gpu.layers.attention import FusedQKVAttention
from gpu.layers.mlp import GatedMLP
from gpu.models.decoder import CausalLM


class Phi3ForCausalLM(CausalLM):
    attention = FusedQKVAttention

    @staticmethod
    def make_mlp(c, layer: int) -> GatedMLP:
        return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, fused=True)

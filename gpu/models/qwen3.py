"""Qwen3: Qwen2's windows, no biases (unless `attention_bias`), a per-head RMSNorm on q and k before rotary."""

from gpu.models.decoder import CausalLM
from gpu.models.qwen2 import Qwen2ForCausalLM


class Qwen3ForCausalLM(CausalLM):
    layer_types = Qwen2ForCausalLM.layer_types

    @staticmethod
    def quirks(raw: dict) -> dict:
        return {**CausalLM.quirks(raw), "qk_norm": True}

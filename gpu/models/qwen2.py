"""Qwen2 / Qwen2.5: biases on q, k and v (not o); a sliding window only where `use_sliding_window` is set, on the
layers from `max_window_layers` on."""

from gpu.models.decoder import CausalLM


class Qwen2ForCausalLM(CausalLM):
    @staticmethod
    def quirks(raw: dict) -> dict:
        return {"qkv_bias": True}

    @staticmethod
    def layer_types(raw: dict) -> list[str]:
        slide, first = raw.get("use_sliding_window", False), raw.get("max_window_layers", 28)
        return [
            "sliding_attention" if slide and i >= first else "full_attention" for i in range(raw["num_hidden_layers"])
        ]

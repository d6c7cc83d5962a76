"""Gemma 3 (text): Gemma 2's shape with a per-head q/k norm (Gemma's x(1 + w)), local (sliding) layers rotated with
their own base (`rope_local_base_freq`, or rope_parameters' "sliding_attention"), five local layers to one global
(`sliding_window_pattern`), and no soft-cap unless the config sets one."""

from gpu.models.gemma2 import Gemma2ForCausalLM


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    @staticmethod
    def quirks(raw: dict) -> dict:
        local = (raw.get("rope_parameters") or {}).get("sliding_attention")
        if local is None:
            local = {"rope_type": "default", "rope_theta": raw.get("rope_local_base_freq", 10000.0)}
        local = dict(local)
        theta = float(local.pop("rope_theta"))
        return {**Gemma2ForCausalLM.quirks(raw), "qk_norm": True, "local_rope": (theta, local)}

    @staticmethod
    def layer_types(raw: dict) -> list[str]:
        pattern = raw.get("sliding_window_pattern", 6)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(raw["num_hidden_layers"])]

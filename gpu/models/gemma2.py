"""Gemma 2: RMSNorm as x(1 + w) in float32, four norms per layer (the attention's and the MLP's outputs normed before
the residual), GeGLU (tanh GELU), embeddings x sqrt(hidden), queries scaled by query_pre_attn_scalar^-1/2, attention
and final logits soft-capped, a sliding window on every other layer (the even ones)."""

from gpu.models.decoder import CausalLM


class Gemma2ForCausalLM(CausalLM):
    norm_offset = 1.0
    sandwich = True
    scale_embeddings = True
    tie_default = True

    @staticmethod
    def quirks(raw: dict) -> dict:
        return {
            **CausalLM.quirks(raw),
            "hidden_act": raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh",
            "attn_scale": (raw.get("query_pre_attn_scalar") or raw.get("head_dim") or 256) ** -0.5,
            "attn_softcap": raw.get("attn_logit_softcapping"),
            "final_softcap": raw.get("final_logit_softcapping"),
        }

    @staticmethod
    def layer_types(raw: dict) -> list[str]:
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(raw["num_hidden_layers"])]

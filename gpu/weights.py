"""Build the model without initializing it and load its *.safetensors weights by name (sharded or not)."""

from __future__ import annotations

import torch
from safetensors import safe_open

from gpu.config import ModelConfig, ModelLoadError, weight_files
from gpu.linear import Linear
from gpu.llama import LlamaForCausalLM
from gpu.quant import Quantization, quantize_model


@torch.no_grad()
def load_model(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, quantization: Quantization | None = None
) -> LlamaForCausalLM:
    """The model with its weights; `quantization` (CPU, float32 only) replaces every linear layer's weight by an
    int8 or int4 one, kept dequantized too for calls of many rows (gpu/quant.py)."""
    if quantization and (device.type != "cpu" or dtype != torch.float32):
        raise ValueError(f"--quantization {quantization} runs on CPU in float32 only, not {device.type} {dtype}")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype).to_empty(device=device).requires_grad_(False).eval()
    model.tie_weights()
    model.model.rotary.to(device)  # computed, not a weight: built on the host
    params = dict(model.named_parameters())  # a tied lm_head is not listed: it is embed_tokens
    loaded: set[str] = set()
    for file in weight_files(config.path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings):
                    continue
                param = params.get(name)
                if param is None:
                    raise ModelLoadError(f"{file}: unexpected weight {name} for {config.architecture}")
                tensor = f.get_tensor(name)
                if tensor.shape != param.shape:
                    raise ModelLoadError(
                        f"{file}: {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                    )
                param.copy_(tensor)
                loaded.add(name)
    missing = sorted(params.keys() - loaded)
    if missing:
        raise ModelLoadError(f"{config.path}: weights missing from the checkpoint: {', '.join(missing[:8])}")
    if quantization:
        quantize_model(model, quantization)
        return model
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack(keep_weight=module is model.lm_head and config.tie_word_embeddings)
    return model

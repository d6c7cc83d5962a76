"""Build the model without initializing it and load its *.safetensors weights by name (sharded or not).

The family's class comes from the registry (gpu/models/); a checkpoint tensor loads into the parameter its family's
`checkpoint_name` names (per-expert MoE tensors into one row of a stacked parameter). Files are memory-mapped and
copied tensor by tensor into the model's dtype, so a load never holds a second copy of the model. A tensor the
model lacks, one of the wrong shape, or one the checkpoint lacks fails the load with a message naming it.
"""

from __future__ import annotations

import torch
from safetensors import safe_open
from tqdm import tqdm

from gpu.config import ModelConfig, ModelLoadError, weight_files
from gpu.linear import Linear
from gpu.models import REGISTRY
from gpu.models.decoder import CausalLM
from gpu.quant import Quantization, quantize_model


@torch.no_grad()
def load_model(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, quantization: Quantization | None = None
) -> CausalLM:
    """The model with its weights; `quantization` (CPU, float32 only) replaces every linear layer's weight by an
    int8 or int4 one, kept dequantized too for calls of many rows (gpu/quant.py)."""
    if quantization and (device.type != "cpu" or dtype != torch.float32):
        raise ValueError(f"--quantization {quantization} runs on CPU in float32 only, not {device.type} {dtype}")
    family = REGISTRY[config.architecture]
    with torch.device("meta"):
        model = family(config)
    model = model.to(dtype).to_empty(device=device).requires_grad_(False).eval()
    model.tie_weights()
    for rotary in model.model.rotaries:  # computed, not weights: built on the host
        rotary.to(device)
    params = dict(model.named_parameters())  # a tied lm_head is not listed: it is embed_tokens
    expected = {(name, i) for name, p in params.items() for i in _rows(name, p)}
    loaded: set[tuple[str, int | None]] = set()
    files = weight_files(config.path)
    with tqdm(total=len(expected), desc=f"Loading {config.name}", unit="tensor", disable=len(files) < 2) as bar:
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if name.endswith("rotary_emb.inv_freq") or (
                        name == "lm_head.weight" and config.tie_word_embeddings
                    ):
                        continue
                    target, row = family.checkpoint_name(name)
                    param = params.get(target)
                    if param is None:
                        raise ModelLoadError(f"{file}: unexpected weight {name} for {config.architecture}")
                    dest = param if row is None else param[row]
                    tensor = f.get_slice(name)
                    if tuple(tensor.get_shape()) != tuple(dest.shape):
                        shape = tuple(tensor.get_shape())
                        raise ModelLoadError(f"{file}: {name} has shape {shape}, expected {tuple(dest.shape)}")
                    dest.copy_(tensor[:])
                    loaded.add((target, row))
                    bar.update()
    missing = sorted(f"{n}[{i}]" if i is not None else n for n, i in expected - loaded)
    if missing:
        raise ModelLoadError(f"{config.path}: weights missing from the checkpoint: {', '.join(missing[:8])}")
    if quantization:
        quantize_model(model, quantization)
        return model
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack(keep_weight=module is model.lm_head and config.tie_word_embeddings)
    return model


def _rows(name: str, param: torch.Tensor) -> list[int | None]:
    """What a parameter loads from: one tensor, or one per expert for a stacked one."""
    return list(range(param.shape[0])) if ".experts." in name else [None]

"""Load an encoder (gpu/models/bert.py) from its safetensors, float32 on CPU: each linear layer's weight in the native
kernels' panels where they are built (its only copy: gpu/layers/linear.py), else torch's; tensors stream from the
mapped files one by one and leave them as they are copied (gpu/loading/mapped.py). A checkpoint with a tensor the
model has no place for, or without one it needs, or of another shape, raises ModelLoadError naming it.
"""

from __future__ import annotations

import torch

from gpu.kernels import native
from gpu.layers.linear import Linear
from gpu.loading.config import weight_files
from gpu.loading.encoder_config import EncoderConfig
from gpu.loading.errors import ModelLoadError
from gpu.loading.mapped import MappedFile
from gpu.loading.weights import materialize
from gpu.models.bert import BertModel


@torch.no_grad()
def load_encoder(config: EncoderConfig, cpu_kernels: str | None = None) -> BertModel:
    """The encoder with its weights; `cpu_kernels` "torch": torch's linear kernels instead of the native ones."""
    with torch.device("meta"):
        model = BertModel(config)
    model.requires_grad_(False).eval()
    ops = native.ops() if cpu_kernels != "torch" else None
    layers = {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, Linear)}
    if ops is not None:
        for layer in layers.values():
            layer.hold_panels(ops, torch.float32)
    materialize(model, torch.float32, torch.device("cpu"))  # (a layer's panel-held weight stays its shape on meta)
    params = dict(model.named_parameters())
    loaded = set()
    for file in weight_files(config.path):
        f = MappedFile(file)
        for name in f.header:
            target = model.checkpoint_name(name)
            if target is None:
                continue
            if target not in params:
                raise ModelLoadError(f"{file}: unexpected weight {name} for {config.architecture}")
            layer = layers.get(target) if ops is not None else None
            expected = (layer.out_features, layer.in_features) if layer is not None else tuple(params[target].shape)
            if f.shape(name) != expected:
                raise ModelLoadError(f"{file}: {name} has shape {f.shape(name)}, expected {expected}")
            if layer is not None:
                layer.load_rows(f.tensor(name), 0)
            else:
                params[target].copy_(f.tensor(name))
            f.release(name)
            loaded.add(target)
    if missing := sorted(set(params) - loaded):
        raise ModelLoadError(f"{config.path}: weights missing from the checkpoint: {', '.join(missing[:8])}")
    return model

"""Build the model without initializing it and load its *.safetensors weights by name (sharded or not).

The family's class comes from the registry (gpu/models/); a checkpoint tensor loads into the parameter its family's
`checkpoint_name` names (per-expert MoE tensors into one row of a stacked parameter). `checkpoint_plan` matches
every tensor to its destination from the files' headers alone, so `check_checkpoint` (run before any process
starts) names a tensor the model lacks, one of the wrong shape, or one the checkpoint lacks, without reading a
weight. Files are memory-mapped and copied tensor by tensor into the model's dtype: a load never holds a second copy
of the model. Under tensor parallelism each parameter holds its rank's shard (gpu/layers/parallel.py): the plan checks
the checkpoint's full shapes and the load reads only the shard's ranges.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from gpu.attention.backend import AttentionBackend
from gpu.distributed.group import TensorParallel, shaped_as
from gpu.kernels import native
from gpu.layers.attention import Attention
from gpu.layers.linear import Linear
from gpu.layers.parallel import Shard
from gpu.layers.quant import GROUP, Quantization, quantize_model
from gpu.loading.config import ModelConfig, ModelLoadError, weight_files
from gpu.models import REGISTRY
from gpu.models.decoder import CausalLM

log = logging.getLogger("sluice.weights")

Load = tuple[Path, str, str, int | None]  # (file, tensor name, parameter, stacked row or None)


def check_checkpoint(config: ModelConfig, tensor_parallel_size: int = 1, quantization: Quantization | None = None):
    """Raise ModelLoadError unless every parameter has exactly one tensor of its shape in the checkpoint, and the
    model shards over `tensor_parallel_size` ranks, each rank's layers quantizable."""
    for rank in range(tensor_parallel_size):
        try:
            with shaped_as(TensorParallel(rank, tensor_parallel_size)), torch.device("meta"):
                model = REGISTRY[config.architecture](config)
        except ValueError as e:  # (more ranks than heads, KV heads that do not spread over them)
            raise ModelLoadError(f"{config.name}: {e}") from e
        if quantization == "int4":
            odd = sorted({m.in_features for m in model.modules() if isinstance(m, Linear) and m.in_features % GROUP})
            if odd:
                raise ModelLoadError(f"{config.name}: --quantization int4 needs input widths in multiples of {GROUP};"
                                     f" rank {rank} of {tensor_parallel_size} has {odd}")  # fmt: skip
    checkpoint_plan(config, dict(model.named_parameters()), shards_of(model))


def shards_of(model: torch.nn.Module) -> dict[str, Shard]:
    """Parameter name -> its shard, for the sharded ones (module.shards)."""
    found = ((prefix, getattr(m, "shards", {})) for prefix, m in model.named_modules())
    return {f"{prefix}.{name}".lstrip("."): s for prefix, shards in found for name, s in shards.items()}


def checkpoint_plan(config: ModelConfig, params: dict[str, torch.Tensor], shards: dict[str, Shard]) -> list[Load]:
    family, plan, loaded = REGISTRY[config.architecture], [], set()
    for file in weight_files(config.path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings):
                    continue
                target, row = family.checkpoint_name(name)
                if target not in params:
                    raise ModelLoadError(f"{file}: unexpected weight {name} for {config.architecture}")
                expected, shape = list(params[target].shape[row is not None :]), tuple(f.get_slice(name).get_shape())
                if target in shards:  # (the checkpoint holds every rank's)
                    expected[shards[target].dim] = shards[target].full
                if shape != tuple(expected):
                    raise ModelLoadError(f"{file}: {name} has shape {shape}, expected {tuple(expected)}")
                plan.append((file, name, target, row))
                loaded.add((target, row))
    rows = {(name, i) for name, p in params.items() for i in (range(p.shape[0]) if ".experts." in name else [None])}
    missing = sorted(f"{n}[{i}]" if i is not None else n for n, i in rows - loaded)
    if missing:
        raise ModelLoadError(f"{config.path}: weights missing from the checkpoint: {', '.join(missing[:8])}")
    return plan


def materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """`model.to(dtype).to_empty(device)` of a model built on meta, without to_empty's import of sympy (0.4 s of a
    start): each parameter (floating point ones in `dtype`) and buffer as uninitialised memory on `device`."""
    made: dict[int, torch.nn.Parameter] = {}  # (a parameter two modules share stays one)
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) not in made:
                kind = dtype if p.is_floating_point() else p.dtype
                made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=kind, device=device), requires_grad=False)
            setattr(module, name, made[id(p)])
        for name, b in module.named_buffers(recurse=False):
            kind = dtype if b.is_floating_point() else b.dtype
            module._buffers[name] = torch.empty(b.shape, dtype=kind, device=device)


@torch.no_grad()
def load_model(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    quantization: Quantization | None = None,
    attention: AttentionBackend | None = None,
    cpu_kernels: str | None = None,
) -> CausalLM:
    """The model with its weights; `quantization` (CPU, float32 only) replaces every linear layer's weight by an
    int8 or int4 one, kept dequantized too for calls of many rows, or a bfloat16 one (gpu/layers/quant.py); `attention`,
    the backend every attention layer calls (gpu/attention/backend.py; the torch path when None), whose kernel set
    goes to every layer; `cpu_kernels` "native" or None (the default): a CPU float32 model's linear layers use the
    native kernels where built (gpu/kernels/native), quantized layers' few-row calls too; "torch": torch's.
    Once loaded, q/k/v and gate/up weights are stacked into one each."""
    if quantization and (device.type != "cpu" or dtype != torch.float32):
        raise ValueError(f"--quantization {quantization} runs on CPU in float32 only, not {device.type} {dtype}")
    with torch.device("meta"):
        model = REGISTRY[config.architecture](config)
    materialize(model, dtype, device)
    model.requires_grad_(False).eval()
    model.tie_weights()
    if attention is not None:
        for module in model.modules():
            if hasattr(module, "kernels"):
                module.kernels = attention.kernels
            if isinstance(module, Attention):
                module.attend = attention
    for rotary in model.model.rotaries:  # computed, not weights: built on the host
        rotary.to(device)
    params = dict(model.named_parameters())  # a tied lm_head is not listed: it is embed_tokens
    shards = shards_of(model)
    plan = checkpoint_plan(config, params, shards)
    files = {file: safe_open(file, framework="pt", device="cpu") for file, *_ in plan}
    for file, name, target, row in tqdm(plan, desc=f"Loading {config.name}", unit="tensor", disable=len(files) < 2):
        param = params[target] if row is None else params[target][row]
        shard = shards.get(target)
        if shard is None:
            param.copy_(files[file].get_tensor(name))
            continue
        part = shard.read(files[file].get_slice(name)) if shard.ranges else param.narrow(shard.dim, 0, 0)
        if part.shape[shard.dim] < param.shape[shard.dim]:  # padding, or a bias another rank adds
            param.zero_()
        param.narrow(shard.dim, 0, part.shape[shard.dim]).copy_(part)
    for module in list(model.modules()):  # q/k/v and gate/up stacked: one GEMM each (scripts/bench_layouts.py)
        if hasattr(module, "fuse"):
            module.fuse()
    cpu = device.type == "cpu" and dtype == torch.float32
    ops = native.ops() if cpu and cpu_kernels != "torch" else None
    if quantization:
        if quantization == "bf16" and ops is None:
            log.warning("--quantization bf16 without the native kernels: rounded weights in float32, no gain in memory")
        quantize_model(model, quantization, ops)
        return model
    tied = config.tie_word_embeddings
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack(keep_weight=module is model.lm_head and tied, native_ops=ops)
    if tied and model.lm_head.native is not None:  # (the panels are the table's one copy)
        model.model.embed_tokens.read_from(model.lm_head)
    return model

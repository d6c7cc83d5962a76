"""Build the model without initializing it and load its weights by name: *.safetensors (sharded or not), or a GGUF.

The family's class comes from the registry (gpu/models/); a checkpoint tensor loads into the parameter its family's
`checkpoint_name` names (per-expert MoE tensors into one row of a stacked parameter, a GGUF's stacked experts into the
whole; q/k/v and gate/up into the rows of one stacked projection). `checkpoint_plan` matches every tensor to its destination from the files' headers alone,
so `check_checkpoint` (run before any process starts) names a tensor the model lacks, one of the wrong shape, or one
the checkpoint lacks, without reading a weight.

Every weight is held once, in the format it is served in: the model is built on meta and each parameter allocated
in its final layout (a CPU linear layer's native panels, in the weight dtype; the rest in the model's dtype); the
files are memory-mapped (gpu/loading/mapped.py) and each tensor copied straight into its destination, converted
there, then its pages released: the load's peak is what it serves plus one tensor in flight. Under tensor parallelism
each parameter holds its rank's shard (gpu/layers/parallel.py): the plan checks the checkpoint's full shapes and the
load reads only the shard's ranges.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from gguf import GGML_QUANT_SIZES
from tqdm import tqdm

from gpu.attention.backend import AttentionBackend
from gpu.distributed.group import TensorParallel, shaped_as
from gpu.kernels import native
from gpu.layers.attention import Attention
from gpu.layers.linear import BLOCK_FORMATS, Linear
from gpu.layers.moe import ExpertRows, Experts
from gpu.layers.parallel import Shard
from gpu.layers.quant import BLOCK_QUANTIZATIONS, Quantization
from gpu.loading.config import ModelConfig, ModelLoadError, weight_files
from gpu.loading.gguf_card import LONGROPE_FACTORS
from gpu.loading.gguf_file import GGUFFile
from gpu.loading.mapped import MappedFile
from gpu.loading.random_weights import RANDOM, RandomWeights, checkpoint_shapes
from gpu.models import REGISTRY
from gpu.models.decoder import CausalLM

log = logging.getLogger("sluice.weights")

# (the file, read in place; a tensor's name; its parameter; an expert's row or None; its part of a stacked one)
Load = tuple["MappedFile | GGUFFile", str, str, int | None, int]


def check_checkpoint(config: ModelConfig, tensor_parallel_size: int = 1):
    """Raise ModelLoadError unless every parameter has exactly one tensor of its shape in the checkpoint, and the
    model shards over `tensor_parallel_size` ranks."""
    for rank in range(tensor_parallel_size):
        try:
            with shaped_as(TensorParallel(rank, tensor_parallel_size)), torch.device("meta"):
                model = REGISTRY[config.architecture](config)
        except ValueError as e:  # (more ranks than heads, KV heads that do not spread over them)
            raise ModelLoadError(f"{config.name}: {e}") from e
    checkpoint_plan(config, dict(model.named_parameters()), shards_of(model))


def check_quantization(config: ModelConfig, quantization: Quantization | None) -> None:
    """Raise ModelLoadError where `quantization` cannot apply: a GGUF is served in its own types."""
    if quantization and config.moe is not None and weight_files(config.path)[0].name == RANDOM:
        raise ModelLoadError(f"--quantization {quantization}: an MoE model's random weights (--load-format dummy) are"
                             " drawn in whole stacks of experts, which are not quantized as they load")  # fmt: skip
    if quantization and config.gguf_name:
        raise ModelLoadError(
            f"--quantization {quantization} quantizes an HF checkpoint's float weights; {config.name} is a GGUF, "
            "served in its own types (llama.cpp's llama-quantize makes it in another)"
        )


def shards_of(model: torch.nn.Module) -> dict[str, tuple[Shard, ...]]:
    """Parameter name -> its shards (one per checkpoint tensor stacked into it), for the sharded ones."""
    found = ((prefix, getattr(m, "shards", {})) for prefix, m in model.named_modules())
    return {f"{prefix}.{name}".lstrip("."): s for prefix, shards in found for name, s in shards.items()}


ROPE_FREQS = "rope_freqs.weight"  # (a GGUF's Llama 3.x rotary factors: not a parameter; nor longrope's, in the card)


def open_weights(config: ModelConfig, wanted: dict[str, tuple], device=None) -> list[MappedFile | GGUFFile]:
    """The checkpoint's files read in place: safetensors, a GGUF card's files (named as `wanted` names them), or
    random weights of `wanted`'s shapes, drawn on `device`."""
    opened: list[MappedFile | GGUFFile] = []
    for file in weight_files(config.path):
        if file.name == RANDOM:  # (its names a checkpoint's: a headless one's without "model.")
            names = {n.removeprefix("model.") if config.headless else n: s for n, s in wanted.items()}
            opened.append(RandomWeights(file, names, device, 1 - REGISTRY[config.architecture].norm_offset))
        elif file.suffix != ".gguf":
            opened.append(MappedFile(file))
        else:  # (a split model's later parts take the first's metadata)
            opened.append(GGUFFile(file, wanted, opened[0].meta if opened else None))
    return opened


def checkpoint_plan(
    config: ModelConfig, params: dict[str, torch.Tensor], shards: dict[str, tuple[Shard, ...]], device=None
) -> list[Load]:
    family, plan, loaded = REGISTRY[config.architecture], [], set()
    stacks = {name: parts_of(shards, name, None) for name in shards}  # (a whole stack of experts: one dim further in)
    for f in open_weights(config, checkpoint_shapes(family, params, stacks), device):
        for name in f.header:
            if (
                name.endswith("rotary_emb.inv_freq")
                or name in (ROPE_FREQS, *LONGROPE_FACTORS)
                or (name == "lm_head.weight" and config.tie_word_embeddings)
            ):
                continue
            target, row, part = family.checkpoint_name(f"model.{name}" if config.headless else name)
            parts = parts_of(shards, target, row) or (None,)
            if target not in params or part >= len(parts):
                raise ModelLoadError(f"{f.path}: unexpected weight {name} for {config.architecture}")
            expected, shape = list(params[target].shape[row is not None :]), f.shape(name)
            if parts[part] is not None:  # (the checkpoint holds every rank's)
                expected[parts[part].dim] = parts[part].full
            if shape != tuple(expected):
                raise ModelLoadError(f"{f.path}: {name} has shape {shape}, expected {tuple(expected)}")
            plan.append((f, name, target, row, part))
            loaded.add((target, row, part))
    rows = {
        (name, i, part)
        for name, p in params.items()
        for i in (range(p.shape[0]) if ".experts." in name and (name, None, 0) not in loaded else [None])
        for part in range(len(shards.get(name, (None,))))
    }
    missing = sorted(
        n + (f"[{i}]" if i is not None else "") + (f" (part {k})" if k else "") for n, i, k in rows - loaded
    )
    if missing:
        raise ModelLoadError(f"{config.path}: weights missing from the checkpoint: {', '.join(missing[:8])}")
    return plan


def materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """`model.to(dtype).to_empty(device)` of a model built on meta, without to_empty's import of sympy (0.4 s of a
    start): each parameter (floating point ones in `dtype`) and buffer as uninitialised memory on `device`; but a
    parameter its module has `placed` is left on meta (None: held elsewhere, a linear layer's native panels) or
    allocated in the dtype named there."""
    made: dict[int, torch.nn.Parameter] = {}  # (a parameter two modules share stays one)
    for module in model.modules():
        placed = getattr(module, "placed", {})
        for name, p in module.named_parameters(recurse=False):
            if name in placed and placed[name] is None:
                continue
            if id(p) not in made:
                kind = placed.get(name) or (dtype if p.is_floating_point() else p.dtype)
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
    weight_dtype: torch.dtype | None = None,
) -> CausalLM:
    """The model with its weights, activations in `dtype`; `quantization` (CPU, float32 only, the native kernels): each
    linear layer's weight (whole blocks wide) in GGUF blocks, quantized as it loads (gpu/layers/quant.py);
    `attention`, the backend every attention layer calls (gpu/attention/backend.py; the torch path when None), whose
    kernel set goes to every layer; `cpu_kernels` "native" or None (the default): a CPU float32 model's linear layers
    hold their weights in the native kernels' panels where built (gpu/kernels/native), in `weight_dtype` (float32,
    bfloat16 or float16; default `dtype`; the embedding table too); "torch": torch's."""
    if quantization and (device.type != "cpu" or dtype != torch.float32):
        raise ValueError(f"--quantization {quantization} runs on CPU in float32 only, not {device.type} {dtype}")
    cpu = device.type == "cpu" and dtype == torch.float32
    ops = native.ops() if cpu and cpu_kernels != "torch" else None
    weights = weight_dtype or dtype
    panels = ops is not None
    if quantization and ops is None:
        raise ValueError(f"--quantization {quantization} runs on the native CPU kernels: make setup builds them")
    check_quantization(config, quantization)
    if weights != dtype and not panels:
        raise ValueError(f"{weights} weights with {dtype} activations need the native CPU kernels (make setup)")
    with torch.device("meta"):
        model = REGISTRY[config.architecture](config)
    model.requires_grad_(False).eval()
    shards = shards_of(model)
    plan = checkpoint_plan(config, dict(model.named_parameters()), shards, device)  # (on meta: names and shapes)
    into = BLOCK_QUANTIZATIONS.get(quantization, ())
    layers = hold_weights(model, plan, ops, weights, dtype, into) if panels else {}
    materialize(model, dtype, device)
    if not panels:
        model.tie_weights()
    if attention is not None:
        for module in model.modules():
            if hasattr(module, "kernels"):
                module.kernels = attention.kernels
            if isinstance(module, Attention):
                module.attend = attention
    for rotary in model.model.rotaries:  # computed, not weights: built on the host
        rotary.to(device)
    params = dict(model.named_parameters())  # (a tied lm_head shares embed_tokens' parameter: listed once)
    for f, name, target, row, part in tqdm(plan, desc=f"Loading {config.name}", unit="tensor", disable=len(plan) < 500):
        parts, layer = parts_of(shards, target, row), layers.get(target)
        offset = 0 if parts is None else sum(s.length for s in parts[:part])  # (parts stack along dim 0)
        if layer is not None and layer.blocks is not None and not into and f.kind(name) in BLOCK_FORMATS:
            layer.load_rows(f.raw(name), offset)  # (held in place: the mapping's pages are the weight)
            f.hold(name)
            continue
        tensor = f.tensor(name)
        data = tensor if parts is None else parts[part].read(tensor)
        if layer is not None:  # (an HF checkpoint's expert `row`: its rows of the stacked projection)
            layer.load_rows(data, offset if row is None else row * data.shape[0])
        else:
            _write(params[target] if row is None else params[target][row], data, parts, part, offset)
        f.release(name)
    factors = [f.tensor(ROPE_FREQS) for f in {f for f, *_ in plan} if ROPE_FREQS in f.header]
    for rotary in model.model.rotaries if factors else ():  # (theta_i / factor_i, llama.cpp's freq_factors)
        rotary.inv_freq = rotary.inv_freq / factors[0].to(rotary.inv_freq)
    return model


def hold_weights(
    model: CausalLM, plan: list[Load], ops, weights: torch.dtype, dtype: torch.dtype, into: tuple[int, ...] = ()
) -> dict[str, Linear]:
    """Lay each linear layer's weight out for the native kernels before the load: in the first block format of `into`
    whose blocks its width is whole of (quantized as it loads), else in its checkpoint tensors' block formats where each has one the
    kernels run (BLOCK_FORMATS, part by part; one rank holding the whole weight), else in panels of `weights`; the
    embedding's table in a tied head's panels or blocks, in blocks of its own, or in `weights`; an MoE layer's experts
    in blocks where every projection has a format (`into`'s first that fits, or a GGUF's own), else dense. The
    checkpoint parameter name -> the layer its tensors are written into."""
    kinds: dict[str, dict[int, object]] = {}
    for f, name, target, _, part in plan:
        kinds.setdefault(target, {})[part] = f.kind(name)
    whole, tied, embedding = model.tp.size == 1, model.config.tie_word_embeddings, model.model.embed_tokens
    shards, table = shards_of(model), "model.embed_tokens.weight"

    def blocks(layer: Linear, target: str) -> list[tuple[int, int]] | None:
        """(rows, format) of each part, where every part has a block format the kernels run."""
        found, parts = kinds.get(target, {}), shards.get(target)
        rows = [s.length for s in parts] if parts and parts[0].dim == 0 else [layer.out_features]  # (stacked by rows)
        if into:  # (any rank: its shard of each tensor is quantized as it loads)
            kind = next((k for k in into if layer.in_features % GGML_QUANT_SIZES[k][0] == 0), None)
            return [(n, kind) for n in rows] if kind is not None else None
        ok = whole and len(found) == len(rows) and all(k in BLOCK_FORMATS for k in found.values())
        ok = ok and all(layer.in_features % GGML_QUANT_SIZES[k][0] == 0 for k in found.values())
        return [(n, found[i]) for i, n in enumerate(rows)] if ok else None

    def hold(layer: Linear, target: str) -> Linear:
        parts = blocks(layer, target)
        layer.hold_blocks(ops, parts) if parts else layer.hold_panels(ops, weights)
        return layer

    linears = ((f"{n}.weight", m) for n, m in model.named_modules() if isinstance(m, Linear))
    layers = {target: hold(m, target) for target, m in linears if not (tied and m is model.lm_head)}
    for name, experts in ((n, m) for n, m in model.named_modules() if isinstance(m, Experts)):
        fits = lambda k, p, e=experts: getattr(e, p).shape[2] % GGML_QUANT_SIZES[k][0] == 0  # noqa: E731 (whole blocks)
        if into:  # (an HF checkpoint's experts, quantized as they load: each projection's first format that fits)
            found = {p: next((k for k in into if fits(k, p)), None) for p in ("gate", "up", "down")}
        else:  # (a GGUF's stacked experts, in their own formats)
            found = {p: kinds.get(f"{name}.{p}", {}).get(0) for p in ("gate", "up", "down")}
        if (into or whole) and all(k in BLOCK_FORMATS and fits(k, p) for p, k in found.items()):
            experts.hold_blocks(ops, found)
            layers |= {f"{name}.{p}": ExpertRows(experts, p) for p in found}
    if tied:  # (the checkpoint's table goes into the head, the embedding's one copy)
        layers[table] = hold(model.lm_head, table)
        embedding.read_from(model.lm_head)
        return layers
    with torch.device("meta"):
        rows = Linear(embedding.embedding_dim, embedding.num_embeddings, bias=False)
    if blocks(rows, table):
        layers[table] = hold(rows, table)
        embedding.read_from(rows)
    elif weights != dtype:
        embedding.hold_in(weights, dtype)
    return layers


def parts_of(shards: dict[str, tuple[Shard, ...]], target: str, row: int | None) -> tuple[Shard, ...] | None:
    """`target`'s parts; for a whole stack of experts (a GGUF's [experts, out, in]: no row) one dim further in."""
    parts = shards.get(target)
    if parts is None or row is not None or ".experts." not in target:
        return parts
    return tuple(replace(s, dim=s.dim + 1) for s in parts)


def _write(param: torch.Tensor, data: torch.Tensor, parts: tuple[Shard, ...] | None, part: int, offset: int) -> None:
    """Copy a checkpoint tensor's (shard) into its part of `param`; after the last part, the rest zero (a padded
    vocabulary share, a bias another rank adds)."""
    dim = 0 if parts is None else parts[part].dim
    param.narrow(dim, offset, data.shape[dim]).copy_(data)
    end = offset + data.shape[dim]
    if (parts is None or part == len(parts) - 1) and end < param.shape[dim]:
        param.narrow(dim, end, param.shape[dim] - end).zero_()

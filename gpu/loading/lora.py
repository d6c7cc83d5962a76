"""LoRA adapters from PEFT directories (`adapter_config.json` + `adapter_model.safetensors`), read into the
(A, B) pairs of the linear layers they target (gpu/layers/lora.py holds and applies them).

An adapter is known by its content: `adapter_digest` hashes its two files (SHA-256's first 16 bytes, hex: twice
blake2b's speed where the CPU has SHA instructions), which keys the engine's adapters and the prefix cache
(actors/prefix_hash.py): an adapter reloaded with other weights under the same name is another adapter. `read_adapter`
reads each file once, hashes the bytes it parses (so what it returns is what the digest names), checks everything
before a weight is used, and raises LoraError naming the adapter and what is wrong:

| refused                                   | why                                                            |
|-------------------------------------------|----------------------------------------------------------------|
| a missing directory or file, a .bin only  | pickle files are never read (`save_pretrained` writes safetensors) |
| use_dora, lora_bias, bias != "none",      | DoRA's magnitudes, LoRA biases, trained biases and saved      |
| modules_to_save, rank_pattern, alpha_pattern | modules are not served (yet); per-module ranks neither    |
| a target outside q/k/v/o/gate/up/down (or | embeddings, the LM head and MoE experts carry no delta        |
| the fused qkv_proj / gate_up_proj)        |                                                                |
| r above --max-lora-rank, a tensor of the  | the base model's shapes; A [r, in], B [out, r]                 |
| wrong shape, not floating point, a weight |                                                                |
| not finite (as served: scaled, cast)      |                                                                |
| files that hash otherwise than `digest`   | changed since the adapter was named                            |

What it returns is each targeted layer's slot image, its tables' contents for one slot (gpu/layers/lora.py): A's of
its stacked parts [P x rank, in] and Bᵀ [rank, out], zero-padded to the tables' rank, in their dtype, so installing
one is a copy a table. Scale: lora_alpha / r (lora_alpha / sqrt(r) with use_rslora), folded into Bᵀ: the delta is
x·Aᵀ·Bᵀ. Target names are the checkpoint's (`model.layers.N.self_attn.q_proj`,
Phi-3's fused `qkv_proj`); the family's `checkpoint_name` says which stacked layer and which of its parts each is,
as for the base weights (gpu/loading/weights.py). Under tensor parallelism a rank reads its share as the base
weight's: a column-parallel layer's B rows, a row-parallel layer's A columns (its partial delta is summed by the
layer's all-reduce with the base product: Σ_ranks x_r·A_rᵀ·Bᵀ = x·Aᵀ·Bᵀ).
"""

from __future__ import annotations

import hashlib
import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch

from gpu.layers.linear import Linear
from gpu.loading.mapped import Safetensors
from gpu.loading.weights import shards_of
from gpu.models import REGISTRY

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj"}
PEFT_PREFIX = "base_model.model."
REFUSED = {  # adapter_config.json's fields whose non-default values are not served, and what they are
    "use_dora": "DoRA",
    "lora_bias": "LoRA biases",
    "modules_to_save": "modules_to_save (fully trained modules)",
    "rank_pattern": "rank_pattern (per-module ranks)",
    "alpha_pattern": "alpha_pattern (per-module alphas)",
}


class LoraError(ValueError):
    """A LoRA adapter that cannot be served: the message names it and why."""


# a layer's slot image: the layer's stacked parts' first output rows (and its output width last: P + 1 numbers), its
# A's [P x rank, in] and its Bᵀ·scale [rank, out], in the tables' dtype, on the host
SlotImage = tuple[list[int], torch.Tensor, torch.Tensor]


def adapter_files(path: str | Path) -> list[Path]:
    """The adapter's two files (LoraError naming the one missing)."""
    path = Path(path)
    for name in (CONFIG, WEIGHTS):
        if not (path / name).is_file():
            hint = " (pickled .bin weights are not read: save with safe_serialization)" if name == WEIGHTS else ""
            raise LoraError(f"LoRA adapter {path}: no {name}{hint}")
    return [path / CONFIG, path / WEIGHTS]


def adapter_digest(path: str | Path) -> str:
    """The adapter's identity (hex, 32 characters)."""
    return _digest(_contents(Path(path)))


def _contents(path: Path) -> dict[str, bytes]:
    try:
        return {file.name: file.read_bytes() for file in adapter_files(path)}
    except OSError as e:
        raise LoraError(f"LoRA adapter {path}: unreadable: {e}") from e


def _digest(contents: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for name, data in contents.items():  # (the config's, then the weights')
        h.update(name.encode() + b"\0")
        h.update(data)
    return h.hexdigest()[:32]


def adapter_config(path: Path, text: bytes, max_rank: int) -> tuple[int, float]:
    """(r, scale) of a PEFT adapter's config (its bytes: `text`), checked against what is served."""
    try:
        c = json.loads(text)
    except ValueError as e:
        raise LoraError(f"LoRA adapter {path}: unreadable {CONFIG}: {e}") from e
    if not isinstance(c, dict) or c.get("peft_type", "LORA") != "LORA":
        kind = c.get("peft_type") if isinstance(c, dict) else type(c).__name__
        raise LoraError(f"LoRA adapter {path}: {CONFIG} is not a LoRA adapter's ({kind!r})")
    for field, what in REFUSED.items():
        if c.get(field):
            raise LoraError(f"LoRA adapter {path}: {what} ({field}) is not supported")
    if c.get("bias", "none") != "none":
        raise LoraError(f"LoRA adapter {path}: trained biases (bias {c['bias']!r}) are not supported")
    targets = c.get("target_modules")
    if isinstance(targets, list) and (others := sorted(set(targets) - TARGETS)):
        raise LoraError(f"LoRA adapter {path}: target_modules {others} are not supported (only {sorted(TARGETS)})")
    r, alpha = c.get("r"), c.get("lora_alpha", c.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoraError(f"LoRA adapter {path}: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise LoraError(f"LoRA adapter {path}: rank {r} exceeds --max-lora-rank {max_rank}")
    if not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise LoraError(f"LoRA adapter {path}: lora_alpha must be a finite number, got {alpha!r}")
    return r, alpha / (math.sqrt(r) if c.get("use_rslora") else r)


def read_adapter(
    path: str | Path, model: torch.nn.Module, rank: int, dtype: torch.dtype, digest: str | None = None
) -> tuple[str, dict[str, SlotImage]]:
    """(the digest, layer name -> SlotImage) of the adapter at `path` over `model` (a CausalLM, on meta or loaded:
    only its layers' shapes are read), for tables of `rank` in `dtype`; `digest`: what its files must hash to."""
    return _read(path, digest, lambda found: _slot_layout(found, rank, dtype), model, rank)


def check_adapter(path: str | Path, model: torch.nn.Module, rank: int, dtype: torch.dtype = torch.float32) -> str:
    """The adapter's digest once every check of `read_adapter` for tables in `dtype` passed, without laying out its
    images: the launcher's and a registration's."""
    return _read(path, None, lambda found: _check_scaled(found, dtype), model, rank)[0]


def lora_tables(lora_dtype: str, weights: torch.dtype) -> torch.dtype:
    """The LoRA slot tables' format: --lora-dtype's, or for "auto" the base's weights' (`weights`: as the runner
    serves them; a launch fixes it for every process: frontend/preflight.py checked_loras)."""
    return weights if lora_dtype == "auto" else getattr(torch, lora_dtype)


class _Pairs(NamedTuple):
    """An adapter's checked (A, B) pairs, as this rank holds them."""

    path: Path
    r: int
    scale: float
    layers: dict[str, tuple[list[int], Linear]]  # each targeted layer's parts' first rows, and the layer
    writes: list[tuple[str, int, torch.Tensor, torch.Tensor]]  # (layer name, part, A, B)
    stems: dict[str, list[str]]  # each layer's tensors' stems (for a message)


def _read(path: str | Path, digest: str | None, then, model: torch.nn.Module, rank: int):
    """(the files' digest, `then` of their checked pairs), the digest hashed beside the parse (hashlib lets go of
    the GIL as it hashes); files that changed since they were named explain any other fault: that is said first."""
    path = Path(path)
    contents = _contents(path)
    with ThreadPoolExecutor(1, thread_name_prefix="lora-hash") as hasher:
        hashed = hasher.submit(_digest, contents)
        try:
            out = then(_pairs(path, contents, model, rank))
        finally:
            if (found := hashed.result()) != (digest or found):
                raise LoraError(f"LoRA adapter {path} changed since it was named (its files hash otherwise)")
    return found, out


def _pairs(path: Path, contents: dict[str, bytes], model, rank: int) -> _Pairs:
    r, scale = adapter_config(path, contents[CONFIG], rank)
    try:
        weights = Safetensors(path / WEIGHTS, contents[WEIGHTS])  # (views of the bytes read: no copy)
        tensors = {key: weights.tensor(key) for key in weights.header}
    except Exception as e:  # (a truncated or corrupt file, a header that does not fit it: named, never a crash)
        raise LoraError(f"LoRA adapter {path}: unreadable {WEIGHTS}: {e}") from e
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        stem, _, which = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if which not in ("A.weight", "B.weight"):
            raise LoraError(f"LoRA adapter {path}: unexpected tensor {key} (only lora_A and lora_B are served)")
        pairs.setdefault(stem, {})[which[0]] = tensor
    family, shards = REGISTRY[model.config.architecture], shards_of(model)
    stems: dict[str, list[str]] = {}
    layers: dict[str, tuple[list[int], Linear]] = {}
    writes = []
    for stem, pair in sorted(pairs.items()):
        target, row, part = family.checkpoint_name(stem + ".weight")
        layer_name = target.removesuffix(".weight")
        layer = _layer(model, layer_name)
        if row is not None or stem.rpartition(".")[2] not in TARGETS or layer is None:
            raise LoraError(f"LoRA adapter {path}: {stem} is not a layer a LoRA delta is served for")
        if set(pair) != {"A", "B"}:
            raise LoraError(f"LoRA adapter {path}: {stem} lacks lora_{({'A', 'B'} - set(pair)).pop()}")
        shard = shards.get(target)
        stacked = shard if shard and shard[0].dim == 0 else None  # (a column-parallel layer's parts, stacked by rows)
        split_in = shard[0] if shard and shard[0].dim == 1 else None  # (a row-parallel layer's input columns)
        if part >= (1 if stacked is None else len(stacked)):  # (q_proj's names on Phi-3's fused qkv_proj)
            raise LoraError(f"LoRA adapter {path}: {stem} is not a layer of {model.config.architecture}")
        firsts = part_firsts(shard, layer)
        rows = firsts[part + 1] - firsts[part] if stacked is None else stacked[part].full
        ins = layer.in_features if split_in is None else split_in.full
        a, b = pair["A"], pair["B"]
        for t, shape, what in ((a, (r, ins), "lora_A"), (b, (rows, r), "lora_B")):
            if tuple(t.shape) != shape or not t.is_floating_point():
                raise LoraError(f"LoRA adapter {path}: {stem}.{what} is {t.dtype} {tuple(t.shape)}, expected a "
                                f"floating-point {shape}")  # fmt: skip
        # a rank's share (gpu/layers/parallel.py): A's input columns as the base weight's, B's output rows as its
        a = a if split_in is None else split_in.read(a)
        b = b if stacked is None else stacked[part].read(b)
        layers[layer_name] = (firsts, layer)
        writes.append((layer_name, part, a, b))
        stems.setdefault(layer_name, []).append(stem)
    if not layers:
        raise LoraError(f"LoRA adapter {path}: no LoRA weights")
    return _Pairs(path, r, scale, layers, writes, stems)


def _slot_layout(found: _Pairs, rank: int, dtype: torch.dtype) -> dict[str, SlotImage]:
    flat, images = _slot_images(found.layers, rank, dtype)
    for layer_name, part, a, b in found.writes:
        firsts, a_img, b_img = images[layer_name]
        a_img[part * rank : part * rank + found.r] = a
        torch.mul(b.T.float(), found.scale, out=b_img[: found.r, firsts[part] : firsts[part + 1]])  # (in float32)
    if not _finite(flat):  # (as served: scaled, in the tables' dtype; then which layers, for the message)
        bad = {name for name, (_, a_img, b_img) in images.items() if not (_finite(a_img) and _finite(b_img))}
        _refuse_not_finite(found, bad, dtype)
    return images


def _check_scaled(found: _Pairs, dtype: torch.dtype) -> None:
    """Every A and scaled B finite as `dtype` holds it, as `_slot_layout` lays them out: scaling (in float32) and
    rounding are monotonic, so each tensor's least and greatest, so treated, are its ends."""

    def ends(t: torch.Tensor) -> torch.Tensor:  # (float8 has no aminmax: widened first, exactly)
        return torch.stack((t.float() if t.dtype.itemsize == 1 else t).aminmax())

    bad = {name for name, _, a, b in found.writes
           if not (_finite(ends(a).to(dtype)) and _finite((ends(b).float() * found.scale).to(dtype)))}  # fmt: skip
    if bad:
        _refuse_not_finite(found, bad, dtype)


def _refuse_not_finite(found: _Pairs, layers: set[str], dtype: torch.dtype) -> None:
    bad = [stem for name in found.stems if name in layers for stem in found.stems[name]]
    raise LoraError(f"LoRA adapter {found.path}: {', '.join(bad)}: weights not finite (as {dtype}, scaled)")


def _slot_images(layers: dict, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, SlotImage]]:
    """One zeroed buffer for all of an adapter's slot images, and the images as views of it (one allocation, one
    finiteness check)."""
    shapes = {name: (((len(f) - 1) * rank, layer.in_features), (rank, layer.out_features))
              for name, (f, layer) in layers.items()}  # fmt: skip
    flat = torch.zeros(sum(a[0] * a[1] + b[0] * b[1] for a, b in shapes.values()), dtype=dtype)
    images, at = {}, 0
    for name, (a, b) in shapes.items():
        a_img = flat[at : at + a[0] * a[1]].view(a)
        at += a[0] * a[1]
        images[name] = (layers[name][0], a_img, flat[at : at + b[0] * b[1]].view(b))
        at += b[0] * b[1]
    return flat, images


def _finite(t: torch.Tensor) -> bool:
    """Every value of `t` finite: its least and greatest are (a NaN is either; one pass, no mask made)."""
    return all(bool(v.isfinite()) for v in t.aminmax())


def part_firsts(shard, layer: Linear) -> list[int]:
    """A layer's stacked parts' first output rows and its output width (its weight's `shards`: parallel.py)."""
    stacked = shard if shard and shard[0].dim == 0 else None
    firsts = [0] if stacked is None else [sum(s.length for s in stacked[:i]) for i in range(len(stacked))]
    return [*firsts, layer.out_features]


def targetable(model: torch.nn.Module) -> dict[str, list[int]]:
    """Every layer an adapter may target (name -> `part_firsts`): what a CUDA runner's tables are allocated for."""
    shards = shards_of(model)
    return {name: part_firsts(shards.get(f"{name}.weight"), m) for name, m in model.named_modules()
            if isinstance(m, Linear) and name.rpartition(".")[2] in TARGETS}  # fmt: skip


def _layer(model: torch.nn.Module, name: str) -> Linear | None:
    try:
        layer = model.get_submodule(name)
    except AttributeError:
        return None
    return layer if isinstance(layer, Linear) else None

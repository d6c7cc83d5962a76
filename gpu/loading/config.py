"""Model configuration, parsed from an HF-style directory (or a .gguf's card, gpu/loading/gguf_card.py): the fields
every family shares here, a family's own through its class's `quirks` (gpu/models/).

`ModelConfig.from_path` validates the directory up front, so a broken model fails with a `ModelLoadError` that
names what is missing before any process starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from gpu.kernels.reference import ACTIVATIONS
from gpu.layers.moe import MoESpec
from gpu.layers.rotary import ROPE_TYPES, RotaryEmbedding
from gpu.loading.errors import ModelLoadError
from gpu.loading.gguf_card import gguf_card, gguf_model_name
from gpu.loading.random_weights import RANDOM


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": one of ROPE_TYPES, ...}; empty for default
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    max_model_len: int = 2048  # max_position_embeddings, or less where served shorter (`served`)
    hidden_act: str = "silu"  # a key of gpu/kernels/reference.py's ACTIVATIONS
    layer_windows: tuple[int | None, ...] = ()  # per layer: its sliding window, None for full attention
    partial_rotary_factor: float = 1.0  # the share of each head's dims that rotary rotates (Phi-3)
    local_rope: tuple[float, dict] | None = None  # (theta, scaling) of the sliding layers' own rotary (Gemma 3)
    qk_norm: bool = False  # a per-head RMSNorm on q and k before rotary (Qwen3, Gemma 3)
    attn_scale: float | None = None  # the queries' scale (None: head_dim^-1/2)
    attn_softcap: float | None = None  # attention logits soft-capped at this (Gemma 2)
    final_softcap: float | None = None  # output logits soft-capped at this (Gemma 2)
    moe: MoESpec | None = None  # sparse MoE layers (Mixtral, Qwen3-MoE)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32  # the checkpoint's dtype
    gguf_name: str | None = None  # a GGUF's file name, less ".gguf" and a split's part (`path` is its card)
    headless: bool = (
        False  # a bare decoder (`Qwen3Model`: no LM head, its tensors named without "model."): pooling only
    )

    @property
    def name(self) -> str:
        return self.gguf_name or self.path.name

    def served(self, max_model_len: int) -> ModelConfig:
        """This config for a server capped at `max_model_len` (rotary scalings fixed by the served length read it)."""
        return replace(self, max_model_len=min(self.max_model_len, max_model_len))

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        path = Path(path).expanduser()
        if path.suffix == ".gguf":  # (its card: the files besides the weights, which stay in the GGUF)
            path = gguf_card(path)
        if not path.is_dir():
            raise ModelLoadError(f"model directory not found: {path}")
        card = _read_json(path / "gguf.json", required=False)  # (a card, as the engine processes are given it)
        gguf_name = gguf_model_name(card["files"][0]) if card else None
        raw = _read_json(path / "config.json", required=True)
        _require(path, "tokenizer.json")
        weight_files(path)  # raises when weights are missing
        config = cls.from_dict(path, raw, _read_json(path / "generation_config.json", required=False))
        return replace(config, gguf_name=gguf_name)

    @classmethod
    def from_dict(cls, path: Path, raw: dict, generation: dict | None = None) -> ModelConfig:
        from gpu.models import REGISTRY  # (the families import gpu.layers, which this module's types come from)

        where = path / "config.json"
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in REGISTRY), None)
        bare = next((a for a in archs if a.endswith("Model") and f"{a[:-5]}ForCausalLM" in REGISTRY), None)
        arch = arch or (bare and f"{bare[:-5]}ForCausalLM")  # (a bare decoder: its family, headless)
        if arch is None:
            raise ModelLoadError(
                f"{where}: unsupported architecture {archs or 'missing'}; supported: {', '.join(REGISTRY)}"
            )
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in raw]
        if missing:
            raise ModelLoadError(f"{where}: missing {', '.join(missing)}")
        family = REGISTRY[arch]
        heads, layers = raw["num_attention_heads"], raw["num_hidden_layers"]
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope = dict(rope.get("full_attention", rope))  # (per layer type: Gemma 3's; its local one is a quirk)
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        partial = float(rope.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
        rope_type = rope.setdefault("rope_type", rope.pop("type", "default"))
        if rope_type == "su":  # (longrope's former name, in older Phi-3 configs)
            rope_type = rope["rope_type"] = "longrope"
        if rope_type not in ROPE_TYPES:
            raise ModelLoadError(f"{where}: unsupported rope_type {rope_type!r}; supported: {ROPE_TYPES}")
        max_pos = int(raw.get("max_position_embeddings", 2048))
        if "original_max_position_embeddings" in raw:  # (Phi-3 keeps it beside the scaling; HF lets it win)
            rope["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        elif rope_type in ("llama3", "yarn", "longrope"):
            rope.setdefault("original_max_position_embeddings", max_pos)  # (HF's fallback)
        window = raw.get("sliding_window")
        types = raw.get("layer_types") or family.layer_types(raw)
        generation = generation or {}
        eos = generation.get("eos_token_id", raw.get("eos_token_id"))
        fields = dict(
            path=path,
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling={} if rope_type == "default" else rope,
            partial_rotary_factor=partial,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", family.tie_default)) or arch not in archs,
            headless=arch not in archs,  # (its head, unused, the embedding: held once)
            max_position_embeddings=max_pos,
            max_model_len=max_pos,
            hidden_act=raw.get("hidden_act", "silu"),
            layer_windows=tuple(window if t == "sliding_attention" and window else None for t in types[:layers]),
            bos_token_id=generation.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            dtype=_torch_dtype(raw.get("dtype") or raw.get("torch_dtype")),
        )
        try:
            fields.update(family.quirks(raw))
            rotary_dim = int(fields["head_dim"] * partial)
            RotaryEmbedding(rotary_dim, rope_theta, rope, max_pos, max_pos)  # (a scaling missing a parameter fails now)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise ModelLoadError(f"{where}: {arch} needs {e} (rope_parameters {rope})") from e
        if fields["hidden_act"] not in ACTIVATIONS:
            raise ModelLoadError(
                f"{where}: unsupported activation {fields['hidden_act']!r}; supported: {', '.join(ACTIVATIONS)}"
            )
        return cls(**fields)


def weight_files(path: Path) -> list[Path]:
    """The weight files of a model directory: safetensors, sharded (model.safetensors.index.json) or not, the GGUF
    files its card names (gguf.json: gpu/loading/gguf_card.py), or random weights' marker (gpu/loading/random_weights.py)."""
    if (path / RANDOM).is_file():
        return [path / RANDOM]
    card = _read_json(path / "gguf.json", required=False)
    if card is not None:
        files = [Path(f) for f in card.get("files", [])]
        if not files or not all(f.is_file() for f in files):
            raise ModelLoadError(f"{path}: the GGUF files of this card are missing: {card.get('files')}")
        return files
    index = _read_json(path / "model.safetensors.index.json", required=False)
    if index is not None:
        files = sorted({path / name for name in index.get("weight_map", {}).values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing or not files:
            raise ModelLoadError(f"{path}: shards listed in model.safetensors.index.json are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no weights (model.safetensors or *.safetensors) found")
    return files


def _torch_dtype(name: str | None) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _require(path: Path, name: str) -> None:
    if not (path / name).is_file():
        raise ModelLoadError(f"{path}: missing {name}")


def _read_json(file: Path, required: bool) -> dict | None:
    if not file.is_file():
        if required:
            raise ModelLoadError(f"{file.parent}: missing {file.name}")
        return None
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{file}: cannot parse: {e}") from e

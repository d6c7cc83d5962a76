"""Model configuration for the Llama-block family, parsed from an HF-style directory (or a .gguf converted into one).

`ModelConfig.from_path` validates the directory up front, so a broken model fails with a `ModelLoadError` that
names what is missing before any process starts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

# architecture → (q/k/v projections have a bias, o_proj has a bias); None means "read config.attention_bias"
ARCHITECTURES: dict[str, tuple[bool, bool] | None] = {
    "LlamaForCausalLM": None,  # also SmolLM, which is a Llama
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
}
ROPE_TYPES = ("default", "linear", "llama3")


class ModelLoadError(Exception):
    """The model directory cannot be served; the message says exactly what is missing or unsupported."""


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
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": "llama3" | "linear", ...}; empty for default
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    max_model_len: int = 2048  # max_position_embeddings, capped by a sliding window (not implemented)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32  # the checkpoint's dtype

    @property
    def name(self) -> str:
        return self.path.name

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        path = Path(path).expanduser()
        if path.suffix == ".gguf":
            from gpu.convert import ConversionError, ensure_converted

            try:
                path = ensure_converted(path)
            except ConversionError as e:
                raise ModelLoadError(str(e)) from e
        if not path.is_dir():
            raise ModelLoadError(f"model directory not found: {path}")
        raw = _read_json(path / "config.json", required=True)
        _require(path, "tokenizer.json")
        weight_files(path)  # raises when weights are missing
        return cls.from_dict(path, raw, _read_json(path / "generation_config.json", required=False))

    @classmethod
    def from_dict(cls, path: Path, raw: dict, generation: dict | None = None) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"{path / 'config.json'}: unsupported architecture {archs or 'missing'}; supported: {', '.join(ARCHITECTURES)}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{path / 'config.json'}: unsupported hidden_act {raw['hidden_act']!r} (need silu)")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in raw]
        if missing:
            raise ModelLoadError(f"{path / 'config.json'}: missing {', '.join(missing)}")
        heads = raw["num_attention_heads"]
        bias = ARCHITECTURES[arch] or (bool(raw.get("attention_bias", False)),) * 2
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.setdefault("rope_type", rope.pop("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ModelLoadError(
                f"{path / 'config.json'}: unsupported rope_type {rope_type!r}; supported: {ROPE_TYPES}"
            )
        max_pos = int(raw.get("max_position_embeddings", 2048))
        window = raw.get("sliding_window") if raw.get("use_sliding_window", arch == "MistralForCausalLM") else None
        generation = generation or {}
        eos = generation.get("eos_token_id", raw.get("eos_token_id"))
        return cls(
            path=path,
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling={} if rope_type == "default" else rope,
            qkv_bias=bias[0],
            o_bias=bias[1],
            mlp_bias=bool(raw.get("mlp_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=max_pos,
            max_model_len=min(max_pos, window or math.inf),
            bos_token_id=generation.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            dtype=_torch_dtype(raw.get("dtype") or raw.get("torch_dtype")),
        )


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory, sharded (model.safetensors.index.json) or not."""
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

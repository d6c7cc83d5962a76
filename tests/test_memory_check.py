"""The engine's memory before it loads (frontend/memory_check.py, gpu/runner/memory.py `served_weight_bytes`): the
estimate
is a floor of what the loaded model's tensors hold, in every CPU serving format; a model that cannot fit in the
host's MemAvailable is refused before any process starts, with the figures and what to try, unless
--skip-memory-check. (The explanation of an engine SIGKILLed while it starts: tests/test_readiness.py.)"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from actors.engine.config import EngineConfig
from frontend import memory_check
from frontend.cli import build_parser
from frontend.cli_engine import check_memory_of
from frontend.preflight import resolve_model
from gpu.loading.config import ModelLoadError
from gpu.loading.weights import load_model
from gpu.runner.memory import served_weight_bytes
from tests.family_models import make_family_dir

GIB = 1 << 30
ROOT = Path(__file__).resolve().parents[1]


def held(value) -> list[torch.Tensor]:
    """The tensors in a module's attribute: a tensor, or the tensors in its lists of tuples (a layer's blocks)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in held(v)]
    if isinstance(value, dict):  # (held experts' blocks, per projection)
        return held(list(value.values()))
    return []


def held_bytes(model: torch.nn.Module) -> int:
    """Every tensor the model's modules hold (parameters, buffers, the layouts kept beside them, the blocks of a table
    an embedding reads through), each storage once."""
    seen, total = set(), 0
    tables = [m.rows.__self__ for m in model.modules() if isinstance(getattr(m, "rows", None), types.MethodType)]
    for m in [*model.modules(), *tables]:
        own = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        for t in own + [t for v in vars(m).values() for t in held(v)]:
            if t.is_meta:  # (a shape alone: a weight held in another layout)
                continue
            try:
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError):  # (an opaque layout: oneDNN's)
                key, size = id(t), t.numel() * t.element_size()
            if key not in seen:
                seen.add(key)
                total += size
    return total


@pytest.mark.parametrize(
    "weights, quantization",
    [(torch.float32, None), (torch.float32, "q8_0"), (torch.float32, "q4_0"), (torch.float32, "q4_k"),
     (torch.bfloat16, None), (torch.float16, None)],
)  # fmt: skip
def test_the_estimate_is_a_floor_of_what_the_loaded_weights_hold(tiny_model_dir, weights, quantization):
    config = resolve_model(str(tiny_model_dir))
    estimate = served_weight_bytes(config, torch.float32, quantization, "cpu", weights)
    cpu = torch.device("cpu")
    held = held_bytes(load_model(config, cpu, torch.float32, quantization, weight_dtype=weights))
    assert estimate <= held <= 1.05 * estimate, (estimate, held)


@pytest.mark.parametrize("quantization", [None, "q8_0"])
def test_an_moes_estimate_is_a_floor_too(tmp_path, quantization):
    """(HF experts are quantized as they load: gpu/layers/moe.py; dense in float32 without --quantization)"""
    config = resolve_model(str(make_family_dir(tmp_path, "qwen3_moe")))
    estimate = served_weight_bytes(config, torch.float32, quantization, "cpu")
    held = held_bytes(load_model(config, torch.device("cpu"), torch.float32, quantization))
    assert estimate <= held <= 1.05 * estimate, (estimate, held)


def test_replicas_hold_their_own_weights_and_cache(tiny_model_dir):
    config = resolve_model(str(tiny_model_dir))
    one = memory_check.memory_need(config, EngineConfig(model=str(config.path), device="cpu", kv_cache_memory_gb=0.25))
    two = memory_check.memory_need(
        config, EngineConfig(model=str(config.path), device="cpu", kv_cache_memory_gb=0.25, data_parallel_size=2)
    )
    assert one.weights == served_weight_bytes(config, torch.float32, None, "cpu")
    assert 0.24 * GIB < one.kv_cache <= 0.25 * GIB  # (whole blocks of the budget)
    assert (two.weights, two.kv_cache) == (2 * one.weights, 2 * one.kv_cache)


def test_a_model_that_cannot_fit_is_refused_before_any_process_starts(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(memory_check, "mem_available", lambda: 64 << 20)  # 64 MiB left on this host
    config = resolve_model(str(tiny_model_dir))
    engine = EngineConfig(model=str(config.path), device="cpu", kv_cache_memory_gb=0.5)
    with pytest.raises(ModelLoadError, match="cannot fit"):
        check_memory_of(build_parser().parse_args(["serve", str(tiny_model_dir)]), config, engine)
    args = build_parser().parse_args(["serve", str(tiny_model_dir), "--skip-memory-check"])
    assert check_memory_of(args, config, engine).total > 64 << 20  # (told to try anyway: not refused)
    # `sluice serve` checks in a child of its fork server (frontend/preflight.py): a cache no host holds, refused there
    argv = ["serve", str(tiny_model_dir), "--port", "0", "--device", "cpu", "--kv-cache-memory-gb", "100000"]
    run = subprocess.run([sys.executable, "-m", "frontend.cli", *argv], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 1 and run.stdout == "", run.stderr[-2000:]
    assert "cannot fit in this host's memory" in run.stderr and "its KV cache 100000.0 GiB" in run.stderr
    assert "GiB available (MemAvailable" in run.stderr and "--skip-memory-check to try anyway" in run.stderr

"""The worker's device, without a GPU (issue 28): `--device cuda:N` binds the thread that builds the runner (the
device thread, which runs every step) to cuda:N before anything is made there, and the host copy's event is
recorded on that device's stream (unbound, it went on cuda:0's while the copies ran on cuda:N's, and the host could
read the pinned tokens before they arrived); a draft model's KV cache counts in `kv_cache_memory_gb`.

torch.cuda is replaced by recording stand-ins (monkeypatch) where a GPU would be needed."""

from __future__ import annotations

import pytest
import torch

import gpu.runner.model_runner
from actors.engine.config import EngineConfig, SpeculativeConfig
from actors.engine.executor import StepExecutor, num_kv_blocks
from actors.engine.speculative import make_proposer
from gpu.loading.config import ModelConfig
from gpu.runner.model_runner import ModelRunner, resolve_device
from tests.tiny_model import make_tiny_model_dir


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """A target and a draft of another shape (one layer, four KV heads of 8)."""
    root = tmp_path_factory.mktemp("tiny-device")
    target = make_tiny_model_dir(root / "target", seed=0)
    draft = make_tiny_model_dir(root / "draft", seed=1, num_hidden_layers=1, num_key_value_heads=4, head_dim=8)
    return str(target), str(draft)


@pytest.fixture
def two_gpus(monkeypatch):
    """torch.cuda as on a host with two GPUs, cuda:0 current."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_cuda_devices_resolve_with_their_index(two_gpus):
    """The runner, its sampler and a draft model's runner get one device object from one config."""
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")


def test_a_runner_binds_its_thread_before_it_makes_anything_on_the_device(two_gpus, monkeypatch, tiny_dirs):
    calls = []

    class Loaded(Exception):
        """(the stand-in stops the constructor at its first device allocation: the weights)"""

    def load_model(config, device, dtype, quantization, attention, cpu_kernels, weight_dtype):
        calls.append(("load", device))
        raise Loaded

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("bind", torch.device(device))))
    monkeypatch.setattr(gpu.runner.model_runner, "load_model", load_model)
    with pytest.raises(Loaded):
        ModelRunner(ModelConfig.from_path(tiny_dirs[0]), device="cuda:1", dtype="float32")
    assert calls == [("bind", torch.device("cuda", 1)), ("load", torch.device("cuda", 1))]


def test_the_host_copy_event_is_recorded_on_the_step_devices_stream(monkeypatch):
    recorded = []

    class Event:
        def record(self, stream=None):
            recorded.append(stream)

    def current_stream(device=None):
        return "the stream of " + ("the current device" if device is None else str(torch.device(device)))

    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))  # (no pinned memory here)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    executor = StepExecutor.__new__(StepExecutor)
    executor.device = torch.device("cuda", 1)
    out = executor._to_host(torch.tensor([3, 4]), None, None)
    assert recorded == ["the stream of cuda:1"]
    assert out.sampled.tolist() == [3, 4]


def test_the_draft_models_kv_cache_counts_in_the_memory_budget(tiny_dirs):
    """The caches the engine allocates for the target and its draft model, measured, fit `kv_cache_memory_gb` and
    use it: a block more of each would not fit."""
    target_dir, draft_dir = tiny_dirs
    budget = 1 << 20
    spec = SpeculativeConfig(method="draft_model", model=draft_dir, num_speculative_tokens=2)
    config = EngineConfig(model=target_dir, kv_cache_memory_gb=budget / (1 << 30), speculative=spec, device="cpu",
                          dtype="float32", max_num_seqs=2, max_model_len=64, engine_threads=1)  # fmt: skip
    target = ModelConfig.from_path(target_dir)
    blocks = num_kv_blocks(config, target)
    caches = [
        StepExecutor(config, target, blocks).runner.kv_cache,
        make_proposer(config, target, blocks).runner.kv_cache,
    ]
    assert [cache.num_blocks for cache in caches] == [blocks, blocks]  # (paired one-for-one)
    used = sum(t.nbytes for cache in caches for layer in cache.layers for t in layer)
    assert used <= budget < used + used // blocks

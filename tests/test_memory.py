"""The KV cache sized to the device (gpu/runner/memory.py, `--gpu-memory-utilization`): the arithmetic against a fake
device-memory report, the runner sizing its cache through a profiled worst-case step (on CPU, the fake standing in
for CUDA's numbers), the engine's choice of who sizes, the flag. On CUDA (marked): the cache fits the budget."""

from __future__ import annotations

import logging

import pytest
import torch

from actors.engine import executor
from actors.engine.config import EngineConfig
from frontend.cli import build_parser
from frontend.cli_engine import engine_config
from gpu.attention.kv_cache import bytes_per_block
from gpu.loading.config import ModelConfig
from gpu.runner.memory import MemoryPlan, profile
from gpu.runner.model_runner import ModelRunner

GIB = 1 << 30


def test_blocks_are_what_the_fraction_leaves():
    plan = MemoryPlan(
        total=80 * GIB,
        free_at_start=75 * GIB,
        used_at_peak=3 * GIB,
        graphs=GIB // 2,
        drafts=GIB // 4,
        per_block=1 << 20,
    )
    assert plan.blocks(0.9) == (72 * GIB - 3 * GIB - GIB // 2 - GIB // 4) // (1 << 20)
    with pytest.raises(ValueError, match=r"only 75\.00 GiB were free at startup"):
        plan.blocks(1.0)  # 80 GiB asked for, 75 free
    with pytest.raises(ValueError, match=r"no KV cache fits in gpu_memory_utilization 0\.04"):
        plan.blocks(0.04)  # 3.2 GiB: less than the 3.75 in use
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
            plan.blocks(bad)


class FakeMemory:
    """A device of `total` bytes of which `used[k]` are in use at the k-th look (the first: at the engine's start),
    and on which each profiled step's peak grows the allocator by `peaks[k]` beyond what it held at reset_peak."""

    def __init__(self, total: int, used: list[int], peaks: list[int]) -> None:
        self.total, self.used, self.peaks, self.looks, self.resets = total, used, peaks, 0, 0

    def info(self) -> tuple[int, int]:
        self.looks += 1
        return self.total - self.used[self.looks - 1], self.total

    def reset_peak(self) -> None:
        self.resets += 1

    def peak_growth(self) -> int:
        return self.peaks[self.resets - 2]  # (the first reset is at the start, before any step)


def sized_runner(model_dir, memory: FakeMemory, mode: str = "off") -> ModelRunner:
    config = ModelConfig.from_path(model_dir).served(128)
    return ModelRunner(
        config, "cpu", torch.float32, num_blocks=None, block_size=16, max_num_seqs=4, max_num_batched_tokens=40,
        decode_graphs=mode, gpu_memory_utilization=0.5, memory=memory,
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["off", "eager"])
def test_the_runner_sizes_its_cache_from_a_profiled_step(tiny_model_dir, caplog, mode):
    # 64 MiB: 10 held by others at the start, 16 after the profile (the weights and what the steps left loaded); the
    # worst-case step peaks 3 above, a decode step at max_model_len keys 1 (or 4: then it is the peak)
    for decode_peak in (1, 4):
        memory = FakeMemory(total=64 << 20, used=[10 << 20, 16 << 20], peaks=[3 << 20, decode_peak << 20])
        with caplog.at_level(logging.INFO, logger="sluice.memory"):
            runner = sized_runner(tiny_model_dir, memory, mode)
        per_block = bytes_per_block(runner.config, 16, torch.float32)
        assert memory.resets == 4  # at the start, before each step, after them (no graphs are captured here)
        # half the device, less this engine's 6 MiB and the higher peak; the others' 10 MiB do not count
        assert runner.num_blocks == ((32 << 20) - (6 << 20) - (max(3, decode_peak) << 20)) // per_block
        assert runner.kv_cache.num_blocks == runner.num_blocks + (mode == "eager")  # + the pad rows' scratch block
        assert f"KV cache: {runner.num_blocks} blocks of 16 tokens" in caplog.text and "max concurrency" in caplog.text


def test_too_little_free_at_startup_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match=r"only 0\.02 GiB were free at startup"):
        sized_runner(tiny_model_dir, FakeMemory(total=64 << 20, used=[40 << 20, 46 << 20], peaks=[1 << 20] * 2))


def test_a_cache_sized_to_the_device_needs_one(tiny_model_dir):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        ModelRunner(ModelConfig.from_path(tiny_model_dir), "cpu", torch.float32, num_blocks=None)


def test_who_sizes_the_cache(tiny_model_dir, monkeypatch):
    model = ModelConfig.from_path(tiny_model_dir)
    assert executor.num_kv_blocks(EngineConfig(model="m", device="cpu", num_kv_blocks=7), model) == 7
    one_gib = executor.num_kv_blocks(EngineConfig(model="m", device="cpu", kv_cache_memory_gb=1), model)
    assert executor.num_kv_blocks(EngineConfig(model="m", device="cpu"), model) == one_gib > 0  # CPU: 1 GiB
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (nothing here initializes CUDA: no card needed)
    for worker in ("inline", "process"):  # the worker's runner profiles (actors/engine/kv_sizing.py)
        assert executor.num_kv_blocks(EngineConfig(model="m", worker=worker), model) is None
    assert executor.num_kv_blocks(EngineConfig(model="m", num_kv_blocks=9), model) == 9
    assert executor.num_kv_blocks(EngineConfig(model="m", kv_cache_memory_gb=1), model) == 2 * one_gib  # bf16
    gang = EngineConfig(model="m", tensor_parallel_size=2)  # 1 GiB a rank, for its share of the heads
    assert executor.num_kv_blocks(gang, model) >= 2 * one_gib


def test_the_flag(capsys):
    args = build_parser().parse_args(["serve", "m", "--gpu-memory-utilization", "0.5"])
    assert engine_config(args, "m").gpu_memory_utilization == 0.5
    args = build_parser().parse_args(["serve", "m", "--worker", "process", "--gpu-memory-utilization", "0.5"])
    assert engine_config(args, "m").gpu_memory_utilization == 0.5  # (a process worker sizes its cache too)
    with pytest.raises(SystemExit, match="a gang's ranks take --kv-cache-memory-gb"):
        gang = ["--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.5"]
        engine_config(build_parser().parse_args(["serve", "m", *gang]), "m")
    assert engine_config(build_parser().parse_args(["serve", "m"]), "m").gpu_memory_utilization == 0.9
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--gpu-memory-utilization", "1.5"])
    assert "must be in (0, 1]" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_cache_fits_the_budget_on_cuda(tiny_model_dir):
    """What the engine takes of the device, its cache and graphs included, stays within its fraction (2 % slack:
    the graphs' reserve is measured on an eager step)."""
    torch.cuda.empty_cache()
    free_before, total = torch.cuda.mem_get_info()
    runner = ModelRunner(
        ModelConfig.from_path(tiny_model_dir).served(256), "cuda", torch.bfloat16, num_blocks=None,
        gpu_memory_utilization=0.3, attention_backend="triton",
    )  # fmt: skip
    assert runner.num_blocks > 0 and runner.graphs is not None and runner.graphs.graphs
    assert free_before - torch.cuda.mem_get_info()[0] <= 0.32 * total


def test_the_graphs_reserve_covers_both_families(tiny_model_dir):
    """Where graphs will be captured, the plan reserves a decode step's growth at the largest capture size and a
    mixed step's at the largest mixed size, each less its LM head's logits (those run outside the graphs' pool)."""
    config = ModelConfig.from_path(tiny_model_dir).served(128)
    runner = ModelRunner(config, "cpu", torch.float32, num_blocks=8, max_num_seqs=4, max_num_batched_tokens=40)
    memory = FakeMemory(total=64 << 20, used=[16 << 20], peaks=[3 << 20, 5 << 20, 4 << 20])
    memory.reset_peak()  # (the engine's start)
    plan = profile(runner, memory, 54 << 20, [], (4, 40))
    row = config.vocab_size * (4 + 4)  # a row's float32 logits, in the model's float32 and as the sampler's
    assert plan.graphs == (5 << 20) - 4 * row + (4 << 20) - row
    assert plan.used_at_peak == (54 << 20) - (48 << 20) + (3 << 20)  # the worst-case step stays the peak

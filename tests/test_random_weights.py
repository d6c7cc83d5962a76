"""Random weights (`--load-format dummy`, gpu/loading/random_weights.py): a tiny Llama's config and tokenizer, its
weights absent, served with weights drawn as HF initialises them (checked against HF's own init: matrices N(0, 0.02),
norms 1), the same for the same seed and not for another; an MoE's and Gemma's too; the launch serves the copy under the model's name; an
encoder or a pooling launch is refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from actors.engine.config import EngineConfig
from frontend.http_base import HttpConfig
from frontend.preflight import prepare, resolve_model
from gpu.loading.config import ModelConfig, ModelLoadError
from gpu.loading.random_weights import RANDOM, STD, random_copy
from gpu.runner.model_runner import ModelRunner
from tests.family_models import run_greedy
from tests.test_model_families import BLOCK, BUDGET, prompts
from tests.tiny_model import Request, block_pool


@pytest.fixture
def config_only(family_dir_of, tmp_path, monkeypatch):
    """The tiny Llama's directory without its weights (the cache a temporary one)."""
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    source, bare = family_dir_of("llama"), tmp_path / "tiny-llama"
    shutil.copytree(source, bare, ignore=shutil.ignore_patterns("*.safetensors*"))
    return bare


def load(model_dir, seed: int = 0) -> ModelRunner:
    copy = random_copy(model_dir)  # (its config and tokenizer; the source's weights, if any, not read)
    (copy / RANDOM).write_text(json.dumps({"seed": seed}))
    return ModelRunner(ModelConfig.from_path(copy), device="cpu", dtype=torch.float32, num_blocks=32,
                       block_size=BLOCK, num_threads=1)  # fmt: skip


def greedy_logits(runner: ModelRunner) -> list[torch.Tensor]:
    req = Request(block_pool(num_blocks=32), 0, prompts([9])[0], BLOCK)
    return run_greedy(runner, [req], 3, BUDGET)[0]


def test_random_weights_are_drawn_as_hf_initialises_them_and_served(config_only):
    from transformers import AutoConfig, AutoModelForCausalLM

    runner = load(config_only)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_only))  # (HF's own initialisation)
    embed = runner.model.model.embed_tokens.weight
    assert abs(embed.std().item() - STD) < 0.002 and abs(hf.model.embed_tokens.weight.std().item() - STD) < 0.002
    norm = runner.model.model.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm)) and torch.equal(hf.model.layers[0].input_layernorm.weight, norm)
    first = greedy_logits(runner)
    assert all(t.isfinite().all() for t in first)
    assert all(torch.equal(a, b) for a, b in zip(first, greedy_logits(load(config_only)), strict=True))  # (seed 0)
    other = greedy_logits(load(config_only, seed=1))
    assert not torch.equal(first[0], other[0])


@pytest.mark.parametrize("family", ["mixtral", "gemma2"])
def test_other_families_are_drawn_and_served(family_dir_of, tmp_path, monkeypatch, family):
    """An MoE's stacks of experts drawn whole at their shape; Gemma's norms (which scale by 1 + w) drawn 0, as HF's."""
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    runner = load(family_dir_of(family))
    norm = runner.model.model.norm.weight
    assert torch.equal(norm, torch.full_like(norm, 0.0 if family == "gemma2" else 1.0))
    assert all(t.isfinite().all() for t in greedy_logits(runner))


def test_the_launch_serves_the_random_copy_under_the_models_name(config_only):
    with pytest.raises(ModelLoadError, match="no weights"):
        resolve_model(str(config_only))
    model = resolve_model(str(config_only), "dummy")
    assert model.name == config_only.name and (model.path / RANDOM).is_file()
    engine = EngineConfig(model=str(config_only), load_format="dummy", num_kv_blocks=16)
    launch = prepare(engine, HttpConfig(port=0), memory_check=False)
    assert launch["http"].served_model_name == [config_only.name]
    assert str(model.path) in json.dumps([p.actors[0].kwargs for p in launch["processes"]], default=str)


def test_random_weights_are_refused_for_pooling(config_only):
    engine = EngineConfig(model=str(config_only), load_format="dummy", runner="pooling")
    with pytest.raises(ModelLoadError, match="--load-format dummy: not served with a pooling model"):
        prepare(engine, HttpConfig(port=0), memory_check=False)

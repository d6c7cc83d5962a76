"""ModelRunner on tiny random-weight models: logits match HF transformers (fp32, 1e-4) for prefill, decode, chunked
prefill over non-contiguous blocks and mixed batches; PLACEHOLDER inputs come from prev_sampled; broken model
directories fail with a ModelLoadError naming the problem."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu.attention.kv_cache import bytes_per_block, num_blocks_for_memory
from gpu.batch import PLACEHOLDER, BatchSpec, ScheduledRow
from gpu.loading.config import ModelConfig, ModelLoadError
from gpu.runner.model_runner import ModelRunner
from tests.tiny_model import TOKENIZER_FILES, Request, block_pool, make_tiny_model_dir

ATOL = 1e-4
BLOCK_SIZE = 4
LLAMA3_ROPE = dict(
    rope_scaling=dict(
        rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
)
VARIANTS = {
    "llama": dict(arch="llama"),
    "mistral": dict(arch="mistral"),
    "qwen2": dict(arch="qwen2"),
    "llama3-rope": dict(arch="llama", **LLAMA3_ROPE),
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def make_runner(model_dir, **kwargs) -> ModelRunner:
    kwargs = (
        dict(device="cpu", dtype=torch.float32, num_blocks=64, block_size=BLOCK_SIZE, max_num_seqs=8, num_threads=1)
        | kwargs
    )
    return ModelRunner(ModelConfig.from_path(model_dir), **kwargs)


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def hf_last_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0, -1]


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_then_decode_match_hf(variant, tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / variant, **VARIANTS[variant])
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner, pool = make_runner(model_dir), block_pool()
    reqs = [Request(pool, slot, random_tokens(n, seed=slot), BLOCK_SIZE) for slot, n in enumerate((5, 13, 1, 9))]
    for step in range(3):  # one prefill step, then two decode steps
        logits = runner.execute(BatchSpec(step, [r.row() for r in reqs]))
        assert logits.shape == (len(reqs), 49152) and logits.dtype == torch.float32
        for r, row_logits in zip(reqs, logits, strict=True):
            torch.testing.assert_close(row_logits, hf_last_logits(hf, r.tokens), atol=ATOL, rtol=0)
            r.tokens.append(int(row_logits.argmax()))


def test_chunked_prefill_over_noncontiguous_blocks(tiny_dir, hf_model):
    runner, pool = make_runner(tiny_dir), block_pool(seed=1)
    req = Request(pool, 0, random_tokens(23, seed=7), BLOCK_SIZE)
    for step, chunk in enumerate((7, 1, 10)):  # partial chunks do not sample
        assert runner.execute(BatchSpec(step, [req.row(chunk)])).shape == (0, 49152)
    assert req.blocks != sorted(req.blocks)
    for step in range(3, 6):  # last chunk, then decodes
        logits = runner.execute(BatchSpec(step, [req.row()]))
        torch.testing.assert_close(logits[0], hf_last_logits(hf_model, req.tokens), atol=ATOL, rtol=0)
        req.tokens.append(int(logits[0].argmax()))


def test_mixed_batch_prefill_decode_and_partial_chunk(tiny_dir, hf_model):
    runner, pool = make_runner(tiny_dir), block_pool(seed=2)
    decoding, chunked, fresh = (
        Request(pool, slot, random_tokens(n, seed=slot), BLOCK_SIZE) for slot, n in ((0, 6), (1, 30), (2, 11))
    )
    runner.execute(BatchSpec(0, [decoding.row(), chunked.row(9)]))
    decoding.tokens.append(17)
    # one step: a partial chunk (no logits), a decode, a whole prefill — logits come back in batch order
    logits = runner.execute(BatchSpec(1, [chunked.row(12), decoding.row(), fresh.row()]))
    assert logits.shape == (2, 49152)
    torch.testing.assert_close(logits[0], hf_last_logits(hf_model, decoding.tokens), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], hf_last_logits(hf_model, fresh.tokens), atol=ATOL, rtol=0)
    logits = runner.execute(BatchSpec(2, [chunked.row()]))
    torch.testing.assert_close(logits[0], hf_last_logits(hf_model, chunked.tokens), atol=ATOL, rtol=0)


def test_placeholders_are_filled_from_prev_sampled(tiny_dir, hf_model):
    runner, pool = make_runner(tiny_dir), block_pool(seed=3)
    reqs = [Request(pool, slot, random_tokens(n, seed=slot), BLOCK_SIZE) for slot, n in ((5, 4), (3, 7))]
    runner.execute(BatchSpec(0, [r.row() for r in reqs]))
    runner.set_prev_sampled(torch.tensor([3, 5]), torch.tensor([111, 222]))
    rows = []
    for r in reqs:
        r.tokens.append(PLACEHOLDER)
        rows.append(r.row())
        r.tokens[-1] = {5: 222, 3: 111}[r.slot]
    logits = runner.execute(BatchSpec(1, rows))
    for r, row_logits in zip(reqs, logits, strict=True):
        torch.testing.assert_close(row_logits, hf_last_logits(hf_model, r.tokens), atol=ATOL, rtol=0)


def test_sharded_checkpoint_loads(tiny_dir, hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path, max_shard_size="2MB")
    for name in TOKENIZER_FILES:
        shutil.copy(tiny_dir / name, tmp_path / name)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    tokens = random_tokens(5, seed=11)
    logits = make_runner(tmp_path).execute(BatchSpec(0, [Request(block_pool(), 0, tokens, BLOCK_SIZE).row()]))
    torch.testing.assert_close(logits[0], hf_last_logits(hf_model, tokens), atol=ATOL, rtol=0)


def test_config_reads_eos_and_architecture(tiny_dir):
    config = ModelConfig.from_path(tiny_dir)
    assert (config.architecture, config.eos_token_ids, config.bos_token_id) == ("LlamaForCausalLM", (2,), 1)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.tie_word_embeddings


def broken_copy(tiny_dir, tmp_path, remove=(), config_patch=None):
    shutil.copytree(tiny_dir, tmp_path, dirs_exist_ok=True)
    for name in remove:
        (tmp_path / name).unlink()
    if config_patch:
        raw = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps(raw | config_patch))
    return tmp_path


@pytest.mark.parametrize(
    ("remove", "patch", "message"),
    [
        (("config.json",), None, "missing config.json"),
        (("tokenizer.json",), None, "missing tokenizer.json"),
        (("model.safetensors",), None, "no weights"),
        ((), {"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture ['GPT2LMHeadModel']"),
        ((), {"rope_parameters": {"rope_type": "mrope", "factor": 2.0}}, "unsupported rope_type 'mrope'"),
        ((), {"rope_parameters": {"rope_type": "llama3", "factor": 2.0}}, "needs 'low_freq_factor'"),
        ((), {"hidden_act": "relu"}, "unsupported activation 'relu'"),
        ((), {"intermediate_size": 96}, "model.layers.0.mlp.down_proj.weight has shape (64, 128), expected (64, 96)"),
        ((), {"num_hidden_layers": 3}, "weights missing from the checkpoint: model.layers.2"),
    ],
)
def test_broken_model_dir_names_the_problem(tiny_dir, tmp_path, remove, patch, message):
    model_dir = broken_copy(tiny_dir, tmp_path, remove, patch)
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        make_runner(model_dir)


def test_missing_paths_raise_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="model directory not found"):
        ModelConfig.from_path(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        ModelConfig.from_path(tmp_path / "nope.gguf")


def test_step_limits_and_uncovered_blocks_are_rejected(tiny_dir):
    runner, pool = make_runner(tiny_dir, max_num_seqs=2), block_pool()
    too_many = [Request(pool, slot, [5, 6], BLOCK_SIZE).row() for slot in range(3)]
    with pytest.raises(ValueError, match="exceed"):
        runner.execute(BatchSpec(0, too_many))
    row = ScheduledRow("r", 0, list(range(3, 3 + BLOCK_SIZE + 1)), 0, [7], True)
    with pytest.raises(ValueError, match="does not cover"):
        runner.execute(BatchSpec(0, [row]))


def test_num_blocks_for_memory(tiny_dir):
    config = ModelConfig.from_path(tiny_dir)
    per_block = bytes_per_block(config, 16, torch.float32)
    assert per_block == 2 * 2 * 16 * 2 * 16 * 4  # K and V, layers, block_size, kv heads, head_dim, fp32
    assert num_blocks_for_memory(config, 16, torch.float32, 10 * per_block + 1) == 10

"""Every family against HF transformers' own forward (fp32, CPU), on a tiny random-weight checkpoint per family with
its quirks switched on (tests/family_models.py). vLLM's check_logprobs_close discipline: at every position, the
top-5 log-probabilities of each side are within TOL of the other side's at the same ids, and every greedy token is
HF's argmax unless HF's top two are within TOL. Driven through chunked prefill next to other rows' decodes, decoding
past the sliding window, a prefix-cache hit (a request starting on another's cached blocks) and a recompute (a
preempted request re-run from its prompt and output). The rotary scalings are checked the same way on Llama and
Phi-3 checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu.loading.config import ModelConfig
from gpu.loading.weights import check_checkpoint
from gpu.runner.model_runner import ModelRunner
from tests.family_models import FAMILIES, WINDOW, make_family_dir, run_greedy
from tests.tiny_model import TOKENIZER_FILES, Request, block_pool

TOL = 1e-3
BLOCK = 4
PROMPT_LENS = (5, 19, 30)  # two longer than the window, one longer than the step budget
BUDGET = 12
NEW_TOKENS = 12  # decodes that pass the window


@pytest.fixture
def family_dir(request, family_dir_of):
    return family_dir_of(request.param)


def runner_for(model_dir, **config) -> ModelRunner:
    model = ModelConfig.from_path(model_dir)
    if config:
        model = model.served(**config)
    return ModelRunner(model, device="cpu", dtype=torch.float32, num_blocks=128, block_size=BLOCK, num_threads=1)


def prompts(lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def assert_close_to_hf(hf, tokens: list[int], ours: list[torch.Tensor], start: int = 0) -> None:
    """`ours`: our logits at positions start.. of `tokens` (each predicting the next token), through its end."""
    theirs = hf(torch.tensor([tokens])).logits[0, start : start + len(ours)].float().log_softmax(-1)
    mine = torch.stack(ours).log_softmax(-1)
    assert mine.shape == theirs.shape
    for pos, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        for ref, other in ((b, a), (a, b)):
            ids = ref.topk(5).indices
            assert (ref[ids] - other[ids]).abs().max() < TOL, f"position {start + pos}: top-5 logprobs differ"
        top2 = b.topk(2).values
        if top2[0] - top2[1] > TOL:
            assert a.argmax() == b.argmax(), f"position {start + pos}: greedy {int(a.argmax())}, HF {int(b.argmax())}"


@pytest.mark.parametrize("family_dir", list(FAMILIES), indirect=True)
def test_family_matches_hf(family_dir):
    hf = AutoModelForCausalLM.from_pretrained(family_dir, dtype=torch.float32).eval()
    runner, pool = runner_for(family_dir), block_pool(num_blocks=128)
    reqs = [Request(pool, slot, p, BLOCK) for slot, p in enumerate(prompts(PROMPT_LENS))]
    logits = run_greedy(runner, reqs, NEW_TOKENS, BUDGET)
    for r in reqs:
        assert len(r.tokens) > WINDOW
        assert_close_to_hf(hf, r.tokens, logits[r.slot])
    # a prefix-cache hit: a new request on the first two blocks of request 2, cached, then its own tokens
    cached = 2 * BLOCK
    hit = Request(pool, 0, reqs[2].tokens[:cached] + prompts([13], seed=1)[0], BLOCK)
    hit.blocks, hit.num_computed = reqs[2].blocks[:2], cached
    logits = run_greedy(runner, [hit], NEW_TOKENS, BUDGET)
    assert_close_to_hf(hf, hit.tokens, logits[0], start=cached)
    # a recompute: request 1 preempted, re-run from its prompt and output in fresh blocks
    again = Request(pool, 0, reqs[1].tokens, BLOCK)
    logits = run_greedy(runner, [again], 4, BUDGET)
    assert_close_to_hf(hf, again.tokens, logits[0])


LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "original_max_position_embeddings": 16,
    "short_factor": [1.0, 1.3, 1.7, 2.2],  # rotary_dim 8: four frequencies
    "long_factor": [1.5, 3.0, 6.0, 12.0],
}
SCALINGS = {
    "linear": ("llama", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    "llama3": (
        "llama",
        {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
        | {"original_max_position_embeddings": 16, "rope_theta": 10000.0},
    ),
    "yarn": ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1e4}),
    "longrope": ("phi3", LONGROPE),
}


@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_rotary_scalings_match_hf(scaling, tmp_path):
    """Every sequence is longer than original_max_position_embeddings (16): HF's longrope takes its long factors for
    each, as Sluice does when serving more than 16 tokens."""
    family, rope = SCALINGS[scaling]
    extra = {"original_max_position_embeddings": 16} if family == "phi3" else {}
    model_dir = make_family_dir(tmp_path, family, rope_parameters=rope, **extra)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner, pool = runner_for(model_dir), block_pool(num_blocks=128)
    reqs = [Request(pool, slot, p, BLOCK) for slot, p in enumerate(prompts((17, 40)))]
    logits = run_greedy(runner, reqs, NEW_TOKENS, BUDGET)
    for r in reqs:
        assert_close_to_hf(hf, r.tokens, logits[r.slot])


def test_longrope_short_factors_when_served_within_the_original_length(tmp_path):
    """Served with max_model_len <= original_max_position_embeddings, longrope keeps its short factors: HF's, for a
    sequence that short; the long ones would differ."""
    model_dir = make_family_dir(tmp_path, "phi3", rope_parameters=LONGROPE, original_max_position_embeddings=16)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner, pool = runner_for(model_dir, max_model_len=16), block_pool(num_blocks=128)
    reqs = [Request(pool, slot, p, BLOCK) for slot, p in enumerate(prompts((5, 11)))]
    logits = run_greedy(runner, reqs, 4, BUDGET)
    for r in reqs:
        assert len(r.tokens) <= 16
        assert_close_to_hf(hf, r.tokens, logits[r.slot])


def test_sharded_bf16_checkpoint_converts_at_load(family_dir_of, tmp_path):
    """A bf16 checkpoint in several shards, served in float32: HF's float32 forward of the same weights."""
    source = family_dir_of("qwen3_moe")
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(tmp_path, max_shard_size="1MB")
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, tmp_path / name)
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    config = ModelConfig.from_path(tmp_path)
    assert config.dtype == torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    runner, pool = runner_for(tmp_path), block_pool(num_blocks=128)
    reqs = [Request(pool, slot, p, BLOCK) for slot, p in enumerate(prompts((9, 21)))]
    logits = run_greedy(runner, reqs, 4, BUDGET)
    for r in reqs:
        assert_close_to_hf(hf, r.tokens, logits[r.slot])


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_ties_its_embeddings_when_the_config_leaves_it_out(family, family_dir_of, tmp_path):
    """Real Gemma checkpoints have no lm_head and no tie_word_embeddings key (HF's Gemma default: tied)."""
    shutil.copytree(family_dir_of(family), tmp_path, dirs_exist_ok=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["tie_word_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = ModelConfig.from_path(tmp_path)
    assert config.tie_word_embeddings
    check_checkpoint(config)

"""A tiny random-weight Llama-family model saved HF-style (with the real SmolLM2 tokenizer and chat template), and
hand-driven requests for feeding a ModelRunner without a scheduler."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from gpu.batch import ScheduledRow
from gpu.loading.convert import default_model_dir

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_tiny_model_dir(path: str | Path, seed: int = 0, arch: str = "llama", **overrides) -> Path:
    """Write a tiny `arch` ("llama", "mistral" or "qwen2") causal LM into `path` and return it."""
    path = Path(path)
    config_cls, model_cls = ARCHS[arch]
    config = config_cls(
        **{
            "vocab_size": 49152,  # the SmolLM2 tokenizer's
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 2048,
            "tie_word_embeddings": True,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 2,
            **overrides,
        }
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    if arch == "qwen2":  # random q/k/v biases, so that a model ignoring them fails the parity tests
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.1)
    return save_with_tokenizer(model, path)


def save_with_tokenizer(model, path: Path) -> Path:
    """`save_pretrained` into `path`, beside the SmolLM2 tokenizer and chat template and a generation config."""
    model.save_pretrained(path)
    source = default_model_dir()
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, path / name)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return path


class Request:
    """One sequence driven by hand: its tokens, how many are cached, and its KV blocks (popped from `pool`)."""

    def __init__(self, pool: list[int], slot: int, tokens: list[int], block_size: int) -> None:
        self.pool, self.slot, self.tokens, self.block_size = pool, slot, list(tokens), block_size
        self.num_computed, self.blocks = 0, []

    def row(self, n: int | None = None) -> ScheduledRow:
        """The next `n` uncached tokens (all of them by default); the row samples iff they reach the end."""
        end = len(self.tokens) if n is None else self.num_computed + n
        while len(self.blocks) * self.block_size < end:
            self.blocks.append(self.pool.pop())
        tokens = self.tokens[self.num_computed : end]
        row = ScheduledRow(
            f"req-{self.slot}", self.slot, tokens, self.num_computed, list(self.blocks), end == len(self.tokens)
        )
        self.num_computed = end
        return row


def block_pool(seed: int = 0, num_blocks: int = 64) -> list[int]:
    """Block ids in shuffled order, so block tables are not contiguous."""
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)
    return pool

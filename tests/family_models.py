"""Tiny random-weight checkpoints of every family Sluice serves, built by HF transformers from a config with the
family's quirks switched on (windows shorter than the prompts, soft-caps, q/k norm, partial rotary, MoE with four
experts and top-2), saved with `save_pretrained` next to the SmolLM2 tokenizer; and a hand-driven runner that
returns the logits of every position (prompt positions through prompt_targets), for comparison with HF's forward."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from gpu.batch import BatchSpec
from gpu.distributed.group import current
from gpu.runner.model_runner import ModelRunner
from tests.tiny_model import Request, save_with_tokenizer

WINDOW = 8  # tokens: shorter than the prompts and the decodes
SLIDE = ["sliding_attention", "full_attention"]
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": WINDOW, "head_dim": 24}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "gemma2": (
        "Gemma2Config",
        {
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 20,
            "attn_logit_softcapping": 3.0,
            "final_logit_softcapping": 8.0,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 20,
            "layer_types": SLIDE,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        },
    ),
    "phi3": ("Phi3Config", {"partial_rotary_factor": 0.5}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
}


def make_family_dir(path: str | Path, family: str, seed: int = 0, **overrides) -> Path:
    """Write a tiny `family` checkpoint into `path`. Weights are drawn wide (std 0.3; norms around their identity) so
    that a quirk left out changes the logits by far more than the tests' tolerance."""
    path = Path(path)
    config_name, quirks = FAMILIES[family]
    common = dict(
        vocab_size=49152,  # the SmolLM2 tokenizer's
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    config = getattr(transformers, config_name)(**{**common, **quirks, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0, 0.3).add_(1.0 if "norm" in name and not gemma else 0.0)
    return save_with_tokenizer(model, path)


def run_greedy(runner: ModelRunner, reqs: list[Request], new_tokens: int, budget: int) -> dict[int, list[torch.Tensor]]:
    """Greedy decoding of `reqs` (slots 0..n-1) to `new_tokens` each, `budget` tokens per step (rows in order, a long
    prompt chunked next to others' decodes); the logits of every position fed, per slot, in position order."""
    logits: dict[int, list[torch.Tensor]] = {r.slot: [] for r in reqs}
    goal = {r.slot: len(r.tokens) + new_tokens for r in reqs}
    step = 0
    while live := [r for r in reqs if len(r.tokens) < goal[r.slot]]:
        rows, left = [], budget
        for r in live:
            n = min(len(r.tokens) - r.num_computed, left)
            if n:
                row = r.row(n)
                targets = len(row.token_ids) - row.sample  # every fed position but the sampled one
                row.prompt_targets = r.tokens[row.num_computed + 1 : row.num_computed + 1 + targets]
                rows.append(row)
                left -= n
        out = runner.execute(BatchSpec(step, rows))
        sampled = [row for row in rows if row.sample]
        # (under tensor parallelism the first rank has the logits: its greedy tokens are broadcast to every rank)
        greedy = torch.zeros(len(sampled), dtype=torch.int64) if out is None else out[: len(sampled)].argmax(-1)
        for row, token in zip(sampled, current().broadcast(greedy).tolist(), strict=True):
            reqs[row.slot].tokens.append(token)
        if out is not None:
            targets = out[len(sampled) :].split([len(r.prompt_targets) for r in rows])
            by_slot = {row.slot: [*t] for row, t in zip(rows, targets, strict=True)}
            for row, row_logits in zip(sampled, out[: len(sampled)], strict=True):
                by_slot[row.slot].append(row_logits)
            for slot, rows_logits in by_slot.items():
                logits[slot] += rows_logits
        step += 1
    return logits

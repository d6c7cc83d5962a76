"""Greedy parity with HF transformers on the real SmolLM2-135M-Instruct (fp32): 8 prompts of mixed lengths, one longer
than the chunked-prefill budget, batched together through ModelRunner give the same 32 token ids as
`generate(do_sample=False)`, and first-step logits within 1e-3."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from actors.engine.config import EngineConfig
from frontend.offline import AsyncLLM
from gpu.batch import BatchSpec
from gpu.config import ModelConfig
from gpu.convert import default_model_dir
from gpu.runner import ModelRunner
from messages.sampling_params import SamplingParams
from tests.tiny_model import Request, block_pool

pytestmark = pytest.mark.real_model

BUDGET = 64  # tokens per step: the long prompt is prefilled in chunks next to other rows' decodes
NEW_TOKENS = 32
BLOCK_SIZE = 16
CHAT = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [
    "Hi",
    "The capital of France is",
    CHAT.format("What is the capital of France?"),
    "Once upon a time, there was a little girl who",
    CHAT.format("Write a haiku about the sea."),
    "def fibonacci(n):\n    ",
    "1, 2, 3, 4, 5,",
    "The history of the Roman Empire spans many centuries. It began with the founding of the city of Rome and grew "
    "through conquest and diplomacy into one of the largest empires of the ancient world. Its legacy includes law, "
    "language, architecture and engineering. Roads, aqueducts and cities built by the Romans can still be seen "
    "across Europe, North Africa and the Middle East today. Historians still debate the causes of its decline, which",
]


def greedy_generate(runner: ModelRunner, prompts: list[list[int]]) -> tuple[list[list[int]], torch.Tensor]:
    """A minimal scheduler: rows in order, each takes what is left of the step's token budget."""
    pool = block_pool(num_blocks=256)
    reqs = [Request(pool, slot, p, BLOCK_SIZE) for slot, p in enumerate(prompts)]
    first_logits: dict[int, torch.Tensor] = {}
    step = 0
    while live := [r for r in reqs if len(r.tokens) < len(prompts[r.slot]) + NEW_TOKENS]:
        rows, left = [], BUDGET
        for r in live:
            n = min(len(r.tokens) - r.num_computed, left)
            if n:
                rows.append(r.row(n))
                left -= n
        logits = runner.execute(BatchSpec(step, rows))
        for row, row_logits in zip([row for row in rows if row.sample], logits, strict=True):
            first_logits.setdefault(row.slot, row_logits)
            reqs[row.slot].tokens.append(int(row_logits.argmax()))
        step += 1
    return [r.tokens[len(p) :] for r, p in zip(reqs, prompts, strict=True)], torch.stack(
        [first_logits[i] for i in range(len(prompts))]
    )


@torch.no_grad()
def hf_generate(model_dir, prompts: list[list[int]]) -> tuple[list[list[int]], torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = max(map(len, prompts))
    input_ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts])  # left padding with <|im_end|>
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    model.generation_config.eos_token_id = None  # generate exactly NEW_TOKENS, like the loop above
    out = model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        pad_token_id=2,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[:, width:].tolist(), out.logits[0]


@pytest.fixture(scope="module")
def reference():
    """The prompts' ids and HF generate's greedy tokens and first-step logits (computed once)."""
    model_dir = default_model_dir()
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompts = [tokenizer.encode(p).ids for p in PROMPTS]
    assert max(map(len, prompts)) > BUDGET
    return model_dir, prompts, *hf_generate(model_dir, prompts)


def test_greedy_generation_matches_hf(reference):
    model_dir, prompts, theirs, their_first_logits = reference
    runner = ModelRunner(
        ModelConfig.from_path(model_dir),
        device="cpu",
        dtype=torch.float32,
        num_blocks=256,
        block_size=BLOCK_SIZE,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=BUDGET,
        num_threads=1,
    )
    ours, our_first_logits = greedy_generate(runner, prompts)
    assert ours == theirs
    torch.testing.assert_close(our_first_logits, their_first_logits, atol=1e-3, rtol=0)


async def test_engine_actors_match_hf(reference):
    """The same through the real engine + detokenizer processes: scheduler, chunked prefill, sampler, ZMQ."""
    model_dir, prompts, theirs, _ = reference
    config = EngineConfig(model=str(model_dir), max_num_batched_tokens=BUDGET, num_kv_blocks=256, engine_threads=1)
    async with AsyncLLM(config) as llm:
        outs = await llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == theirs

"""LoRA deltas in the model runner against PEFT's own forward (float32, CPU): random adapters over tiny checkpoints of
Llama (separate q/k/v, gate/up stacked into one layer), Qwen2 (q/k/v biases) and Phi-3 (checkpoint-fused qkv_proj and
gate_up_proj). A mixed batch (the base and four adapters, rows in random order, a long prompt chunked next to the
others' decodes) gives every request PEFT's top-5 logprobs at every position within TOL and its greedy tokens
(test_model_families' discipline); the same requests alone give the same."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from gpu.batch import BatchSpec
from gpu.loading.config import ModelConfig
from gpu.loading.lora import adapter_digest
from gpu.runner.model_runner import ModelRunner
from tests.family_models import run_greedy
from tests.lora_adapters import LoraRequest, make_adapter, peft_reference
from tests.test_model_families import BLOCK, BUDGET, assert_close_to_hf, prompts
from tests.tiny_model import block_pool

FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
TARGETS = {  # per adapter: which projections it targets (the last two adapters: a subset, and rsLoRA)
    "llama": [None, ["q_proj", "v_proj"], None, ["down_proj", "up_proj"]],
    "qwen2": [None, ["k_proj", "o_proj"], None, ["gate_proj"]],
    "phi3": [FUSED, ["qkv_proj"], FUSED, ["gate_up_proj", "o_proj"]],
}


@pytest.mark.parametrize(
    "family, kernels, graphs",
    [(f, k, "off") for f in TARGETS for k in ("native", "torch")]
    + [("llama", k, "eager") for k in ("native", "torch")],
)
def test_mixed_batch_matches_peft(family, kernels, graphs, family_dir_of, tmp_path):
    """(graphs "eager": decode steps on the CUDA graphs' static buffers, padded, the rows' slots in a buffer too)"""
    base = family_dir_of(family)
    adapters = []
    for i, targets in enumerate(TARGETS[family]):
        extra = {"targets": targets} if targets else {}
        extra |= {"use_rslora": True} if i == 3 else {}
        adapters.append(make_adapter(base, tmp_path / f"a{i}", seed=i, r=4 + 4 * (i % 2), **extra))
    model = ModelConfig.from_path(base)
    runner = ModelRunner(model, device="cpu", dtype=torch.float32, num_blocks=128, block_size=BLOCK, num_threads=1,
                         cpu_kernels=kernels, lora_slots=4, max_lora_rank=8, decode_graphs=graphs)  # fmt: skip
    assert (runner.lora.ops is not None) == (kernels == "native") and (runner.graphs is not None) == (graphs == "eager")
    # (Llama's decode steps go to the native layer loop, the LoRA kernel inside it)
    assert runner.model.model.native_loop is not None or kernels == "torch" or family != "llama"
    digests = [adapter_digest(a) for a in adapters]
    for digest, path in zip(digests, adapters, strict=True):
        runner.add_adapter(digest, str(path))
    # the base and four adapters, each on two prompts, in a shuffled batch order
    choices = [None, *range(4)] * 2
    random.Random(0).shuffle(choices)
    texts = prompts([5 + 3 * i for i in range(len(choices) - 1)] + [30])
    pool = block_pool(num_blocks=128)

    def requests():
        return [LoraRequest(pool, slot, texts[slot], BLOCK, lora=None if c is None else digests[c])
                for slot, c in enumerate(choices)]  # fmt: skip

    mixed = requests()
    logits = run_greedy(runner, mixed, 6, BUDGET + 24)
    refs = [peft_reference(base, None if c is None else adapters[c]) for c in (None, *range(4))]
    for r, c in zip(mixed, choices, strict=True):
        assert_close_to_hf(refs[0 if c is None else c + 1], r.tokens, logits[r.slot])
    for r, c in zip(mixed, choices, strict=True):  # each alone: the same tokens
        pool.extend(r.blocks)
        alone = LoraRequest(pool, 0, texts[r.slot], BLOCK, lora=r.lora)
        run_greedy(runner, [alone], 6, BUDGET)
        assert alone.tokens == r.tokens, f"slot {r.slot} (adapter {c}) alone differs from the mixed batch"
        pool.extend(alone.blocks)


def test_batch_invariant_lora_rows_are_the_same_bits_alone(family_dir_of, tmp_path):
    """--batch-invariant with adapters: every row's logits, in a mixed batch with chunked prefill, equal its logits
    alone, bit for bit (the native LoRA kernel's deltas do not depend on the tokens around a row)."""
    base = family_dir_of("llama")
    adapters = [make_adapter(base, tmp_path / f"a{i}", seed=i, r=8) for i in range(2)]
    runner = ModelRunner(ModelConfig.from_path(base), device="cpu", dtype=torch.float32, num_blocks=128,
                         block_size=BLOCK, num_threads=1, batch_invariant=True, lora_slots=2, max_lora_rank=8)  # fmt: skip
    digests = [adapter_digest(a) for a in adapters]
    for digest, path in zip(digests, adapters, strict=True):
        runner.add_adapter(digest, str(path))
    choices, pool = [None, 0, 1, 0, 1, None], block_pool(num_blocks=128)
    texts = prompts([5, 9, 30, 13, 7, 21])
    mixed = [
        LoraRequest(pool, i, texts[i], BLOCK, lora=None if c is None else digests[c]) for i, c in enumerate(choices)
    ]
    logits = run_greedy(runner, mixed, 4, BUDGET)
    for r in mixed:
        pool.extend(r.blocks)
        alone = LoraRequest(pool, 0, texts[r.slot], BLOCK, lora=r.lora)
        mine = run_greedy(runner, [alone], 4, BUDGET)[0]
        assert all(torch.equal(a, b) for a, b in zip(mine, logits[r.slot], strict=True)), f"slot {r.slot}"
        pool.extend(alone.blocks)


def test_a_verification_row_runs_the_adapter(family_dir_of, tmp_path):
    """Speculative decoding's verification row (its last token and K drafts, sampled at each) through an adapter: its
    logits at every position are PEFT's (the drafts: PEFT's own greedy tokens, so each position is checked)."""
    base = family_dir_of("llama")
    adapter = make_adapter(base, tmp_path / "a", seed=7)
    runner = ModelRunner(ModelConfig.from_path(base), device="cpu", dtype=torch.float32, num_blocks=32,
                         block_size=BLOCK, num_threads=1, lora_slots=1)  # fmt: skip
    runner.add_adapter(digest := adapter_digest(adapter), str(adapter))
    ref, prompt = peft_reference(base, adapter), prompts([11])[0]
    with torch.no_grad():
        greedy = []
        for _ in range(4):
            greedy.append(int(ref(torch.tensor([prompt + greedy])).logits[0, -1].argmax()))
    r = LoraRequest(block_pool(num_blocks=32), 0, prompt, BLOCK, lora=digest)
    first = runner.execute(BatchSpec(0, [r.row()]))
    r.tokens += greedy
    row = r.row()
    row.draft_token_ids = greedy[1:]
    verified = runner.execute(BatchSpec(1, [row]))
    assert_close_to_hf(ref, prompt + greedy, [first[0], *verified], start=len(prompt) - 1)


def test_a_base_model_that_differs_from_each_adapter(family_dir_of, tmp_path):
    """The power of the above: an adapter's rows run as the base (its delta left out) are far from PEFT's."""
    base = family_dir_of("llama")
    adapter = make_adapter(base, tmp_path / "a", seed=0)
    ref, tokens = peft_reference(base, adapter), prompts([12])[0]
    runner = ModelRunner(ModelConfig.from_path(base), device="cpu", dtype=torch.float32, num_blocks=32,
                         block_size=BLOCK, num_threads=1, lora_slots=1, max_lora_rank=8)  # fmt: skip
    runner.add_adapter(adapter_digest(adapter), str(adapter))  # (held, not run: the rows name none)
    reqs = [LoraRequest(block_pool(num_blocks=32), 0, tokens, BLOCK)]
    logits = run_greedy(runner, reqs, 1, BUDGET)
    with pytest.raises(AssertionError, match="top-5 logprobs differ"):
        assert_close_to_hf(ref, reqs[0].tokens, logits[0])


def test_16_bit_tables_serve_the_adapters_rounded_values(family_dir_of, tmp_path):
    """--lora-dtype bfloat16 over a float32 base: the tables hold half the bytes, and the rows' logits are PEFT's on
    the adapter with its weights rounded to bfloat16 (its scale, 2, folded in exactly), and the rounding is felt: they
    differ from the float32 tables' logits."""
    from safetensors.torch import load_file, save_file

    base = family_dir_of("llama")
    adapter = make_adapter(base, tmp_path / "a", seed=3, r=8)
    rounded = tmp_path / "rounded"
    shutil.copytree(adapter, rounded)
    weights = load_file(adapter / "adapter_model.safetensors")
    save_file({k: v.to(torch.bfloat16).float() for k, v in weights.items()}, rounded / "adapter_model.safetensors")
    model, tokens = ModelConfig.from_path(base), prompts([12])[0]
    logits, bytes_held = {}, {}
    for dtype in ("float32", "bfloat16"):
        runner = ModelRunner(model, device="cpu", dtype=torch.float32, num_blocks=32, block_size=BLOCK, num_threads=1,
                             lora_slots=1, max_lora_rank=8, lora_dtype=dtype)  # fmt: skip
        runner.add_adapter(digest := adapter_digest(adapter), str(adapter))
        bytes_held[dtype] = sum(t.nbytes for la in runner.lora.layers.values() for t in (la.lora_a, la.lora_b))
        req = LoraRequest(block_pool(num_blocks=32), 0, tokens, BLOCK, lora=digest)
        logits[dtype] = run_greedy(runner, [req], 4, BUDGET)[0]
        if dtype == "bfloat16":
            assert_close_to_hf(peft_reference(base, rounded), req.tokens, logits[dtype])
    assert bytes_held["bfloat16"] * 2 == bytes_held["float32"]
    off = max((a - b).abs().max() for a, b in zip(logits["bfloat16"], logits["float32"], strict=True))
    assert off > 1e-4  # (the tables' rounding reaches the logits: the dtype is honoured)


def test_an_adapter_a_runner_cannot_hold_at_start_is_left_out(family_dir_of, tmp_path, caplog):
    """One whose files changed since the launch named them: logged and left out (the worker reports it when a step
    wants it), the others held; the runner starts."""
    base = family_dir_of("llama")
    good, changed = (make_adapter(base, tmp_path / name, seed=i, r=8) for i, name in enumerate(("good", "changed")))
    runner = ModelRunner(ModelConfig.from_path(base), device="cpu", dtype=torch.float32, num_blocks=32,
                         block_size=BLOCK, num_threads=1, lora_slots=2, max_lora_rank=8)  # fmt: skip
    runner.add_adapters({adapter_digest(good): str(good), "0" * 32: str(changed)})
    assert [d for d in runner.lora.digests if d] == [adapter_digest(good)]
    assert "not held at start" in caplog.text and "changed since it was named" in caplog.text

"""Tensor-parallel blocks (gpu/layers/parallel.py) against the one-device forward: two gloo ranks in two spawned
processes shard tiny checkpoints of every kind of block — KV heads split (Llama) and replicated (one KV head),
q/k/v and o biases with an MLP bias (the row-parallel bias added once), Phi-3's fused q/k/v and gate/up tensors,
Gemma 2's soft-caps and sandwich norms, Qwen3-MoE's experts and q/k norm, a vocabulary that does not split evenly
(the last rank's padding), shares that are not equal (3 KV groups, an odd intermediate size: SmolLM2's 9 heads
split so), LoRA adapters on every projection of two of them (a base row beside an adapter's) — and run the same
greedy schedule (chunked prefill beside decodes: tests/family_models.py).
The first rank's logprobs at every position equal the one-device ones within 1e-4 (fp32; the reductions' order
differs), and its greedy tokens are the same; so on the bundled SmolLM2. A size that does not divide the heads is refused by name."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

from frontend.preflight import resolve_model
from gpu.distributed.group import TensorParallel, join, leave, rendezvous
from gpu.layers.parallel import Heads, heads, local_config
from gpu.loading.config import ModelConfig, ModelLoadError
from gpu.loading.lora import adapter_digest
from gpu.loading.weights import check_checkpoint
from gpu.runner.model_runner import ModelRunner
from tests.family_models import make_family_dir, run_greedy
from tests.lora_adapters import LoraRequest, make_adapter
from tests.tiny_model import block_pool

TOL = 3e-4  # float32: logprobs of magnitude ~25 after 30 layers, summed in two orders (whole, and halves all-reduced)
BLOCK, BUDGET, NEW_TOKENS = 4, 12, 8
CASES = {  # name -> (family, config overrides)
    "llama": ("llama", {}),
    "llama_one_kv_head": ("llama", {"num_key_value_heads": 1}),
    "llama_biases_odd_vocab": (
        "llama",
        {"attention_bias": True, "mlp_bias": True, "vocab_size": 49155, "tie_word_embeddings": True},
    ),
    "llama_uneven": (
        "llama",
        {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 127},
    ),
    "phi3": ("phi3", {}),
    "gemma2": ("gemma2", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "smollm2": (None, {}),  # the bundled model: 9 query heads and 3 KV heads over 2 ranks, 30 layers
}
LORA_CASES = {"llama_uneven": "llama_uneven+lora", "phi3": "phi3+lora"}  # (an adapter on every projection)


def greedy_logits(path: Path, adapter: Path | None = None) -> dict[int, list[torch.Tensor]]:
    """The greedy schedule's logits; with `adapter`, the second request runs it (the first the base model)."""
    runner = ModelRunner(ModelConfig.from_path(path), "cpu", torch.float32, 128, BLOCK, num_threads=1,
                         lora_slots=adapter is not None)  # fmt: skip
    if adapter is not None:
        runner.add_adapter(digest := adapter_digest(adapter), str(adapter))
    g = torch.Generator().manual_seed(0)
    pool = block_pool()
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in [5, 19]]
    reqs = [LoraRequest(pool, i, p, BLOCK, lora=digest if adapter and i else None) for i, p in enumerate(prompts)]
    logits = run_greedy(runner, reqs, NEW_TOKENS, BUDGET)  # (empty on a rank that does not sample)
    return {slot: torch.stack(rows) for slot, rows in logits.items() if rows}


def rank_main(rank: int, size: int, paths: dict[str, Path], out: Path) -> None:
    store, _ = rendezvous(f"file://{out}/store", size, first=rank == 0)
    join(rank, size, store, torch.device("cpu"), timeout_s=60)
    try:
        for name, path in paths.items():
            if "+" in name:  # (an adapter, over its base checkpoint)
                continue
            cases = [(name, None)] + ([(LORA_CASES[name], paths[LORA_CASES[name]])] if name in LORA_CASES else [])
            for case, adapter in cases:
                logits = greedy_logits(path, adapter)
                if rank == 0:
                    torch.save(logits, out / f"{case}.pt")
    finally:
        leave()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    built = {name: make_family_dir(root / name, family, **o) for name, (family, o) in CASES.items() if family}
    adapters = {lora: make_adapter(built[name], root / lora, seed=3) for name, lora in LORA_CASES.items()}
    return {**built, "smollm2": resolve_model(None).path, **adapters}


@pytest.fixture(scope="module")
def sharded(checkpoints, tmp_path_factory) -> Path:
    """Each case's first-rank logits under TP = 2, saved by the ranks."""
    out = tmp_path_factory.mktemp("tp-out")
    ctx = multiprocessing.get_context("spawn")
    ranks = [ctx.Process(target=rank_main, args=(r, 2, checkpoints, out)) for r in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(300)
    assert [p.exitcode for p in ranks] == [0, 0]
    return out


@pytest.mark.parametrize("case", [*CASES, *LORA_CASES.values()])
def test_two_ranks_match_one_device(case, checkpoints, sharded):
    ours = torch.load(sharded / f"{case}.pt")
    base = case.partition("+")[0]
    reference = greedy_logits(checkpoints[base], checkpoints[case] if "+" in case else None)
    assert ours.keys() == reference.keys()
    for slot, expected in reference.items():
        assert ours[slot].shape == expected.shape
        assert torch.equal(ours[slot].argmax(-1), expected.argmax(-1))
        assert (ours[slot].log_softmax(-1) - expected.log_softmax(-1)).abs().max() < TOL


def test_heads_split_by_kv_group_and_refuse_by_name(checkpoints):
    assert heads(4, 2, TensorParallel(1, 2)) == Heads(2, 2, 1, 1)
    assert heads(4, 1, TensorParallel(1, 2)) == Heads(2, 2, 0, 1)  # one KV head, replicated
    assert heads(8, 2, TensorParallel(3, 4)) == Heads(6, 2, 1, 1)  # ranks 2 and 3 read KV head 1
    assert heads(9, 3, TensorParallel(0, 2)) == Heads(0, 6, 0, 2)  # SmolLM2: uneven, the first rank the larger
    assert heads(9, 3, TensorParallel(1, 2)) == Heads(6, 3, 2, 1)
    assert heads(4, 2, TensorParallel(0, 4)) == Heads(0, 1, 0, 1)
    c = ModelConfig.from_path(checkpoints["llama"])  # 4 query heads, 2 KV heads
    with pytest.raises(ValueError, match="neither at most nor a multiple of the model's 2 key-value heads"):
        local_config(c, TensorParallel(0, 3))
    with pytest.raises(ValueError, match=r"exceeds the model's query heads per key-value head \(2\)"):
        local_config(c, TensorParallel(0, 8))


def test_a_gang_the_model_does_not_fit_is_refused_before_any_process_starts(checkpoints):
    with pytest.raises(ModelLoadError, match="neither at most nor a multiple of the model's 2 key-value heads"):
        check_checkpoint(ModelConfig.from_path(checkpoints["llama"]), 3)
    check_checkpoint(ModelConfig.from_path(checkpoints["llama"]), 2)

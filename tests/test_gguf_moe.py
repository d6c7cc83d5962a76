"""A mixture-of-experts GGUF served in place: tiny Mixtral (llama.cpp writes it as `llama` with experts) and Qwen3-MoE
checkpoints written as llama.cpp's converter and quantizer write them (tests/gguf_writer.py: each layer's experts
stacked, `ffn_{gate,up,down}_exps` [experts, out, in], the router F32), the experts held in the file's blocks (Q8_0;
Q4_K with Q6_K, random blocks: gguf-py cannot quantize them) or served from F16, against HF transformers' forward of
a checkpoint of the values the file holds (transformers loads it, fusing its experts as it does), every nn.Linear's
input but the router's and both inputs of each expert's projections quantized as llama.cpp's kernels quantize them
(`quantized_experts`: HF's experts' loop with those two roundings): every position's top-5 log-probabilities within
the tolerance, greedy equal where HF's top two are apart."""

from __future__ import annotations

import functools
import shutil

import gguf
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from gpu.layers.linear import BLOCK_FORMATS
from gpu.layers.moe import Experts
from gpu.loading.config import ModelConfig, weight_files
from gpu.loading.gguf_file import GGUFFile
from gpu.loading.mapped import MappedFile
from gpu.loading.weights import load_model
from gpu.runner.memory import served_weight_bytes
from tests.family_models import make_family_dir
from tests.gguf_writer import write_gguf
from tests.test_gguf_loading import TOL, TOL_BLOCKS, logits, own_cache, q8_0, q8_k

T = gguf.GGMLQuantizationType
own_cache = own_cache  # (the cards in this run's cache: the fixture, used here too)
WIDE = dict(hidden_size=256, intermediate_size=512, head_dim=64)
FAMILIES = {
    "mixtral": ("llama", dict(sliding_window=None, **WIDE)),  # (GGUF's llama has no window)
    "qwen3_moe": ("qwen3moe", dict(moe_intermediate_size=256, mlp_only_layers=[], **WIDE)),  # (every layer sparse)
}


def reference(source, out, values: dict, kind: T) -> torch.nn.Module:
    """HF's model of the file's values: `source` with each matrix replaced, loaded by transformers, each linear
    input (the router's but for F32) and the experts' input quantized to 8 bits as llama.cpp's kernels quantize it."""
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = {n: t for f in map(MappedFile, weight_files(source)) for n in f.header for t in [f.tensor(n)]}
    save_file({n: values.get(n, t).contiguous() for n, t in tensors.items()}, out / "model.safetensors")
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    if kind in BLOCK_FORMATS:
        scheme = q8_0 if gguf.GGML_QUANT_SIZES[kind][0] == 32 else q8_k
        for name, m in hf.named_modules():
            if isinstance(m, torch.nn.Linear) and not name.endswith((".block_sparse_moe.gate", ".mlp.gate")):
                m.register_forward_pre_hook(lambda _, args: (scheme(args[0]),))
            elif name.endswith(".experts"):
                m.forward = functools.partial(quantized_experts, m, scheme)
    return hf


def quantized_experts(m, scheme, hidden, top_k_index, top_k_weights) -> torch.Tensor:
    """HF's experts' forward (its MixtralExperts / Qwen3MoeExperts loop over experts, on its own fused weights) with
    both inputs of an expert's projections quantized as llama.cpp's kernels quantize them."""
    out = torch.zeros_like(hidden)
    for e in range(m.num_experts):
        token, pos = torch.where(top_k_index == e)
        if token.numel():
            gate, up = F.linear(scheme(hidden[token]), m.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(scheme(m.act_fn(gate) * up), m.down_proj[e])
            out.index_add_(0, token, y * top_k_weights[token, pos, None])
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    made = tmp_path_factory.mktemp("moe")
    return {family: make_family_dir(made / family, family, **extra) for family, (_, extra) in FAMILIES.items()}


Q4_K_M = {"down_proj": T.Q6_K, "experts": T.Q4_K, "experts.down": T.Q6_K}  # (as llama.cpp's Q4_K_M mixes them)
CASES = [("mixtral", T.Q8_0, None), ("qwen3_moe", T.Q4_K, Q4_K_M), ("mixtral", T.F16, None)]


@pytest.mark.parametrize("family, kind, kinds", CASES)
def test_a_moe_gguf_is_served_as_hf_computes_its_weights(sources, tmp_path, family, kind, kinds):
    values = {}
    path = write_gguf(
        sources[family], tmp_path / "moe.gguf", kind, arch=FAMILIES[family][0], values=values, kinds=kinds
    )
    assert any(name.endswith("ffn_gate_exps.weight") for name in GGUFFile(path).header)
    config = ModelConfig.from_path(path)
    assert config.architecture == {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[family]
    if kind in BLOCK_FORMATS:  # (held in the file's bytes: no float copy of an expert)
        model = load_model(config, torch.device("cpu"), torch.float32)
        held = [m for m in model.modules() if isinstance(m, Experts)]
        assert held and all(m.blocks is not None and m.gate.is_meta for m in held)
        kinds = kinds or {}  # (each projection in its own format)
        want = {p: kinds.get(f"experts.{p}", kinds.get("experts", kind)) for p in ("gate", "up", "down")}
        assert all({p: int(m.blocks[p][0]) for p in want} == want for m in held)
    ours, tokens = logits(path)
    with torch.no_grad():
        hf = reference(sources[family], tmp_path / "reference", values, kind)
        theirs = hf(torch.tensor([tokens[:-1]])).logits[0, : len(ours)].log_softmax(-1)
    mine, tol = ours.log_softmax(-1), TOL_BLOCKS if kind in BLOCK_FORMATS else TOL
    for pos, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        for ref, other in ((b, a), (a, b)):
            ids = ref.topk(5).indices
            assert (ref[ids] - other[ids]).abs().max() < tol, f"position {pos}: top-5 logprobs differ"
        top2 = b.topk(2).values
        assert top2[0] - top2[1] <= tol or a.argmax() == b.argmax(), f"position {pos}: greedy differs"


def test_experts_the_kernels_cannot_all_hold_are_counted_as_they_load(sources, tmp_path):
    """A layer whose experts are not all in formats the block kernels run (BF16 down beside Q8_0 gate/up) is held
    dense in float32 whole: the memory check counts it so, as it counts the all-BF16 file, not the Q8_0 parts in
    their blocks."""
    mixed = write_gguf(sources["qwen3_moe"], tmp_path / "mixed.gguf", T.BF16, arch="qwen3moe",
                       kinds={"experts": T.Q8_0, "experts.down": T.BF16})  # fmt: skip
    dense = write_gguf(sources["qwen3_moe"], tmp_path / "dense.gguf", T.BF16, arch="qwen3moe")
    config = ModelConfig.from_path(mixed)
    held = [m for m in load_model(config, torch.device("cpu"), torch.float32).modules() if isinstance(m, Experts)]
    assert held and all(m.blocks is None and m.gate.dtype == torch.float32 for m in held)
    count = lambda c: served_weight_bytes(c, torch.float32, None, "cpu")  # noqa: E731
    assert count(config) == count(ModelConfig.from_path(dense))

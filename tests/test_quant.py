"""`--quantization q8_0 | q4_0 | q4_k` (gpu/layers/quant.py): an HF checkpoint's layers quantized at load into GGUF
blocks (the blocks' values and kernels: tests/test_quantize_rows.py, tests/test_block_kernels.py). Here: each layer
holds the format the table names (q4_k's widths off 256 in Q5_0), nothing else (no float32 copy: the parameter is
its shape alone), the layer's output is x @ W^T of gguf-py's dequantization of those blocks
within the activations' 8-bit rounding; an engine serves end to end with greedy output close to float32's; retired
names and runs off the native kernels are refused, naming what to use (with --dtype bfloat16, layers whose width is
not whole blocks keep bfloat16 panels). An HF MoE's experts are quantized too."""

from __future__ import annotations

import argparse

import gguf
import pytest
import torch

from actors.engine.config import EngineConfig
from frontend.cli_args import _quantization
from frontend.offline import AsyncLLM
from gpu.kernels import native
from gpu.layers.linear import Linear
from gpu.layers.moe import Experts, expert_weight
from gpu.loading.config import ModelConfig, weight_files
from gpu.loading.mapped import MappedFile
from gpu.runner.model_runner import ModelRunner
from messages.sampling_params import SamplingParams
from tests.family_models import make_family_dir

T = gguf.GGMLQuantizationType
NATIVE = pytest.mark.skipif(native.ops() is None, reason="the native kernels are not built for this CPU")
MODES = ["q8_0", "q4_0", "q4_k"]


@NATIVE
@pytest.mark.parametrize("mode", MODES)
def test_each_layer_holds_its_format_alone_and_computes_its_values(tmp_path, mode):
    """(Qwen2: biases; down_proj's 288-wide input is off q4_k's 256: Q5_0 there)"""
    source = make_family_dir(tmp_path, "qwen2", hidden_size=256, intermediate_size=288, head_dim=64)
    runner = ModelRunner(ModelConfig.from_path(source), device="cpu", num_blocks=8, quantization=mode)
    layers = [m for m in runner.model.modules() if isinstance(m, Linear)]
    x = torch.randn(5, 288, generator=torch.Generator().manual_seed(1))
    first = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_k": T.Q4_K}[mode]
    for m in layers:
        want = T.Q5_0 if mode == "q4_k" and m.in_features % 256 else first
        assert m.native is None and m.weight.is_meta and all(kind == want for _, kind, _ in m.blocks)
        w = torch.cat([torch.from_numpy(gguf.quants.dequantize(b.numpy(), kind)) for _, kind, b in m.blocks])
        xi = x[:, : m.in_features]
        exact = xi.double() @ w.double().t() + (0 if m.bias is None else m.bias.double())
        act = gguf.GGML_QUANT_SIZES[want][0]  # (the activations' blocks: Q8_0's 32, or Q8_K's 256)
        step = xi.abs().view(5, -1, act).amax(-1).repeat_interleave(act, 1).double() / 127
        assert ((m(xi).double() - exact).abs() <= (step / 2 + 1e-5 * xi.abs()) @ w.double().abs().t() + 1e-5).all()
    assert {kind for m in layers for _, kind, _ in m.blocks} == ({T.Q4_K, T.Q5_0} if mode == "q4_k" else {first})


@NATIVE
@pytest.mark.parametrize("family, mode", [("qwen3_moe", "q8_0"), ("mixtral", "q4_k")])
def test_an_hf_moes_experts_are_quantized_as_they_load(tmp_path, family, mode):
    """Every expert's rows of the stacked blocks are gguf-py's quantization of the checkpoint's expert tensor, bit for
    bit (q4_k's widths here are off 256: Q5_0), no float copy is kept, and an expert's product is x @ W^T of those
    values within the activations' rounding."""
    source = make_family_dir(tmp_path, family)
    runner = ModelRunner(ModelConfig.from_path(source), device="cpu", num_blocks=8, quantization=mode)
    want = {"q8_0": T.Q8_0, "q4_k": T.Q5_0}[mode]
    checkpoint = {
        n: t for f in map(MappedFile, weight_files(source)) for n in f.header if (t := f.tensor(n)) is not None
    }
    found = 0
    for name, experts in ((n, m) for n, m in runner.model.named_modules() if isinstance(m, Experts)):
        for proj in ("gate", "up", "down"):
            kind, held = experts.blocks[proj]
            assert kind == want and getattr(experts, proj).is_meta
            out = getattr(experts, proj).shape[1]
            for e in range(getattr(experts, proj).shape[0]):
                hf = next(t for n, t in checkpoint.items() if expert_weight(n) == (f"{name}.{proj}", e))
                rows = held[e * out : (e + 1) * out].numpy()
                assert (rows == gguf.quants.quantize(hf.float().numpy(), want)).all()
                found += 1
        w = torch.from_numpy(gguf.quants.dequantize(held[:out].numpy(), kind))  # (the last: expert 0's down)
        x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(2))
        step = x.abs().view(3, -1, 32).amax(-1).repeat_interleave(32, 1).double() / 127
        err = (experts.project("down", 0, x).double() - x.double() @ w.double().t()).abs()
        assert (err <= (step / 2 + 1e-5 * x.abs()) @ w.double().abs().t() + 1e-5).all()
    assert found > 0


@pytest.mark.parametrize("mode", [*(pytest.param(m, marks=NATIVE) for m in MODES), "bfloat16"])  # (bf16: --dtype)
async def test_quantized_engine_serves_and_stays_close_to_float32(tiny_model_dir, mode):
    prompts = [[1, *range(200 + 9 * i, 212 + 9 * i)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = {}
    for q in (None, mode):
        config = EngineConfig(
            model=str(tiny_model_dir), quantization=None if q in (None, "bfloat16") else q,
            dtype=q if q == "bfloat16" else "auto",
            max_model_len=256, num_kv_blocks=64, engine_threads=1,
        )  # fmt: skip
        async with AsyncLLM(config, log_level="WARNING") as llm:
            outs[q] = await llm.generate(prompts, params)
    first = [o.token_ids[0] for o in outs[None]]
    assert [o.token_ids[0] for o in outs[mode]] == first  # the first greedy token of each prompt
    assert all(len(o.token_ids) == 12 for o in outs[mode])
    pairs = zip(outs[mode], outs[None], strict=True)
    assert any(q.logprobs.sampled != f.logprobs.sampled for q, f in pairs)  # the weights really are quantized


def test_quantization_is_refused_off_the_native_kernels(tiny_model_dir):
    config = ModelConfig.from_path(tiny_model_dir)
    with pytest.raises(ValueError, match="runs on the native CPU kernels"):
        ModelRunner(config, device="cpu", num_blocks=8, quantization="q4_k", cpu_kernels="torch")


@pytest.mark.parametrize("name, use", [("int8", "q8_0"), ("int4", "q4_k or q4_0"), ("bf16", "--dtype bfloat16")])
def test_retired_names_say_what_replaced_them(name, use):
    with pytest.raises(argparse.ArgumentTypeError, match=f"retired: use {use}"):
        _quantization(name)
    with pytest.raises(argparse.ArgumentTypeError, match="q8_0, q4_0, q4_k"):
        _quantization("q4_k_m")

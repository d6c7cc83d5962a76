"""Weight-only quantization (gpu/quant.py): the quantized kernels compute x @ dequantize(W)^T within the rounding
of their bfloat16 activations, dequantize() stays within each scheme's step of the float32 weight, and a quantized
engine serves end to end with greedy output close to the float32 one."""

from __future__ import annotations

import pytest
import torch

from actors.engine.config import EngineConfig
from frontend.offline import AsyncLLM
from gpu.config import ModelConfig
from gpu.quant import GROUP, QUANT_ROWS, QuantLinear
from gpu.runner import ModelRunner
from messages.sampling_params import SamplingParams

MODES = ["int8", "int4"]


def weight(out: int = 96, inp: int = 128) -> torch.Tensor:
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("mode", MODES)
def test_dequantized_weight_is_within_one_step(mode):
    w = weight()
    q = QuantLinear(w, None, mode)
    if mode == "int8":
        step = w.abs().amax(1, keepdim=True) / 127
    else:
        g = w.view(w.shape[0], -1, GROUP)
        step = ((g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15).expand_as(g).reshape(w.shape)
    err = (q.dequantize() - w).abs()
    assert (err <= step).all()  # half a step from rounding, the rest from the scales kept in bfloat16
    assert err.max() > 0  # it is quantized


@pytest.mark.parametrize("rows", [1, QUANT_ROWS, QUANT_ROWS + 1, 40])
@pytest.mark.parametrize("mode", MODES)
def test_kernel_matches_the_dequantized_reference(mode, rows):
    w, bias = weight(), torch.randn(96)
    q = QuantLinear(w, bias, mode)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(1))
    ref = x @ q.dequantize().t() + bias
    # bfloat16 activations (8 bits of mantissa) in the kernel rows: |x| ~ 1, 128 terms
    torch.testing.assert_close(q(x), ref, atol=0.15, rtol=0.02)


@pytest.mark.parametrize("mode", MODES)
async def test_quantized_engine_serves_and_stays_close_to_float32(tiny_model_dir, mode):
    prompts = [[1, *range(200 + 9 * i, 212 + 9 * i)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = {}
    for q in (None, mode):
        config = EngineConfig(
            model=str(tiny_model_dir), quantization=q, max_model_len=256, num_kv_blocks=64, engine_threads=1
        )
        async with AsyncLLM(config, log_level="WARNING") as llm:
            outs[q] = await llm.generate(prompts, params)
    first = [o.token_ids[0] for o in outs[None]]
    assert [o.token_ids[0] for o in outs[mode]] == first  # the first greedy token of each prompt
    assert all(len(o.token_ids) == 12 for o in outs[mode])
    pairs = zip(outs[mode], outs[None], strict=True)
    assert any(q.logprobs.sampled != f.logprobs.sampled for q, f in pairs)  # the weights really are quantized


def test_quantization_is_refused_outside_cpu_float32(tiny_model_dir):
    with pytest.raises(ValueError, match="CPU in float32 only"):
        ModelRunner(ModelConfig.from_path(tiny_model_dir), device="cpu", dtype="bfloat16", quantization="int8")

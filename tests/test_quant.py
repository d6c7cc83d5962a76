"""Weight-only quantization (gpu/layers/quant.py). Every path (the quantized kernel for few rows; above kernel_rows the
float32 GEMM on the weight dequantized at load, oneDNN's or the [in, out] copy) is checked against references
computed here, never the code's own dequantization:
- float32: y = x @ W^T of the original weight, within the worst case of the quantization error (each weight off by
  at most one step: half a step of rounding, the rest from the scales kept in bfloat16) plus the kernel's bfloat16
  rounding; loose, but it holds whatever the inputs;
- the documented scheme, dequantized in this file in float64 (int8: round(w / s) * bf16(s), s = max|w| / 127 per
  output channel; int4: per group of 32, (q - 8) * bf16(scale) + bf16(lo + 8 * scale), q = round((w - lo) / scale)),
  within the path's own arithmetic: float32 GEMM above kernel_rows; bfloat16 activations and outputs (8
  significant bits: a relative error of at most 2^-8 each) for torch's kernel; int8 activations per row and group
  of 32 (each off by at most half a step, max|x| / 254 of its group) for the native kernels. Tight: a misplaced
  nibble or a missing zero point is off by far more.
A quantized engine serves end to end with greedy output close to the float32 one."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from actors.engine.config import EngineConfig
from frontend.offline import AsyncLLM
from gpu.kernels import native
from gpu.layers import quant
from gpu.layers.quant import GROUP, QuantLinear
from gpu.loading.config import ModelConfig
from gpu.runner.model_runner import ModelRunner
from messages.sampling_params import SamplingParams

MODES = ["int8", "int4"]  # (served: on the native kernels where built)
NATIVE = pytest.mark.skipif(native.ops() is None, reason="the native kernels are not built for this CPU")
LAYERS = [*MODES, *(pytest.param(f"{m}-native", marks=NATIVE) for m in MODES)]  # layers: torch's kernels, and native
BF16 = 2.0**-8  # bfloat16's relative rounding error bound


def weight(out: int = 96, inp: int = 128) -> torch.Tensor:
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(0))


def scheme(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the dequantized weight in float64, the step: the most any weight may be off by) of the documented scheme."""
    if mode.startswith("int8"):
        s = w.abs().amax(1, keepdim=True) / 127
        q = (w / s).round().clamp(-127, 127)
        return q.double() * s.bfloat16().double(), s.expand_as(w).double()
    g = w.view(w.shape[0], -1, GROUP)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = (hi - lo) / 15
    q = ((g - lo) / s).round().clamp(0, 15)
    deq = (q.double() - 8) * s.bfloat16().double() + (lo + 8 * s).bfloat16().double()
    return deq.view(w.shape), s.expand_as(g).reshape(w.shape).double()


def layer(w: torch.Tensor, bias: torch.Tensor | None, mode: str) -> QuantLinear:
    """mode "int8", "int4" (torch's kernels), "int8-native" or "int4-native"."""
    return QuantLinear(w, bias, mode.removesuffix("-native"), native.ops() if mode.endswith("native") else None)


def rows_cases(q: QuantLinear) -> list[int]:
    return sorted(r for r in {1, 3, q.kernel_rows, q.kernel_rows + 1, 2 * q.kernel_rows + 3} if r > 0)


def kernel_rounding(x: torch.Tensor, wq: torch.Tensor, q: QuantLinear) -> torch.Tensor:
    """The kernel path's bound: bfloat16 activations and outputs (torch's), or int8 activations per group of GROUP
    (native); zero above kernel_rows (float32 throughout)."""
    if x.shape[0] > q.kernel_rows:
        return torch.zeros(())
    if q.native_ops is not None:
        amax = x.abs().unflatten(-1, (-1, GROUP)).amax(-1, keepdim=True).expand(-1, -1, GROUP).reshape(x.shape)
        return (amax.double() / 254 * (1 + 1e-5)) @ wq.abs().t()
    return BF16 * (x.abs().double() @ wq.abs().t()) * (2 + BF16)


@pytest.mark.parametrize("onednn", [True, False])  # False: the [in, out] copy, where oneDNN is missing
@pytest.mark.parametrize("mode", LAYERS)
@pytest.mark.parametrize("inp", [128, 96, 288, 100, 97])  # 4 groups; 3 (odd: a pair's high half unused); 9 (the
# native int4 m terms' full eight lanes and a tail); off the groups; odd
def test_every_path_matches_the_scheme_and_float32(mode, onednn, inp, monkeypatch):
    if inp % GROUP and mode.startswith("int4"):
        pytest.skip("int4 takes widths in whole groups")
    if not onednn:
        monkeypatch.setattr(quant, "onednn_pack", lambda weight: None)
    w, bias = weight(96, inp), torch.randn(96, generator=torch.Generator().manual_seed(2))
    q = layer(w, bias, mode)
    assert (q.native_ops is not None) == (mode.endswith("native") and inp % GROUP == 0)  # (else torch's kernel)
    wq, step = scheme(w, mode)
    assert ((wq - w.double()).abs() <= step).all()
    for rows in rows_cases(q):
        x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows))
        y = q(x).double()
        slack = max(1e-5, inp * 2**-24) * (x.abs().double() @ wq.abs().t() + 1)  # float32 accumulation of inp terms
        rounding = kernel_rounding(x, wq, q)  # (97: int8 dequantized at every row count, torch's kernel being wrong)
        to_scheme = (y - (x.double() @ wq.t() + bias.double())).abs()
        assert (to_scheme <= rounding + slack).all(), (rows, (to_scheme - rounding).max())
        to_float = (y - (x.double() @ w.double().t() + bias.double())).abs()
        worst = x.abs().double() @ step.t() + rounding + slack
        assert (to_float <= worst).all(), rows
        assert to_float.max() > 1e-3  # it is quantized


@pytest.mark.parametrize("mode", LAYERS)
def test_leading_dimensions_are_kept(mode):
    q = layer(weight(), None, mode)
    k = q.kernel_rows
    x = torch.randn(2, k, 128, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(q(x), q(x.reshape(2 * k, 128)).view(2, k, 96), rtol=0, atol=0)
    torch.testing.assert_close(q(x[1:, :1]), q(x[1, :1]).view(1, 1, 96), rtol=0, atol=0)


@pytest.mark.parametrize("mode", LAYERS)
def test_many_rows_dequantize_nothing_per_call(mode):
    """Above kernel_rows the layer multiplies by the float32 weight it dequantized once, at load: a call allocates
    its output, nothing of the weight's size (the former path rebuilt the whole float32 weight on every call)."""
    q = layer(weight(1024, 256), None, mode)
    x = torch.randn(q.kernel_rows + 1, 256)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        q(x)
    largest = max(abs(e.cpu_memory_usage) for e in prof.events())
    assert x.shape[0] * 1024 * 4 <= largest < 1024 * 256 * 4


@pytest.mark.parametrize("mode", [pytest.param(f"{m}-native", marks=NATIVE) for m in MODES])
def test_a_non_finite_activation_makes_its_row_nan_and_no_other(mode):
    """A NaN or an infinity in one row's input: that row's outputs NaN (its group's scale is NaN), the other rows'
    the same bits as without it."""
    q, x = layer(weight(), None, mode), torch.randn(3, 128, generator=torch.Generator().manual_seed(4))
    clean = q(x)
    for bad in (float("nan"), float("inf")):
        poisoned = x.clone()
        poisoned[1, 40] = bad
        y = q(poisoned)
        assert y[1].isnan().all() and torch.equal(y[[0, 2]], clean[[0, 2]])


@pytest.mark.parametrize("mode", [*MODES, "bfloat16", pytest.param("q8_0", marks=NATIVE)])  # (bfloat16: --dtype)
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


def test_quantization_is_refused_outside_cpu_float32(tiny_model_dir):
    with pytest.raises(ValueError, match="CPU in float32 only"):
        ModelRunner(ModelConfig.from_path(tiny_model_dir), device="cpu", dtype="bfloat16", quantization="int8")

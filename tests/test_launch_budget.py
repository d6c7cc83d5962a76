"""The launch budget of the GPU path (issue 30): the kernels one decode step launches, counted as the aten ops it
dispatches plus its Triton launches (compiled on CUDA, the interpreter's on CPU), each charged to the decoder layer
running it.

Views (an op that may alias and did: `x.to(dtype)` of another dtype is a copy and counts), allocations and other
metadata-only ops launch nothing on a GPU and are not counted; everything else is (a copy, a cast, an index, a GEMM).
Ops count only inside the counted step. The step is `ModelRunner.execute` in bfloat16 on the triton backend, the GPU path's
dtype and backend: at most LAYER_BUDGET launches per decoder layer, plus STEP_BUDGET for the rest (embedding,
rotary cos/sin, the final norm, the logit rows and the LM head). The torch backend's layers, counted alike, exceed
the budget: the counter sees what it must. The sampler is counted alike: the fused one (gpu/sampling/fused_triton.py)
at any mix of rows within SAMPLER_BUDGET, the torch path far beyond it.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from gpu.batch import BatchSpec, ScheduledRow
from gpu.kernels.triton import fused as triton_fused
from gpu.loading.config import ModelConfig
from gpu.runner.model_runner import ModelRunner
from gpu.sampling import Sampler, SamplingMetadata
from tests.test_sampler_fused import mixed_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

LAYER_BUDGET, STEP_BUDGET = 12, 30
aten = torch.ops.aten
FREE = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default, aten.new_empty.default}


class LaunchCounter(TorchDispatchMode):
    """Counts launches per place: "step", or the index of the decoder layer running (set by module hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.where: str | int = "step"
        self.counts: Counter = Counter()
        self.ops: dict = {}
        self.active = False

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def launch(self, name: str) -> None:
        if self.active:
            self.counts[self.where] += 1
            self.ops.setdefault(self.where, []).append(name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (list, tuple)) else out  # split's views
        aliased = func.is_view and first.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()
        if not (aliased or func in FREE):
            self.launch(str(func.overloadpacket))
        return out


@pytest.fixture
def counter(monkeypatch):
    """A LaunchCounter that also counts each Triton launch once (not the torch ops the interpreter runs it with)."""
    count = LaunchCounter()
    kernel_type = type(triton_fused._act_and_mul_kernel)  # JITFunction, or the interpreter's InterpretedFunction
    run = kernel_type.run

    def counted_run(self, *args, **kwargs):
        count.launch(f"triton:{self.fn.__name__}")
        with _disable_current_modes():
            return run(self, *args, **kwargs)

    monkeypatch.setattr(kernel_type, "run", counted_run)
    return count


def decode_step_launches(model_dir, backend: str, counter: LaunchCounter, context_lens) -> LaunchCounter:
    runner = ModelRunner(
        ModelConfig.from_path(model_dir), DEVICE, torch.bfloat16, num_blocks=64, num_threads=1,
        attention_backend=backend, decode_graphs="off",  # (a replayed graph would hide its launches from the hooks)
    )  # fmt: skip
    # decode rows whose contexts are already "cached" (the cache's zeros: values do not change what is launched)
    rows, first = [], 0
    for i, n in enumerate(context_lens):
        blocks = list(range(first, first + n // 16 + 1))
        rows.append(ScheduledRow(f"r{i}", i, [5], n, blocks, True))
        first += len(blocks)
    for i, layer in enumerate(runner.model.model.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: setattr(counter, "where", i))
        layer.register_forward_hook(lambda *_: setattr(counter, "where", "step"))
    with counter:
        runner.execute(BatchSpec(0, rows))
    return counter


# Llama (SmolLM2's shape), Qwen3 (per-head q/k norms), Gemma 2 (four norms a layer, soft-caps, scaled embeddings);
# Llama: one row past 256 keys takes split-K attention (two launches)
CASES = {"llama": (5, 260, 17), "qwen3": (5, 17), "gemma2": (9, 17)}


@pytest.mark.parametrize("family", list(CASES))
def test_a_decode_step_on_the_gpu_path_fits_the_launch_budget(family, family_dir_of, counter):
    counts = decode_step_launches(family_dir_of(family), "triton", counter, CASES[family])
    layers = {k: v for k, v in counts.counts.items() if k != "step"}
    assert len(layers) == 2  # both layers were counted
    for layer, n in layers.items():
        assert n <= LAYER_BUDGET, f"layer {layer}: {n} launches: {counts.ops[layer]}"
    assert counts.counts["step"] <= STEP_BUDGET, counts.ops["step"]
    assert any(op.startswith("triton:") for op in counts.ops[0])
    assert ("triton:_reduce_kernel" in counts.ops[0]) == (family == "llama")  # split-K where a row passes 256 keys


def test_the_torch_path_exceeds_the_budget(family_dir_of, counter):
    counts = decode_step_launches(family_dir_of("llama"), "torch", counter, (5, 17))
    assert counts.counts[0] > LAYER_BUDGET, counts.ops[0]


SAMPLER_BUDGET = 6  # the fused sampler's launches at any mix of rows (issue 53: "~6")


def sampler_launches(counter: LaunchCounter, fused: bool) -> LaunchCounter:
    """One sampler call over every row kind at once: greedy and random rows, top-k / top-p / min-p, seeded, every
    processor, logprobs, on bfloat16 logits (the GPU path's)."""
    x, rows = mixed_rows(logprobs=2)
    meta = SamplingMetadata.build(rows, x.shape[1], DEVICE, edits=fused)
    sampler, x = Sampler(fused=fused, sort_free="triton"), x.to(DEVICE, torch.bfloat16)
    with counter:
        sampler(x, meta)
    return counter


def test_the_fused_sampler_fits_its_budget_and_the_torch_path_does_not(counter):
    counts = sampler_launches(counter, fused=True)
    assert counts.counts["step"] <= SAMPLER_BUDGET, counts.ops["step"]
    assert sum(op.startswith("triton:") for op in counts.ops["step"]) == 2  # prepare + sample
    counter.counts.clear()
    counter.ops.clear()
    assert sampler_launches(counter, fused=False).counts["step"] > 5 * SAMPLER_BUDGET

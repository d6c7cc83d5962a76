"""The layer loop as one native call (gpu/runner/native_loop.py): a runner with it and one without it (the Python loop)
give the same logits bit for bit through prefill chunks, decode batches and multi-token rows, float32, bfloat16 and
float16 weights and GGUF blocks (--quantization), with batch-invariant mode and without, and for the families whose layers it takes (fused projections,
biases, partial rotary, sliding windows, other head sizes); the steps it takes are counted (it is not a test of
the Python loop against itself); families with layers it does not take, and other backends, keep the Python loop."""

import pytest
import torch

from gpu.batch import BatchSpec
from gpu.kernels import native
from gpu.loading.config import ModelConfig
from gpu.runner.model_runner import ModelRunner
from tests.tiny_model import Request, block_pool

pytestmark = pytest.mark.skipif(native.ops() is None, reason="no native CPU kernels built (make setup builds them)")


class Counted:
    """A loop that counts the steps it runs."""

    def __init__(self, loop) -> None:
        self.loop, self.steps = loop, 0

    def takes(self, meta) -> bool:
        return self.loop.takes(meta)

    def __call__(self, *args):
        self.steps += 1
        return self.loop(*args)


def drive(runner: ModelRunner) -> list[torch.Tensor]:
    """Each step's logits: prompts in chunks beside a 21-token prefill (then three 8-token chunks: 24 rows), then decode steps of 4 rows, one of them feeding 3 tokens at once
    on odd steps (as a verification row), the fed tokens fixed (not sampled) so that both runners see the same."""
    pool = block_pool(1, 64)
    reqs = [Request(pool, i, list(range(5 + i, 25 + 2 * i)), 16) for i in range(4)]
    steps = [[reqs[0].row(5), reqs[1].row(), reqs[2].row(3)], [reqs[0].row(8), reqs[2].row(8), reqs[3].row(8)]]
    steps.append([reqs[0].row(), reqs[2].row(), reqs[3].row()])
    out = [runner.execute(BatchSpec(step=i, rows=rows)) for i, rows in enumerate(steps)]
    for step in range(3, 9):
        for i, r in enumerate(reqs):
            r.tokens += [(7 * step + i) % 50 + 3] * (3 if i == 1 and step % 2 else 1)
        out.append(runner.execute(BatchSpec(step=step, rows=[r.row() for r in reqs])))
    return out


def both(model_dir, **kwargs) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """(logits with the native loop, logits without it, steps the loop ran)."""
    config = ModelConfig.from_path(model_dir)
    args = dict(device="cpu", dtype="float32", num_blocks=64, block_size=16) | kwargs
    with_loop, without = ModelRunner(config, **args), ModelRunner(config, **args)
    assert with_loop.model.model.native_loop is not None
    counted = with_loop.model.model.native_loop = Counted(with_loop.model.model.native_loop)
    without.model.model.native_loop = None
    return drive(with_loop), drive(without), counted.steps


@pytest.mark.parametrize(
    "dtype, quantization",
    [("float32", None), ("bfloat16", None), ("float16", None), ("float32", "q8_0"), ("float32", "q4_k")],
)
@pytest.mark.parametrize("invariant", [False, True])
def test_the_loop_computes_the_python_loops_bits(tiny_model_dir, dtype, quantization, invariant):
    loop, python, steps = both(tiny_model_dir, dtype=dtype, quantization=quantization, batch_invariant=invariant)
    assert all(torch.equal(a, b) for a, b in zip(loop, python, strict=True))
    # the first and third steps have rows of over 8 queries (the torch attention path, not the loop) unless invariant
    assert steps == len(python) - 2 * (not invariant)


@pytest.mark.parametrize(
    "family, quantization", [("phi3", None), ("qwen2", None), ("qwen2", "q4_k"), ("mistral", None)]
)
def test_families_it_takes(family_dir_of, family, quantization):
    """(Phi-3: fused projections, partial rotary; Qwen2: q/k/v biases, on panels and on blocks; Mistral:
    sliding windows, another head size)"""
    loop, python, steps = both(family_dir_of(family), quantization=quantization)
    assert all(torch.equal(a, b) for a, b in zip(loop, python, strict=True)) and steps == len(python) - 2


@pytest.mark.parametrize("family", ["gemma2", "qwen3", "mixtral"])  # (sandwich norms, q/k norms, MoE)
def test_families_it_does_not_take_keep_the_python_loop(family_dir_of, family):
    runner = ModelRunner(ModelConfig.from_path(family_dir_of(family)), device="cpu", dtype="float32", num_blocks=8)
    assert runner.model.model.native_loop is None


def test_other_backends_keep_the_python_loop(tiny_model_dir):
    config = ModelConfig.from_path(tiny_model_dir)
    for args in (dict(attention_backend="torch"), dict(cpu_kernels="torch")):
        assert ModelRunner(config, device="cpu", dtype="float32", num_blocks=8, **args).model.model.native_loop is None

"""The LoRA kernels against the torch path (gpu/layers/lora.py LoraSlots.add without ops): the native CPU kernel and
the Triton pair (under TRITON_INTERPRET=1: tests/conftest.py), on stacked layers of one, two and three parts, ranks
padded and not, tokens of the base (-1) between those of several slots; and the native kernel's batch invariance (a
token's delta the same bits alone)."""

from __future__ import annotations

import pytest
import torch

from gpu.kernels import native
from gpu.kernels.triton import lora as triton_lora
from gpu.layers.lora import LoraSlots

SHAPES = [(64, 96, [0, 96]), (64, 160, [0, 64, 160]), (96, 80, [0, 48, 64, 80])]  # (in, out, parts' first columns)
KERNELS = {"native": native.ops(), "triton": triton_lora}


class Layer:
    def __init__(self, a, b, parts):
        self.lora_a, self.lora_b, self.lora_parts = a, b, parts


def reference(x, y, slots, layer, rank):
    """The torch path's y + deltas."""
    table = LoraSlots(layer.lora_a.shape[0], rank, torch.float32, torch.device("cpu"))
    table.groups = [(s, torch.nonzero(slots == s).flatten()) for s in slots.unique().tolist() if s >= 0]
    out = y.clone()
    table.add(layer, x, out)
    return out


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("shape", SHAPES)
def test_a_kernel_adds_the_torch_paths_deltas(kernel, shape):
    ops = KERNELS[kernel]
    if ops is None:
        pytest.skip("no native CPU kernels built for this CPU")
    width, out, parts = shape
    device = "cuda" if kernel == "triton" and torch.cuda.is_available() else "cpu"  # (triton interpreted on CPU)
    g = torch.Generator().manual_seed(len(parts))
    rank, slots_held = 8, 3
    a = torch.randn(slots_held, (len(parts) - 1) * rank, width, generator=g)
    b = torch.randn(slots_held, rank, out, generator=g)
    b[1, 5:] = 0  # (slot 1: a rank-5 adapter, zero-padded)
    x, y = torch.randn(11, width, generator=g), torch.randn(11, out, generator=g)
    slots = torch.tensor([0, -1, 2, 2, 1, -1, 0, 1, 2, -1, 0])
    layer = Layer(a, b, parts)
    expected = reference(x, y, slots, layer, rank)
    got = y.clone().to(device)
    ops.lora_add(x.to(device), got, slots.to(device), a.to(device), b.to(device), parts)
    got = got.cpu()
    assert (got - expected).abs().max() < 1e-4
    assert torch.equal(got[slots < 0], y[slots < 0])  # (the base model's tokens untouched)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_native_kernel_reads_16_bit_tables_as_their_float32_values(dtype, shape):
    """--lora-dtype: a 16-bit table's delta is the one of its values widened to float32, on every ISA this CPU runs
    (the same bits on each)."""
    runs = [ops for ops in (native.ops("avx2"), native.ops("avx512")) if ops is not None]
    if not runs:
        pytest.skip("no native CPU kernels built for this CPU")
    width, out, parts = shape
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(3, (len(parts) - 1) * 8, width, generator=g), torch.randn(3, 8, out, generator=g)
    a16, b16 = a.to(dtype), b.to(dtype)
    x, y = torch.randn(13, width, generator=g), torch.randn(13, out, generator=g)
    slots = torch.tensor([0, -1, 2, 2, 1, -1, 0, 1, 2, -1, 0, 1, 1])
    widened = y.clone()
    runs[0].lora_add(x, widened, slots, a16.float(), b16.float(), parts)
    for ops in runs:
        got = y.clone()
        ops.lora_add(x, got, slots, a16, b16, parts)
        assert torch.equal(got, widened)
    assert (widened - reference(x, y, slots, Layer(a16, b16, parts), 8)).abs().max() < 1e-4  # (the torch path's too)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_kernel_gives_a_token_its_bits_alone(dtype):
    ops = KERNELS["native"]
    if ops is None:
        pytest.skip("no native CPU kernels built for this CPU")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 48, 576, generator=g).to(dtype), torch.randn(4, 16, 960, generator=g).to(dtype)
    x, y = torch.randn(40, 576, generator=g), torch.randn(40, 960, generator=g)
    slots, parts = torch.randint(-1, 4, (40,), generator=g), [0, 576, 768, 960]
    batch = y.clone()
    ops.lora_add(x, batch, slots, a, b, parts)
    for t in range(40):
        alone = y[t : t + 1].clone()
        ops.lora_add(x[t : t + 1], alone, slots[t : t + 1], a, b, parts)
        assert torch.equal(alone[0], batch[t]), f"token {t}"


@pytest.mark.cuda
def test_on_cuda_the_triton_pair_and_captured_graphs_give_the_eager_paths_tokens(family_dir_of, tmp_path):
    """(A GPU session's check, scripts/gpu_check.py: skipped without CUDA.) The Triton pair on bfloat16 tables equals
    the torch path; a float32 runner that captures decode graphs with two adapters' rows in them gives the tokens of
    one that runs every step eagerly."""
    from gpu.loading.config import ModelConfig
    from gpu.loading.lora import adapter_digest
    from gpu.runner.model_runner import ModelRunner
    from tests.family_models import run_greedy
    from tests.lora_adapters import LoraRequest, make_adapter
    from tests.tiny_model import block_pool

    g = torch.Generator().manual_seed(1)
    width, out, parts = SHAPES[2]
    a = (torch.randn(2, 3 * 8, width, generator=g) * 0.1).cuda().bfloat16()  # (deltas of order 1: bfloat16's
    b = (torch.randn(2, 8, out, generator=g) * 0.1).cuda().bfloat16()  # rounding of y well under the tolerance)
    x, y = torch.randn(7, width, generator=g).cuda().bfloat16(), torch.randn(7, out, generator=g).cuda().bfloat16()
    slots = torch.tensor([0, -1, 1, 1, 0, -1, 1]).cuda()
    got = y.clone()
    triton_lora.lora_add(x, got, slots, a, b, parts)
    expected = reference(
        x.float().cpu(), y.float().cpu(), slots.cpu(), Layer(a.float().cpu(), b.float().cpu(), parts), 8
    )
    assert (got.float().cpu() - expected).abs().max() < 0.1  # (bfloat16 in and out: y of order 1 rounds by < 0.01)
    base = family_dir_of("llama")
    adapters = [make_adapter(base, tmp_path / f"a{i}", seed=i) for i in range(2)]
    tokens = {}
    for mode in ("capture", "off"):
        runner = ModelRunner(ModelConfig.from_path(base), device="cuda", dtype=torch.float32, num_blocks=64,
                             block_size=4, lora_slots=2, max_lora_rank=8, decode_graphs=mode)  # fmt: skip
        digests = [adapter_digest(p) for p in adapters]
        for digest, path in zip(digests, adapters, strict=True):
            runner.add_adapter(digest, str(path))
        pool = block_pool(num_blocks=64)
        reqs = [
            LoraRequest(pool, i, list(range(10 + i, 20 + 2 * i)), 4, lora=[None, *digests][i % 3]) for i in range(6)
        ]
        run_greedy(runner, reqs, 6, 64)
        tokens[mode] = [r.tokens for r in reqs]
    assert tokens["capture"] == tokens["off"]

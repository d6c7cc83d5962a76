"""The attention backend choice (gpu/attention/backend.py): the whole model on the triton backend (the Triton
interpreter on CPU), and on the native one (short rows native, prefills torch's, or every row native), gives the torch backend's greedy tokens and logits through prefill, chunked prefill next to other
rows' decodes, decode past the sliding window (Gemma 2: windows and soft-caps; Llama: neither), a prefix-cache hit and
a recompute; the default per device; the flag from the CLI to the runner; choosing the torch backend imports no
triton."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from frontend.cli import build_parser
from frontend.cli_engine import engine_config
from gpu.attention.backend import choose_attention_backend
from gpu.attention.native_backend import NativeAttention
from gpu.attention.torch_backend import TorchAttention
from gpu.attention.triton_backend import TritonAttention
from gpu.kernels import native
from gpu.loading.config import ModelConfig
from gpu.runner.model_runner import ModelRunner
from tests.family_models import run_greedy
from tests.tiny_model import Request, block_pool

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels compiled, or interpreted (tests/conftest.py)
PROMPT_LENS, BUDGET, NEW_TOKENS = (5, 19, 30), 12, 6


def generate(model_dir, backend: str, budget: int = BUDGET) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Every request's tokens and the logits of every position fed, in order: three prompts (one chunked next to
    the others' decodes), then one on the first two cached blocks of the longest, then a recompute of the second."""
    runner = ModelRunner(
        ModelConfig.from_path(model_dir), DEVICE, torch.float32, num_blocks=64, num_threads=1, attention_backend=backend
    )
    assert all(layer.self_attn.attend is runner.attention for layer in runner.model.model.layers)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in PROMPT_LENS]
    pool = block_pool(num_blocks=64)
    reqs = [Request(pool, slot, p, 16) for slot, p in enumerate(prompts)]
    logits = run_greedy(runner, reqs, NEW_TOKENS, budget)
    hit = Request(pool, 0, reqs[2].tokens[:32] + prompts[0], 16)
    hit.blocks, hit.num_computed = reqs[2].blocks[:2], 32
    again = Request(pool, 0, reqs[1].tokens, 16)
    later = [run_greedy(runner, [r], 4, budget)[0] for r in (hit, again)]
    tokens = [r.tokens for r in (*reqs, hit, again)]
    return tokens, [torch.stack(x) for x in (*logits.values(), *later)]


NATIVE = pytest.mark.skipif(DEVICE != "cpu" or native.ops() is None, reason="the native kernels run on a CPU, built")


@pytest.mark.parametrize("family", ["gemma2", "llama"])
@pytest.mark.parametrize(  # (native, budget 40: the 30-token prompt whole on the torch path beside native decodes)
    ("backend", "budget"),
    [("triton", BUDGET), pytest.param("native", BUDGET, marks=NATIVE), pytest.param("native", 40, marks=NATIVE)],
)
def test_a_backend_gives_the_torch_backends_tokens_and_logits(family, backend, budget, family_dir_of):
    model_dir = family_dir_of(family)
    torch_tokens, torch_logits = generate(model_dir, "torch", budget)
    tokens, logits = generate(model_dir, backend, budget)
    assert tokens == torch_tokens
    for ours, reference in zip(logits, torch_logits, strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)


def test_default_backend_per_device_and_by_name(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    built = native.ops() is not None
    assert type(choose_attention_backend(None, cpu, torch.float32, 16)) is (
        NativeAttention if built else TorchAttention
    )
    assert type(choose_attention_backend(None, cpu, torch.bfloat16, 16)) is TorchAttention
    assert type(choose_attention_backend("torch", cpu, torch.float32, 16)) is TorchAttention
    for refused in (("native", cuda, torch.float32), ("native", cpu, torch.bfloat16)):
        with pytest.raises(ValueError, match="native attention backend runs float32 on a CPU"):
            choose_attention_backend(*refused, 16)
    with pytest.raises(ValueError, match="batch-invariant mode runs on a CPU with the native attention backend"):
        choose_attention_backend("torch", cpu, torch.float32, 16, invariant=True)
    for unheld in ((32, 1, 64), (8, 8, 288)):  # (32 query heads a KV head; a head dim past the kernel's 256)
        assert type(choose_attention_backend(None, cpu, torch.float32, 16, heads=unheld)) is TorchAttention
        with pytest.raises(ValueError, match="up to 16 query heads a KV head and head dims up to 256"):
            choose_attention_backend("native", cpu, torch.float32, 16, heads=unheld)
    assert isinstance(choose_attention_backend(None, cuda, torch.bfloat16, 16), TritonAttention)
    assert isinstance(choose_attention_backend("torch", cuda, torch.bfloat16, 16), TorchAttention)
    with pytest.raises(ValueError, match="flash"):
        choose_attention_backend("flash", cpu, torch.float32, 16)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # triton is imported here already: too late to set it
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        choose_attention_backend("triton", cpu, torch.float32, 16)


@pytest.mark.parametrize(
    ("flag", "backend"),
    [([], None), (["--attention-backend", "triton"], "triton"), (["--attention-backend", "native"], "native")],
)
def test_cli_flag_reaches_theengine_config(flag, backend):
    args = build_parser().parse_args(["serve", "m", *flag])
    assert engine_config(args, "m").attention_backend == backend


def test_choosing_the_torch_backend_imports_no_triton():
    """Triton is imported once the triton backend is chosen, not before (torch may import it later, at model load:
    its meta-device init goes through torch._dynamo)."""
    code = (
        "import sys, torch; from gpu.attention.backend import choose_attention_backend;"
        "choose_attention_backend(None, torch.device('cpu'), torch.float32, 16); print('triton' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

"""A load holds every weight once (gpu/loading/weights.py, gpu/loading/mapped.py): a 130 MB bfloat16 Llama written by
HF transformers, loaded in a fresh process (its resident memory alone), grows that process's resident memory by the
weights' bytes as they are served (each format's own bytes, summed here from the checkpoint's shapes, not by the
code's estimate) and no more than 1.05x plus 16 MiB, and its peak while loading by at most 1.1x that growth plus
16 MiB: no whole-model float32 phase, no second layout, no mapped file left resident. The power check: the same
measurement of a load that also keeps the checkpoint read through safetensors' `safe_open` (its mapping and tensors
held, as a loader keeping its handles open would) breaks the bound.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers

from gpu.kernels import native
from tests.tiny_model import save_with_tokenizer

MIB = 1 << 20
SHAPE = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=32000)  # fmt: skip
PROBE = """
import json, sys, torch
from pathlib import Path
from gpu.loading.config import ModelConfig
from gpu.loading.weights import load_model
import gpu.kernels.native as native

def status(field):
    return int(open("/proc/self/status").read().split(field + ":")[1].split()[0]) * 1024

path, weights, keep = Path(sys.argv[1]), getattr(torch, sys.argv[2]), sys.argv[3] == "keep"
config = ModelConfig.from_path(path)
native.ops()  # (the library's own pages: before the baseline)
before = status("VmRSS")
model = load_model(config, torch.device("cpu"), torch.float32, weight_dtype=weights)
if keep:  # (the power check: the file read through safe_open, its handle and tensors kept)
    from safetensors import safe_open
    handle = safe_open(str(path / "model.safetensors"), framework="pt")
    kept = [handle.get_tensor(name) for name in handle.keys()]
    sum(float(t.float().sum()) for t in kept)  # (read: the pages resident, as a load's copy reads them)
print(json.dumps({"grown": status("VmRSS") - before, "peak": status("VmHWM") - before}))
"""


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    config = transformers.LlamaConfig(**SHAPE, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    return save_with_tokenizer(model, tmp_path_factory.mktemp("bf16-llama"))


def served_bytes(weights: torch.dtype) -> int:
    """The weights' bytes: the linear layers' and the embedding table in `weights`, the norms in float32."""
    h, i, n, heads, kv, v = (SHAPE[k] for k in SHAPE)
    d = h // heads
    linear = n * (h * (heads + 2 * kv) * d + heads * d * h + 3 * h * i) + v * h  # (the LM head's too)
    return (linear + v * h) * weights.itemsize + (2 * n + 1) * h * 4


def probe(path, weights: str, keep: bool = False) -> dict[str, int]:
    args = [sys.executable, "-c", PROBE, str(path), weights, "keep" if keep else "map"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(native.ops() is None, reason="no native CPU kernels built (make setup builds them)")
@pytest.mark.parametrize("weights", ["bfloat16", "float32"])
def test_a_load_grows_by_the_served_weights_alone(bf16_llama, weights):
    served = served_bytes(getattr(torch, weights))
    held = probe(bf16_llama, weights)
    assert 0.95 * served <= held["grown"] <= 1.05 * served + 16 * MIB, (held, served)
    assert held["peak"] <= 1.1 * held["grown"] + 16 * MIB, (held, served)


@pytest.mark.skipif(native.ops() is None, reason="no native CPU kernels built (make setup builds them)")
def test_the_power_check_a_load_that_keeps_the_file_breaks_the_bound(bf16_llama):
    served = served_bytes(torch.bfloat16)
    assert probe(bf16_llama, "bfloat16", keep=True)["grown"] > 1.05 * served + 16 * MIB

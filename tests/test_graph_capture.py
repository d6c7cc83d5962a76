"""What a CUDA graph of a step records never waits on the host, checked on CPU before a card sees it.

StepGraphs.capture (gpu/runner/graphs.py) records each graph's forward from primed buffers. On a card, a host sync in
it (tests/host_syncs.py: an item, a nonzero, boolean indexing, a tolist, ...) fails the capture ("operation not
permitted when stream is capturing") and the server does not start. HostSyncs records them on any device:
- every dense family's forward, at the smallest and largest graph of each family (decode, mixed), on the triton
  backend (interpreted here) in bfloat16, makes none; nor does a Llama with LoRA tables on the Triton pair as CUDA
  runners hold them (every targetable layer's slots reserved, the tokens' slots read from the graphs' buffer);
- the MoE forward, whose expert routing reads its counts back (why graph_mode keeps MoE models eager), makes some:
  the detector sees them; and it sees each kind of read that dispatches nothing on CPU.
"""

from __future__ import annotations

import pytest
import torch

from gpu.kernels.triton import lora as triton_lora
from gpu.loading.config import ModelConfig
from gpu.loading.lora import targetable
from gpu.runner.model_runner import ModelRunner
from tests.host_syncs import HostSyncs

DENSE = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"]


def recorded_syncs(model_dir, lora_slots: int = 0) -> dict:
    """key -> the host syncs of what capture would record for it: the smallest and largest graph of each family."""
    runner = ModelRunner(
        ModelConfig.from_path(model_dir).served(128), "cpu", torch.bfloat16, num_blocks=16, max_num_seqs=8,
        max_num_batched_tokens=32, num_threads=1, attention_backend="triton", decode_graphs="eager",
        lora_slots=lora_slots, max_lora_rank=8,
    )  # fmt: skip
    if lora_slots:  # (as a CUDA runner holds them: gpu/runner/model_runner.py, adapters.py lora_kernels)
        runner.lora.ops = triton_lora
        assert runner.lora.reserve(runner.model, targetable(runner.model))
    graphs, found = runner.graphs, {}
    graphs.prime()
    for mixed in (False, True):
        for size in (graphs.sizes[mixed][0], graphs.sizes[mixed][-1]):
            key = (mixed, size)
            with torch.inference_mode(), HostSyncs() as syncs:
                graphs.lora_in_place(size)
                graphs.forward(size, graphs.metadata(key))
            found[key] = syncs.seen
    return found


@pytest.mark.parametrize("family", [*DENSE, "llama+lora"])
def test_what_a_graph_records_never_syncs_with_the_host(family, family_dir_of):
    found = recorded_syncs(family_dir_of(family.removesuffix("+lora")), 2 if family.endswith("+lora") else 0)
    assert len(found) == 4 and not any(found.values()), found


def test_the_detector_sees_moe_routing_read_its_counts_back(family_dir_of):
    assert all(recorded_syncs(family_dir_of("mixtral")).values())


def test_the_detector_sees_reads_that_do_not_dispatch_on_cpu():
    x = torch.arange(4)
    with HostSyncs() as syncs:
        x.tolist(), x.numpy(), x.cpu(), x.to("cpu"), x.to(torch.float32), bool(x[1]), x[x > 1]
        x * torch.tensor(2), x + torch.tensor([1, 2, 3, 4])  # (a 0-dim tensor is a scalar: no upload)
        x.repeat_interleave(x), x.repeat_interleave(x, output_size=6)  # (sized by the caller: no read)
        x[x > 2] = 0
    reads = [f"Tensor.{m}" for m in ("tolist", "numpy", "cpu", "to")]  # (not the cast: `to` a dtype stays put)
    ops = ["_local_scalar_dense.default", "index.Tensor", "lift_fresh.default", "repeat_interleave.Tensor"]
    assert syncs.seen == [*reads, *(f"aten.{op}" for op in ops), "aten.index_put_.default"]
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist  # (the methods restored on exit)

"""Steps on static buffers (gpu/runner/graphs.py), checked on CPU where no graph is captured: the same buffers and
padding run eagerly and give the dynamic path's tokens and logits, and write no KV outside the scratch block:
- decode steps (served to 600 tokens: the triton backend's decode steps split keys into 3 partitions) as rows come
  and go (a smaller step after a larger one leaves stale entries in the buffers: the padding must cover them);
- mixed steps of every kind: chunked prefills beside decodes, a row verifying drafts, prompt logprobs, a row
  leaving mid-stream (an abort), a row preempted and recomputed; a deliberately wrong pad (pad rows writing a
  real block) fails the same comparison.
Also: the capture sizes, which steps run static, the mode per device and backend, `--enforce-eager`.
On CUDA (marked): replay equals the eager dynamic path, and a captured step never syncs with the host."""

from __future__ import annotations

import msgspec
import pytest
import torch

from frontend.cli import build_parser
from frontend.cli_engine import engine_config
from gpu.attention.torch_backend import TorchAttention
from gpu.batch import BatchSpec, ScheduledRow
from gpu.loading.config import ModelConfig
from gpu.loading.convert import default_model_dir
from gpu.runner.graphs import StepGraphs, capture_sizes, mixed_sizes
from gpu.runner.model_runner import ModelRunner, graph_mode
from tests.tiny_model import Request, block_pool

NUM_BLOCKS = 48
PROMPT_LENS, DECODES = (5, 19, 33, 8, 12), (5, 2, 6, 4, 1)  # rows leave after their decodes: 5, 4, 3, ... rows


def decode_run(model_dir, device, dtype, backend: str, mode: str):
    """Prefill each prompt alone, then decode all rows together, each leaving after its DECODES[i] tokens: the
    tokens, every decode step's logits, the runner."""
    runner = ModelRunner(
        ModelConfig.from_path(model_dir).served(600), device, dtype, num_blocks=NUM_BLOCKS, max_num_seqs=8,
        num_threads=1, attention_backend=backend, decode_graphs=mode,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    pool = block_pool(num_blocks=NUM_BLOCKS)
    reqs = [
        Request(pool, i, torch.randint(3, 49152, (n,), generator=g).tolist(), 16) for i, n in enumerate(PROMPT_LENS)
    ]
    for r in reqs:
        r.tokens.append(int(runner.execute(BatchSpec(r.slot, [r.row()]))[0].argmax()))
    steps = []
    for step in range(max(DECODES)):
        live = [r for r, n in zip(reqs, DECODES, strict=True) if n > step]
        logits = runner.execute(BatchSpec(100 + step, [r.row() for r in live]))
        steps.append(logits)  # (kept on the device: a later replay must not overwrite a step's logits)
        for r, row_logits in zip(live, logits, strict=True):
            r.tokens.append(int(row_logits.argmax()))
    return [r.tokens for r in reqs], steps, runner


@pytest.mark.parametrize(
    ("model", "backend"),
    [("tiny", "torch"), ("tiny", "triton"), ("smollm2", "torch")],
    ids=["tiny", "triton", "smollm2"],
)
def test_static_buffers_give_the_dynamic_paths_tokens(model, backend, tiny_model_dir):
    model_dir = tiny_model_dir if model == "tiny" else default_model_dir()
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"  # (compiled kernels on a GPU)
    tokens, logits, dynamic = decode_run(model_dir, device, torch.float32, backend, "off")
    static_tokens, static_logits, static = decode_run(model_dir, device, torch.float32, backend, "eager")
    assert static_tokens == tokens
    assert same_steps(static_logits, logits, static, dynamic) and scratch_written(static)


def same_steps(ours: list, reference: list, static: ModelRunner, dynamic: ModelRunner) -> bool:
    """Whether every step's logits and the KV cache (but its scratch block, which the pad rows did write) agree."""
    assert static.kv_cache.num_blocks == NUM_BLOCKS + 1 and dynamic.kv_cache.num_blocks == NUM_BLOCKS
    close = lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-4)  # noqa: E731
    same = all(close(a, b) for a, b in zip(ours, reference, strict=True))
    for (k, v), (k_ref, v_ref) in zip(static.kv_cache.layers, dynamic.kv_cache.layers, strict=True):
        same = same and close(k[:NUM_BLOCKS], k_ref) and close(v[:NUM_BLOCKS], v_ref)
    return same


def scratch_written(static: ModelRunner) -> bool:
    return all(k[NUM_BLOCKS].abs().sum() > 0 for k, _ in static.kv_cache.layers)


def mixed_run(model_dir, backend: str, mode: str, device: str = "cpu"):
    """Steps of every kind on one runner (module docstring); every step's logits and the runner. Rows sample their
    argmax; drafts are always accepted (the KV fed for them stays)."""
    runner = ModelRunner(
        ModelConfig.from_path(model_dir).served(256), device, torch.float32, num_blocks=NUM_BLOCKS, max_num_seqs=8,
        max_num_batched_tokens=64, num_threads=1, attention_backend=backend, decode_graphs=mode,
    )  # fmt: skip
    g = torch.Generator().manual_seed(2)
    pool = block_pool(num_blocks=NUM_BLOCKS)
    r0, r1, r2, r3 = (
        Request(pool, i, torch.randint(3, 49152, (n,), generator=g).tolist(), 16) for i, n in enumerate((40, 9, 23, 14))
    )
    logits = []

    def step(*rows: ScheduledRow) -> None:
        batch = BatchSpec(len(logits), list(rows))
        assert mode == "off" or runner.graphs.key_for(batch) is not None  # (every step here runs static)
        out = runner.execute(batch)
        logits.append(out)
        pos = 0
        for row, req in ((row, {r.slot: r for r in (r0, r1, r2, r3)}[row.slot]) for row in rows):
            pos += row.num_logits
            if row.sample:
                req.tokens.append(int(out[pos - 1].argmax()))

    def drafts(req: Request, k: int) -> ScheduledRow:
        req.tokens += torch.randint(3, 49152, (k,), generator=g).tolist()
        return msgspec.structs.replace(req.row(), draft_token_ids=req.tokens[-k:])

    def targets(row: ScheduledRow) -> ScheduledRow:  # prompt logprobs: the next prompt token of each fed one
        return msgspec.structs.replace(row, prompt_targets=[7] * (len(row.token_ids) - 1))

    step(r0.row(16), targets(r1.row()))  # a prefill chunk beside a whole prompt with prompt logprobs
    step(r0.row(16), r1.row(), r2.row())  # another chunk, a decode, a prompt
    step(r0.row(), drafts(r1, 2), r2.row())  # the last chunk, a row verifying two drafts, a decode
    step(r0.row(), drafts(r1, 3), r3.row())  # r2 aborted: it leaves, its blocks unused; r3 arrives
    pool.extend(r1.blocks)  # r1 preempted: its blocks go back and its tokens are recomputed from the first
    r1.blocks, r1.num_computed = [], 0
    step(r0.row(), r1.row(), r3.row())
    for _ in range(3):
        step(r0.row(), r1.row(), r3.row())  # decodes
    return logits, runner


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_static_buffers_give_every_step_kinds_dynamic_results(backend, tiny_model_dir):
    logits, dynamic = mixed_run(tiny_model_dir, backend, "off")
    static_logits, static = mixed_run(tiny_model_dir, backend, "eager")
    assert same_steps(static_logits, logits, static, dynamic) and scratch_written(static)


def test_a_wrong_pad_fails_the_comparison(tiny_model_dir, monkeypatch):
    logits, dynamic = mixed_run(tiny_model_dir, "torch", "off")
    pad = StepGraphs.pad

    def into_a_real_block(self, batch, size):  # pad rows write block 0, which a request holds
        padded = pad(self, batch, size)
        rows = [msgspec.structs.replace(r, block_table=[0]) if r.request_id == "<pad>" else r for r in padded.rows]
        return BatchSpec(padded.step, rows)

    monkeypatch.setattr(StepGraphs, "pad", into_a_real_block)
    static_logits, static = mixed_run(tiny_model_dir, "torch", "eager")
    assert not same_steps(static_logits, logits, static, dynamic)


def test_capture_sizes():
    assert mixed_sizes(512) == [8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 120, 144, 176, 216, 264, 328, 408, 512]
    assert mixed_sizes(100)[-2:] == [80, 100] and mixed_sizes(5) == [5]
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, *range(8, 65, 8)]


def test_which_steps_run_static(tiny_model_dir):
    runner = ModelRunner(
        ModelConfig.from_path(tiny_model_dir).served(64), "cpu", torch.float32, num_blocks=16, max_num_seqs=8,
        decode_graphs="eager",
    )  # fmt: skip
    graphs = runner.graphs

    def row(tokens=1, **kw):
        return ScheduledRow("r", 0, [7] * tokens, 3, [0, 1], True, **kw)

    assert graphs.key_for(BatchSpec(0, [row()] * 3)) == (False, 4)
    assert graphs.key_for(BatchSpec(0, [row()] * 8)) == (False, 8)
    assert graphs.key_for(BatchSpec(0, [row(), row(tokens=4)])) == (True, 8)  # a prefill chunk: mixed
    assert graphs.key_for(BatchSpec(0, [row(tokens=3, draft_token_ids=[5, 6])])) == (True, 8)  # verification
    assert graphs.key_for(BatchSpec(0, [row(prompt_targets=[9])])) == (True, 8)  # prompt logprobs
    assert graphs.key_for(BatchSpec(0, [row(tokens=20), row(tokens=20)])) == (True, 40)
    assert graphs.key_for(BatchSpec(0, [row(tokens=600)])) is None  # above the largest mixed size
    assert graphs.key_for(BatchSpec(0, [ScheduledRow("r", 0, [7], 3, list(range(5)), True)])) is None  # too wide
    padded = graphs.pad(BatchSpec(0, [row()] * 3), 4)
    assert padded.rows[3].block_table == [16] and padded.rows[3].token_ids == [0]  # the scratch block, past 0..15
    padded = graphs.pad(BatchSpec(0, [row(), row(tokens=4)]), 8)  # 5 tokens: 3 pad rows, 3 empty ones
    assert [len(r.token_ids) for r in padded.rows] == [1, 4, 1, 1, 1, 0, 0, 0]
    assert not any(r.sample for r in padded.rows[2:])


def test_graph_mode_per_device_and_backend():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    torch_backend = TorchAttention(cpu, torch.float32, 16)
    assert graph_mode(None, cpu, torch_backend) == "off"
    assert graph_mode(None, cuda, torch_backend) == "off"  # host-side segment plans: not capturable
    assert graph_mode(None, cuda, object()) == "capture"
    assert graph_mode(None, cuda, object(), moe=True) == "off"  # expert routing reads counts back: not capturable
    assert graph_mode("eager", cpu, torch_backend) == "eager"
    with pytest.raises(ValueError, match="CUDA graphs need"):
        graph_mode("capture", cpu, torch_backend)


@pytest.mark.parametrize(("flag", "mode"), [([], None), (["--enforce-eager"], "off")])
def test_enforce_eager_flag(flag, mode):
    config = engine_config(build_parser().parse_args(["serve", "m", *flag]), "m")
    assert config.enforce_eager == bool(flag) and config.decode_graphs() == mode


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_replay_equals_eager_and_never_syncs(tiny_model_dir, monkeypatch):
    tokens, logits, _ = decode_run(tiny_model_dir, "cuda", torch.float32, "triton", "off")
    execute = ModelRunner.execute

    def no_sync(self, batch):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return execute(self, batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(ModelRunner, "execute", no_sync)  # a sync inside any step raises
    graph_tokens, graph_logits, runner = decode_run(tiny_model_dir, "cuda", torch.float32, "triton", "capture")
    assert graph_tokens == tokens and len(runner.graphs.graphs) == len(runner.graphs.keys)
    for ours, reference in zip(graph_logits, logits, strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mixed_graph_replay_equals_the_dynamic_path(tiny_model_dir):
    logits, dynamic = mixed_run(tiny_model_dir, "triton", "off", "cuda")
    graph_logits, captured = mixed_run(tiny_model_dir, "triton", "capture", "cuda")
    assert any(key[0] for key in captured.graphs.graphs)  # (mixed graphs were captured)
    assert same_steps(graph_logits, logits, captured, dynamic) and scratch_written(captured)

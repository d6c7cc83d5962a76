"""Decode steps on persistent buffers, replayed as CUDA graphs (vLLM's approach).

A decode step (every row feeds one token and samples at it: no chunk, no drafts, no prompt targets) of n rows is
padded with pad rows to the smallest capture size B >= n (`capture_sizes`: 1, 2, 4, 8, then steps of 8 up to
max_num_seqs). A pad row feeds token 0 at position 0 into the scratch block, the KV cache's last block, which the
scheduler never hands out (the runner allocates it beyond the scheduler's blocks): its one slot takes the pad rows'
keys and values, and their attention reads only it, and its LoRA slot is -1 (no adapter; a runner's LoRA kernels read
the rows' slots from a buffer too). The step's arrays are uploaded as any step's, then copied into
persistent buffers (token ids, positions, slot mapping, sequence lengths, query starts, block tables) that the
forward reads at fixed addresses. The graph ends at the final norm's hidden states (a buffer of the graph's pool);
the LM head runs eagerly on the first n rows, so the logits returned are the step's own tensor, pad rows cost no
vocabulary-wide work, and no size keeps a logits buffer.

Modes (ModelRunner's `decode_graphs`): "capture" records the forward for every size at startup, largest first in one
memory pool, with a progress bar, and replays the graph of the step's size (CUDA with the triton backend: the torch
backend's host-side segment plans change shape from step to step); "eager" runs the same buffers and padding without
graphs (CPU: how the tests check padding and buffer reuse; debugging on CUDA); "off" is the dynamic path
(`--enforce-eager`, or no graphs to be had: CPU, the torch backend, an MoE model, whose expert routing reads counts back
to the host). Attention in a decode step, static or not, is planned for the longest servable row (max_seq_len =
max_model_len, gpu/runner/model_runner.py: the triton kernel's split-K layout is the same in a graph and out of one, and
never depends on the batch; empty partitions weigh nothing). Mixed, prefill and speculative steps and those above the
largest size run dynamically. The sampler runs after the graph, eagerly: its row sets change with each step's
parameters.
"""

from __future__ import annotations

from typing import Literal

import torch
from tqdm import tqdm

from gpu.attention.metadata import AttentionMetadata
from gpu.batch import BatchSpec, ScheduledRow
from gpu.runner.view import RunnerView

GraphMode = Literal["capture", "eager", "off"]
BUFFERS = ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc", "block_tables")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including max_num_seqs."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    return sizes if sizes and sizes[-1] == max_num_seqs else [*sizes, max_num_seqs]


def is_decode_step(batch: BatchSpec) -> bool:
    return bool(batch.rows) and all(
        len(r.token_ids) == 1 and r.num_logits == 1 and not r.prompt_targets for r in batch.rows
    )


class DecodeGraphs:
    def __init__(self, runner: RunnerView, capture: bool) -> None:
        self.runner = runner
        self.sizes = capture_sizes(min(runner.max_num_seqs, runner.max_num_batched_tokens))
        self.scratch_block = runner.kv_cache.num_blocks - 1
        self.max_seq_len = runner.config.max_model_len
        n = self.sizes[-1]
        self.width = width = -(-self.max_seq_len // runner.block_size)  # block table entries of the longest row
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.int64, device=runner.device)  # noqa: E731
        self.buffers = {name: zeros(n) for name in BUFFERS[:4]}
        self.buffers["query_start_loc"], self.buffers["block_tables"] = zeros(n + 1), zeros(n, width)
        self.buffers["lora_slots"] = zeros(n) - 1  # each row's LoRA slot (-1: the base model; pad rows)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # size -> (graph, its hidden states)
        if capture:
            self.capture()

    def size_for(self, batch: BatchSpec) -> int | None:
        """The capture size a step runs at, or None: not a decode step, or too many rows."""
        n = len(batch.rows)
        if n > self.sizes[-1] or not is_decode_step(batch) or max(len(r.block_table) for r in batch.rows) > self.width:
            return None
        return next(s for s in self.sizes if s >= n)

    def pad(self, batch: BatchSpec, size: int) -> BatchSpec:
        pad = ScheduledRow("<pad>", 0, [0], 0, [self.scratch_block], True)
        return BatchSpec(batch.step, [*batch.rows, *[pad] * (size - len(batch.rows))])

    def metadata(self, size: int) -> AttentionMetadata:
        b = self.buffers
        return AttentionMetadata(
            slot_mapping=b["slot_mapping"][:size],
            query_start_loc=b["query_start_loc"][: size + 1],
            seq_lens=b["seq_lens"][:size],
            block_tables=b["block_tables"][:size],
            max_query_len=1,
            max_seq_len=self.max_seq_len,
        )

    def lora_in_place(self, size: int) -> None:
        """A runner with LoRA tables on a device kernel reads the rows' slots from the buffer (a graph holds the
        kernels' calls whatever the step's adapters; the torch path's groups stay the step's own)."""
        lora = self.runner.lora
        if lora.layers and lora.ops is not None:
            lora.tokens = self.buffers["lora_slots"][:size]

    def forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        b = self.buffers
        return self.runner.model(b["input_ids"][:size], b["positions"][:size], meta, self.runner.kv_cache)

    def run(
        self, size: int, step: dict[str, torch.Tensor], plans: list, uploaded: list, rows: int
    ) -> torch.Tensor | None:
        """The logits [rows, vocab] of the padded step's first `rows`: its arrays copied into the buffers, the graph
        replayed (or the forward run on the buffers), the LM head run on those rows' hidden states."""
        b = self.buffers
        for name in BUFFERS[:5]:
            b[name][: step[name].shape[0]].copy_(step[name])
        b["block_tables"][:size, : step["block_tables"].shape[1]].copy_(step["block_tables"])
        if "lora_slots" in step:
            b["lora_slots"][:size].copy_(step["lora_slots"])
        elif self.runner.lora.layers:  # (a step of the base model's rows alone)
            b["lora_slots"].fill_(-1)
        self.lora_in_place(size)
        if size in self.graphs:
            graph, hidden = self.graphs[size]
            graph.replay()
        else:
            meta = self.metadata(size)
            self.runner.attention.finish(meta, plans, uploaded)
            hidden = self.forward(size, meta)
        return self.runner.logits(hidden[:rows])

    @torch.inference_mode()
    def capture(self) -> None:
        """Record every size's forward, largest first, the smaller ones reusing its memory pool. The buffers hold
        pad rows only (every row writes the scratch slot); each size runs once eagerly first (Triton compiles, the
        allocator warms up)."""
        b, pool = self.buffers, None
        b["slot_mapping"].fill_(self.scratch_block * self.runner.block_size)
        b["seq_lens"].fill_(1)
        torch.arange(len(b["query_start_loc"]), out=b["query_start_loc"])
        b["block_tables"][:, 0] = self.scratch_block
        for size in tqdm(self.sizes[::-1], desc="Capturing CUDA graphs", unit="graph"):
            meta = self.metadata(size)
            self.lora_in_place(size)
            self.forward(size, meta)
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.forward(size, meta)
            pool = graph.pool()
            self.graphs[size] = (graph, hidden)

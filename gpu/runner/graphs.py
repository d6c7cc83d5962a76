"""Steps on persistent buffers, replayed as CUDA graphs (vLLM's approach): every step kind up to a token budget.

Two families of graphs, each padded to a token count T (its size), with T rows:
- decode (every row feeds one token and samples at it: no chunk, no drafts, no prompt targets) at `capture_sizes`
  (1, 2, 4, 8, then steps of 8 up to max_num_seqs); attention planned split-K for the longest servable row
  (max_seq_len = max_model_len: the triton kernel's split layout is the same in a graph and out of one, and never
  depends on the batch; empty partitions weigh nothing);
- mixed (any other step: prefill chunks beside decodes, verification rows of 1 + K tokens, prompt logprobs, CFG
  companions) at `mixed_sizes` (8, 16, 24, 32, then about 1.25x apart up to MAX_MIXED tokens and the step budget);
  attention in one pass, as the dynamic path runs a mixed step.
Padding (`pad`): a step of n rows and t tokens padded to T gets T - t pad rows, each feeding token 0 at position 0
into the scratch block (the KV cache's last block, which the scheduler never hands out: the runner allocates it
beyond the scheduler's blocks), whose attention reads only that slot, and t - n empty rows (no token, no key: the
attention kernel returns at once for them), T rows in all; none samples. A row's LoRA slot is read from a buffer too
(-1 for the pad rows: the base model). The step's arrays are uploaded as any step's, then copied into the
persistent buffers (token ids, positions, slot mapping, sequence lengths, query starts, block tables) that the
forward reads at fixed addresses. A graph ends at the final norm's hidden states (a buffer of the graph pool); the
LM head runs eagerly on the step's logit positions, so the logits returned are the step's own tensor and pad rows
cost no vocabulary-wide work.

Why padded whole-step graphs rather than piecewise ones (vLLM v1's FULL_AND_PIECEWISE, attention run eagerly between
captured dense parts): the triton attention kernel reads a step's whole shape from device buffers and its grid
depends only on (tokens, rows, splits), so one graph per budget holds the entire forward, with no eager attention
launches between pieces. The price is the pad tokens' dense work, at most ~25% of a budget above 32 tokens, in steps
whose few hundred tokens are launch-bound on a GPU; above MAX_MIXED tokens a step runs eagerly, its compute then
outweighing its launches. (scripts/gpu_check.py measures serving with graphs against --enforce-eager.)

Modes (ModelRunner's `decode_graphs`): "capture" records every graph at startup, largest first in one memory pool,
with a progress bar, and replays the step's (CUDA with the triton backend: the torch backend's host-side segment
plans change shape from step to step); "eager" runs the same buffers and padding without graphs (CPU: how the tests
check padding and buffer reuse; debugging on CUDA); "off" is the dynamic path (`--enforce-eager`, or no graphs to be
had: CPU, the torch backend, an MoE model, whose expert routing reads counts back to the host). The sampler runs
after the graph, eagerly: the fused sampler's few launches (gpu/sampling/fused_triton.py).
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
MAX_MIXED = 512  # the largest mixed step (tokens) replayed as a graph
Key = tuple[bool, int]  # (mixed, size)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including max_num_seqs."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    return sizes if sizes and sizes[-1] == max_num_seqs else [*sizes, max_num_seqs]


def mixed_sizes(max_tokens: int) -> list[int]:
    """8, 16, 24, 32, then each about 1.25x the one before (a multiple of 8), up to and including max_tokens (the
    size before it left out where within 1.125x of it)."""
    sizes = [min(8, max_tokens)]
    while sizes[-1] < max_tokens:
        sizes.append(min(max_tokens, max(sizes[-1] + 8, sizes[-1] * 5 // 4 // 8 * 8)))
    if len(sizes) > 2 and sizes[-1] * 8 < sizes[-2] * 9:
        del sizes[-2]
    return sizes


def is_decode_step(batch: BatchSpec) -> bool:
    return bool(batch.rows) and all(
        len(r.token_ids) == 1 and r.num_logits == 1 and not r.prompt_targets for r in batch.rows
    )


class StepGraphs:
    def __init__(self, runner: RunnerView, capture: bool) -> None:
        self.runner = runner
        budget = runner.max_num_batched_tokens
        self.sizes = {False: capture_sizes(min(runner.max_num_seqs, budget)), True: mixed_sizes(min(MAX_MIXED, budget))}
        self.scratch_block = runner.kv_cache.num_blocks - 1
        self.max_seq_len = runner.config.max_model_len
        n = max(self.sizes[False][-1], self.sizes[True][-1])
        self.width = width = -(-self.max_seq_len // runner.block_size)  # block table entries of the longest row
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.int64, device=runner.device)  # noqa: E731
        self.buffers = {name: zeros(n) for name in BUFFERS[:4]}
        self.buffers["query_start_loc"], self.buffers["block_tables"] = zeros(n + 1), zeros(n, width)
        self.buffers["lora_slots"] = zeros(n) - 1  # each token's LoRA slot (-1: the base model; pad rows)
        self.graphs: dict[Key, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # key -> (graph, its hidden states)
        if capture:
            self.capture()

    @property
    def keys(self) -> list[Key]:
        """Every graph's key, largest first."""
        return sorted(((m, s) for m, sizes in self.sizes.items() for s in sizes), key=lambda k: -k[1])

    def key_for(self, batch: BatchSpec) -> Key | None:
        """The graph a step runs as, or None: too many tokens (or rows), or a block table wider than the longest
        servable row's."""
        if not batch.rows or max(r.blocks_from + len(r.block_table) for r in batch.rows) > self.width:
            return None
        mixed = not is_decode_step(batch)
        n = batch.num_tokens if mixed else len(batch.rows)
        return next(((mixed, s) for s in self.sizes[mixed] if s >= n), None)

    def pad(self, batch: BatchSpec, size: int) -> BatchSpec:
        """The step padded to `size` tokens and rows (module docstring)."""
        pad = ScheduledRow("<pad>", -1, [0], 0, [self.scratch_block], False)  # (slot -1: no slot's table kept)
        empty = ScheduledRow("<empty>", -1, [], 0, [], False)
        tokens = batch.num_tokens
        return BatchSpec(batch.step, [*batch.rows, *[pad] * (size - tokens), *[empty] * (tokens - len(batch.rows))])

    def metadata(self, key: Key) -> AttentionMetadata:
        b, (mixed, size) = self.buffers, key
        return AttentionMetadata(
            slot_mapping=b["slot_mapping"][:size],
            query_start_loc=b["query_start_loc"][: size + 1],
            seq_lens=b["seq_lens"][:size],
            block_tables=b["block_tables"][:size],
            max_query_len=size if mixed else 1,  # (mixed: any row's queries, so one pass)
            max_seq_len=self.max_seq_len,
        )

    def lora_in_place(self, size: int) -> None:
        """A runner with LoRA tables on a device kernel reads the tokens' slots from the buffer (a graph holds the
        kernels' calls whatever the step's adapters; the torch path's groups stay the step's own)."""
        lora = self.runner.lora
        if lora.layers and lora.ops is not None:
            lora.tokens = self.buffers["lora_slots"][:size]

    def forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        b = self.buffers
        return self.runner.model(b["input_ids"][:size], b["positions"][:size], meta, self.runner.kv_cache)

    def run(self, key: Key, step: dict[str, torch.Tensor], plans: list, uploaded: list) -> torch.Tensor | None:
        """The logits of the padded step's logit positions: its arrays copied into the buffers, the graph replayed
        (or the forward run on the buffers), the LM head run on those positions' hidden states."""
        b, size = self.buffers, key[1]
        for name in BUFFERS[:5]:
            b[name][: step[name].shape[0]].copy_(step[name])
        b["block_tables"][:size, : step["block_tables"].shape[1]].copy_(step["block_tables"])
        if "lora_slots" in step:
            b["lora_slots"][:size].copy_(step["lora_slots"])
        elif self.runner.lora.layers:  # (a step of the base model's rows alone)
            b["lora_slots"].fill_(-1)
        self.lora_in_place(size)
        if key in self.graphs:
            graph, hidden = self.graphs[key]
            graph.replay()
        else:
            meta = self.metadata(key)
            self.runner.attention.finish(meta, plans, uploaded)
            hidden = self.forward(size, meta)
        return self.runner.logits(hidden[step["logits_indices"]])

    def prime(self) -> None:
        """The buffers as a capture records from: pad rows only (every row writes the scratch slot)."""
        b = self.buffers
        b["slot_mapping"].fill_(self.scratch_block * self.runner.block_size)
        b["seq_lens"].fill_(1)
        torch.arange(len(b["query_start_loc"]), out=b["query_start_loc"])
        b["block_tables"][:, 0] = self.scratch_block

    @torch.inference_mode()
    def capture(self) -> None:
        """Record every graph, largest first, the smaller ones reusing its memory pool, from primed buffers; each
        graph runs once eagerly first (Triton compiles, the allocator warms up). tests/test_graph_capture.py runs
        what each records on CPU and finds no host sync in it."""
        pool = None
        self.prime()
        for key in tqdm(self.keys, desc="Capturing CUDA graphs", unit="graph"):
            meta = self.metadata(key)
            self.lora_in_place(key[1])
            self.forward(key[1], meta)
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.forward(key[1], meta)
            pool = graph.pool()
            self.graphs[key] = (graph, hidden)

"""A decoder served as an embedder (Qwen3-Embedding's recipe) or a yes/no reranker (Qwen3-Reranker's): its last
layer's hidden states over packed inputs, each input a causal prefill of its own in a scratch KV cache of one step's
size (no state is kept between steps: every step's rows start at block 0). Called as the encoders are
(gpu/models/bert.py): `model(ids, lens)`; `head` is None, or a reranker's two tokens (`classify`). A dense model runs
batch-invariant where the native kernels are built (every row on their linear and attention kernels: its states the
same bits in any batch, at some cost to long inputs' speed); an MoE model's rows depend on their batch.

Memory: the scratch cache holds one step, max_tokens / block_size + max_rows blocks (a row's last block is partly
used), of 2 x layers x kv heads x head_dim float32 each token: Qwen3-0.6B's 229 KiB a token, 0.7 GiB for 2,048 tokens
in 64 rows; its pages are touched only as far as the longest step has gone.
"""

from __future__ import annotations

import torch

from gpu.batch import BatchSpec, ScheduledRow
from gpu.kernels import native
from gpu.loading.config import ModelConfig
from gpu.runner.model_runner import ModelRunner


class CausalStates:
    def __init__(
        self,
        config: ModelConfig,
        max_tokens: int,
        max_rows: int,
        cpu_kernels: str | None = None,
        score_tokens: tuple[int, int] | None = None,
    ) -> None:
        """`score_tokens`: a yes/no reranker's ("no", "yes") token ids (`classify`)."""
        self.block_size, self.head = 16, score_tokens
        blocks = max_tokens // self.block_size + max_rows
        invariant = native.ops() is not None and cpu_kernels != "torch" and config.moe is None
        self.runner = ModelRunner(config, "cpu", "float32", num_blocks=blocks, block_size=self.block_size,
                                  max_num_seqs=max_rows, max_num_batched_tokens=max_tokens, cpu_kernels=cpu_kernels,
                                  batch_invariant=invariant, decode_graphs="off")  # fmt: skip

    def __call__(self, ids: torch.Tensor, lens: list[int], types: torch.Tensor | None = None) -> torch.Tensor:
        """The hidden states [len(ids), hidden] of the inputs packed in `ids` (their lengths `lens`)."""
        rows, flat, start, block = [], ids.tolist(), 0, 0
        for i, n in enumerate(lens):
            used = -(-n // self.block_size)
            rows.append(ScheduledRow(request_id=str(i), slot=i, token_ids=flat[start : start + n], num_computed=0,
                                     block_table=list(range(block, block + used)), sample=True))  # fmt: skip
            start, block = start + n, block + used
        return self.runner.execute(BatchSpec(step=0, rows=rows), states=True)

    def classify(self, hidden: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """A yes/no reranker's logit per input [len(lens), 1]: its last token's logit of "yes" less that of "no", so
        that its sigmoid is the softmax's P(yes) over the two (Qwen3-Reranker's score)."""
        no, yes = self.head
        logits = self.runner.logits(hidden[torch.tensor(lens).cumsum(0) - 1])
        return (logits[:, yes] - logits[:, no]).unsqueeze(1)

"""The contract between the scheduler (actors/engine) and the model runner (gpu/runner/model_runner.py).

The scheduler describes a step in plain Python; the runner turns it into device tensors
(`input_ids`, `positions`, `query_start_loc`, `seq_lens`, `slot_mapping`, `block_tables`,
`logits_indices`). Rows are in batch order; `slot` is a stable per-request index that survives
across steps (async scheduling keeps last step's sampled ids in a device buffer indexed by slot).
Both are msgspec Structs: a BatchSpec travels to the worker inside ExecuteStep (messages/step.py).
"""

from __future__ import annotations

import msgspec

PLACEHOLDER = -1  # an input token not yet known on the host: the runner takes it from the device


class ScheduledRow(msgspec.Struct, array_like=True):
    request_id: str
    slot: int
    token_ids: list[int]  # the tokens fed this step (PLACEHOLDER allowed only as the last one)
    num_computed: int  # tokens of this request already in the KV cache (first position)
    # the request's KV blocks from blocks_from on (all of them cover num_computed + len(token_ids))
    block_table: list[int]
    sample: bool  # False for a partial chunked-prefill row: its logits are not computed
    # prompt_logprobs: the prompt tokens that follow this row's first fed tokens, one per fed token whose logits
    # the runner also returns (after the sampling rows' logits)
    prompt_targets: list[int] = []
    # speculative decoding: the last len(draft_token_ids) fed tokens are drafts; the row samples at its last
    # 1 + len(draft_token_ids) positions (each draft is verified, then the bonus position)
    draft_token_ids: list[int] = []
    # classifier-free guidance: set on the unconditional companion row of a guided request, which follows its
    # parent's row and carries its id (the slot and block table are the companion's own); when both sample, the parent samples from
    # l_u + guidance_scale * (l_c - l_u) with this row's logits as l_u, and this row samples nothing itself
    guidance_scale: float | None = None
    # a sampling row: the output position of its first sampled token (pending ones counted), which keys a
    # seeded row's uniforms (DESIGN I8: reproducible at any position)
    output_position: int = 0
    lora: str | None = None  # the row's LoRA adapter (its digest: SamplingParams.lora), None: the base model's
    # block_table holds the sequence's blocks from this index on: the runner keeps those before as this slot's
    # earlier rows left them (gpu/runner/slot_tables.py; 0: the whole table)
    blocks_from: int = 0

    @property
    def num_samples(self) -> int:
        """Sampled positions (a companion row has none)."""
        return (1 + len(self.draft_token_ids)) if self.sample and self.guidance_scale is None else 0

    @property
    def num_logits(self) -> int:
        """Positions whose logits the runner returns: the sampled ones, and a sampling companion row's (its last
        1 + K: it is fed its parent's drafts too)."""
        return 1 + len(self.draft_token_ids) if self.sample and self.guidance_scale is not None else self.num_samples


class BatchSpec(msgspec.Struct, array_like=True):
    step: int
    rows: list[ScheduledRow] = []

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)

    @property
    def sampling_rows(self) -> list[int]:
        return [i for i, r in enumerate(self.rows) if r.num_samples]

    @property
    def relay_slots(self) -> list[int]:
        """The slots whose next input is a token sampled this step (the device relay): each sampling row's, then each
        sampling CFG companion's (its parent's token)."""
        companions = [r.slot for r in self.rows if r.guidance_scale is not None and r.sample]
        return [r.slot for r in self.rows if r.num_samples] + companions

    @property
    def num_samples(self) -> int:
        """Sampled positions: one per sampling row, 1 + K for a row verifying K drafts."""
        return sum(r.num_samples for r in self.rows)

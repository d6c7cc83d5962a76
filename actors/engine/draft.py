"""The draft-model proposer: a second, smaller model with the same vocabulary drafts K tokens per request.

It runs on the engine's device thread with a ModelRunner and paged KV cache of its own (its own block tables,
as many blocks as the target's; the memory budget holds both caches: executor.num_kv_blocks): per step, one forward over the tokens each request's draft KV lacks (the
prompt at first, then the one or two tokens since the last proposal), then K - 1 single-token forwards. Draft
token j is drawn from q_j, the draft's distribution processed with the request's own sampling parameters (the
section 5 pipeline, the earlier drafts in its output history), with a uniform keyed by (seed, output position,
stream 1) for a seeded request; q is kept for verification (gpu/sampling/spec.py: verify_draft_probs). KV the
draft wrote for drafts that were then rejected is recomputed: a request's draft KV is trusted only up to its
longest common prefix with the request's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from actors.engine.block_manager import BlockManager
from actors.engine.config import EngineConfig
from actors.engine.request import EngineRequest
from gpu.batch import BatchSpec, ScheduledRow
from gpu.loading.config import ModelConfig
from gpu.loading.random_weights import served_dir
from gpu.runner.model_runner import ModelRunner
from gpu.sampling import Sampler, SamplingMetadata, SamplingRow
from gpu.sampling.spec import row_uniforms
from gpu.sampling.topk_topp import invert_cdf

DRAFT_STREAM = 1  # counter_uniforms stream of the draft tokens' draws


@dataclass(eq=False)
class _DraftKV:
    """A request's state in the draft's KV cache (duck-typed for BlockManager)."""

    request_id: str
    tokens: list[int] = field(default_factory=list)  # the request's tokens, then this proposal's drafts
    num_known: int = 0  # of them, the request's (known when proposing): the KV holds tokens[:num_computed_tokens]
    block_table: list[int] = field(default_factory=list)
    sent_blocks: int = 0  # (the BlockManager's count; unused: a proposal's rows send whole tables, slots by position)
    num_computed_tokens: int = 0


class DraftProposer:
    def __init__(self, config: EngineConfig, target: ModelConfig, num_blocks: int):
        spec = config.speculative
        self.model = ModelConfig.from_path(served_dir(Path(spec.model), config.load_format))
        if self.model.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.model.vocab_size}) is not the target's")
        self.k = spec.num_speculative_tokens
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.runner = ModelRunner(
            self.model.served(config.max_model_len),
            device=config.device,
            dtype=config.dtype,
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_seqs * config.max_model_len,
            attention_backend=config.attention_backend,
            cpu_kernels=config.cpu_kernels,
            batch_invariant=config.batch_invariant,
            decode_graphs=config.decode_graphs(),
        )
        self.sampler = Sampler()
        self.eos = list(target.eos_token_ids)
        self.states: dict[str, _DraftKV] = {}
        self.q: dict[str, torch.Tensor] = {}  # request id -> [drafts, V] float64: the last proposal's q
        self._released: list[str] = []  # told on the event loop, applied on the device thread

    @torch.inference_mode()
    def propose(self, items: list[tuple[EngineRequest, int]]) -> dict[str, list[int]]:
        """Up to min(k, K) drafts for each (request, k); q of each kept in `self.q`."""
        self._free_released()
        jobs = [(req, min(k, self.k), self._prepare(req, min(k, self.k))) for req, k in items if not req.is_finished]
        jobs = [(req, k, st) for req, k, st in jobs if st is not None]
        drafts: dict[str, list[int]] = {req.request_id: [] for req, _, _ in jobs}
        probs: dict[str, list[torch.Tensor]] = {req.request_id: [] for req, _, _ in jobs}
        for j in range(max((k for _, k, _ in jobs), default=0)):
            live = [(req, st) for req, k, st in jobs if k > j]
            rows = []
            for slot, (req, st) in enumerate(live):  # feed what the draft KV lacks: then the last draft only
                start = st.num_computed_tokens
                rows.append(ScheduledRow(req.request_id, slot, st.tokens[start:], start, list(st.block_table), True))
                st.num_computed_tokens = len(st.tokens)
            logits = self.runner.execute(BatchSpec(step=j, rows=rows))
            sampling = [
                SamplingRow(r.params, r.prompt_token_ids, st.tokens[len(r.prompt_token_ids) :], eos_token_ids=self.eos)
                for r, st in live
            ]
            q = self.sampler.probs(logits, SamplingMetadata.build(sampling, self.model.vocab_size, logits.device))
            tokens = invert_cdf(q, row_uniforms(sampling, DRAFT_STREAM, logits.device)).tolist()
            for i, (req, st) in enumerate(live):
                st.tokens.append(tokens[i])
                drafts[req.request_id].append(tokens[i])
                probs[req.request_id].append(q[i])
        for rid, qs in probs.items():
            self.q[rid] = torch.stack(qs)
        self._free_released()  # a request aborted meanwhile: its state was (re)made above
        return drafts

    def _prepare(self, req: EngineRequest, k: int) -> _DraftKV | None:
        """The request's draft KV, trusted up to where the drafts it holds part from the request's tokens, with
        blocks for k more tokens; None when the draft cache is full (no drafts then)."""
        st = self.states.get(req.request_id) or self.states.setdefault(req.request_id, _DraftKV(req.request_id))
        tokens = req.prompt_token_ids + req.output_token_ids
        same = min(st.num_known, len(st.tokens))  # what was known at the last proposal never changes
        while same < min(len(st.tokens), len(tokens)) and st.tokens[same] == tokens[same]:
            same += 1  # accepted drafts
        st.tokens, st.num_known = tokens, len(tokens)
        st.num_computed_tokens = min(st.num_computed_tokens, same, len(tokens) - 1)
        self.blocks.trim(st)
        need = len(tokens) + k - 1 - st.num_computed_tokens  # the last known token, then k - 1 drafts
        if not self.blocks.may_append(st, need):
            return None
        self.blocks.append_slots(st, need)
        return st

    def release(self, request_id: str) -> None:
        """The request is over: its draft blocks go back (at the next proposal, on the device thread)."""
        self._released.append(request_id)

    def _free_released(self) -> None:
        while self._released:
            self._free(self._released.pop())

    def _free(self, request_id: str) -> None:
        st = self.states.pop(request_id, None)
        self.q.pop(request_id, None)
        if st is not None:
            self.blocks.free(st)

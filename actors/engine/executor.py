"""StepExecutor: model runner + sampler for one step, run on the worker's single device thread (worker.py).

Steps run strictly in submission order on that thread, so step N+1 reads the ids step N left in
the runner's device relay buffer (`prev_sampled`, indexed by slot). The host copy of the sampled
ids is one copy per step into a fresh pinned buffer fenced by an event on CUDA (never a
device-wide sync); on CPU the tensors are already on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

from actors.engine.config import EngineConfig, device_type
from actors.engine.grammar_masks import WorkerMasks
from actors.engine.kv_sizing import sized_on_device
from gpu.attention.kv_cache import num_blocks_for_memory
from gpu.batch import BatchSpec
from gpu.distributed.group import TensorParallel, current
from gpu.kernels import native
from gpu.layers.parallel import local_config
from gpu.loading.config import ModelConfig
from gpu.loading.random_weights import served_dir
from gpu.runner.model_runner import ModelRunner, native_cpu_weights, resolve_dtypes
from gpu.sampling import LogprobsTensors, MetadataCache, Sampler, SamplingMetadata, SamplingRow, to_device
from gpu.sampling.spec import NO_DRAFT, num_emitted, row_uniforms, verify_draft_probs
from messages.wire import TokenLogprobs

ACCEPT, RESIDUAL = 2, 3  # counter_uniforms streams of draft-model verification (1: the draft tokens)


@dataclass
class _DraftCheck:
    """Draft-model verification inputs for the positions of the rows with drafts."""

    positions: torch.Tensor  # [P'] their indices among the step's sampled positions
    p: torch.Tensor  # [P', V] the target's processed distributions
    q: torch.Tensor  # [P', V] the draft's (zero at bonus positions)
    rows: list[SamplingRow]  # their sampling rows (uniforms are keyed by them)
    raw: torch.Tensor  # [P', V] their unprocessed logits (logprobs of the tokens finally emitted)
    meta: SamplingMetadata  # their sampling metadata (processed logprobs)


@dataclass
class StepTensors:
    sampled: torch.Tensor  # [num sampled positions] int64 on the host (1 + K for a row verifying K drafts)
    logprobs: LogprobsTensors | None  # one entry per sampled position
    ready: torch.cuda.Event | None  # set when the host copies are complete
    prompt_logprobs: LogprobsTensors | None = None  # one entry per prompt target, rows in batch order
    num_emitted: torch.Tensor | None = None  # [num sampling rows]: positions each emits; None: one each

    def host(self) -> tuple[list[int], list[int] | None, TokenLogprobs | None, TokenLogprobs | None]:
        """The sampled ids, how many each row emits, their logprobs and the prompt logprobs as Python lists.
        Waits only for this step's copy."""
        if self.ready is not None:
            self.ready.synchronize()
        emitted = None if self.num_emitted is None else self.num_emitted.tolist()
        return self.sampled.tolist(), emitted, _lists(self.logprobs), _lists(self.prompt_logprobs)


def _lists(lp: LogprobsTensors | None) -> TokenLogprobs | None:
    if lp is None:
        return None
    return TokenLogprobs(lp.sampled.tolist(), lp.ranks.tolist(), lp.top_ids.tolist(), lp.top_logprobs.tolist())


def guide(batch: BatchSpec, logits: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Classifier-free guidance: from the (float32) logits of every position the runner returned, those of the sampled
    positions, a guided row's replaced by l_u + s * (l_c - l_u) with its companion row's (the next 1 + K positions)
    as l_u, in float32, one expression for all guided rows. Also (the guided row's index among the sampling rows,
    its companion's slot) for the relay."""
    cond, uncond, scales, keep, companions, pos, j = [], [], [], [], [], 0, 0
    for row in batch.rows:
        if row.guidance_scale is not None and row.sample:
            k = row.num_logits  # 1 + K: its parent's sampled positions are the k just before
            cond.extend(range(pos - k, pos))
            uncond.extend(range(pos, pos + k))
            scales.extend([row.guidance_scale] * k)
            companions.append((j - 1, row.slot))
        else:
            keep.extend(range(pos, pos + row.num_logits))
            j += row.num_samples > 0
        pos += row.num_logits
    if not cond:
        return logits, companions
    idx = to_device(cond, torch.int64, logits.device)
    scale = to_device(scales, torch.float32, logits.device)[:, None]
    guided = torch.lerp(logits[to_device(uncond, torch.int64, logits.device)], logits[idx], scale)
    return logits.index_copy(0, idx, guided)[to_device(keep, torch.int64, logits.device)], companions


def draft_configs(config: EngineConfig) -> list[ModelConfig]:
    spec = config.speculative
    if spec is None or spec.method != "draft_model":
        return []
    return [ModelConfig.from_path(served_dir(Path(spec.model), config.load_format))]


def num_kv_blocks(config: EngineConfig, model: ModelConfig) -> int | None:
    """Blocks per KV cache: `num_kv_blocks`; else as many as fit in `kv_cache_memory_gb` (default 1 GiB) with every
    cache counted: the target's and a draft model's (actors/engine/draft.py: as many blocks, paired one-for-one);
    under tensor parallelism the budget is each rank's, for its share of the heads (as vLLM's, per device); None where
    the worker sizes the cache to its device (actors/engine/kv_sizing.py)."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    if sized_on_device(config):
        return None
    device = torch.device(device_type(config.device))  # (its type: no CUDA context in the scheduler's process)
    native_weights = native_cpu_weights(device, config.cpu_kernels, load=False)
    dtype = resolve_dtypes(config.dtype, device, model.dtype, native_weights)[0]  # (the KV cache's: activations')
    drafts = draft_configs(config)
    budget = int((1.0 if config.kv_cache_memory_gb is None else config.kv_cache_memory_gb) * (1 << 30))
    local = local_config(model, TensorParallel(0, config.tensor_parallel_size))  # (a rank's heads: its cache)
    return num_blocks_for_memory(local, config.block_size, dtype, budget, *drafts)


def make_runner(config: EngineConfig, model: ModelConfig, num_blocks: int | None) -> ModelRunner:
    """The target model's runner (a tensor-parallel rank's shard of it, in a gang: actors/engine/gang.py), holding
    the LoRA adapters the config serves."""
    lora = config.lora
    start = lora.at_start() if lora else {}
    runner = ModelRunner(
        model.served(config.max_model_len),  # (a rotary scaling fixed by the served length reads it)
        device=config.device,
        dtype=config.dtype,
        num_blocks=num_blocks,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        num_threads=config.threads(),
        quantization=config.quantization,
        attention_backend=config.attention_backend,
        cpu_kernels=config.cpu_kernels,
        batch_invariant=config.batch_invariant,
        decode_graphs=config.decode_graphs(),
        gpu_memory_utilization=config.gpu_memory_utilization,
        drafts=tuple(draft_configs(config)) if num_blocks is None else (),
        lora_slots=lora.capacity if lora else 0,
        max_lora_rank=lora.max_lora_rank if lora else 16,
        lora_dtype=lora.lora_dtype if lora else "auto",
    )
    runner.add_adapters(start)
    return runner


KEEPALIVE = b"keepalive"  # the leader's broadcast while idle: a follower's wait for a step has the group's deadline


@torch.inference_mode()
def follow(tp: TensorParallel, runner: ModelRunner) -> None:
    """A follower rank of a gang: each step the leader broadcasts (StepExecutor.run), until the empty one: the
    forward on this rank's shard, then the relay ids the leader sampled."""
    while data := tp.broadcast_bytes():
        if data == KEEPALIVE:
            continue
        batch = msgspec.msgpack.decode(data, type=BatchSpec)
        runner.execute(batch)
        if relay := batch.relay_slots:
            ids = tp.broadcast(torch.empty(len(relay), dtype=torch.int64, device=runner.device))
            runner.set_prev_sampled(torch.tensor(relay, dtype=torch.int64), ids)


class StepExecutor:
    def __init__(self, config: EngineConfig, model: ModelConfig, num_blocks: int | None):
        self.runner = make_runner(config, model, num_blocks)
        self.tp = current()  # (a gang's leader: the followers run each step's forward with it)
        self.followed = False  # the followers are in a step with us: if it raises, they wait in a collective
        row_sum = native.ops().row_sum if config.batch_invariant else None  # (built: the runner checked)
        self.sampler = Sampler(logprobs_mode=config.logprobs_mode, row_sum=row_sum)
        self.device = self.runner.device
        self.metadata = MetadataCache(model.vocab_size, self.device, edits=self.sampler.fuses(self.device))
        self.draft = None  # the DraftProposer whose q verifies draft-model speculation (set by the actor)
        self.debug_checks = config.debug_checks
        if self.debug_checks:
            self.runner.prev_sampled.fill_(-1)

    @torch.inference_mode()
    def run(
        self,
        batch: BatchSpec,
        rows: list[SamplingRow],
        num_prompt_logprobs: int = 0,
        masks: WorkerMasks | None = None,
    ) -> StepTensors:
        """Forward + sample one step; leave the sampled ids on the device for the next step.
        num_prompt_logprobs: the top-N of the prompt logprobs (the largest a row with prompt_targets asked for).
        masks: the constrained rows' grammar masks, applied after CFG (waiting for their last fills)."""
        if self.debug_checks:
            self._check_relay(batch)
        relay = batch.relay_slots
        if self.tp.size > 1:
            self.runner.tables.check(batch.step, batch.rows)  # (a step the tables refuse never reaches a follower)
            self.followed = True  # the followers run this step's collectives with us (from its first byte)
            self.tp.broadcast_bytes(msgspec.msgpack.encode(batch))
        logits = self.runner.execute(batch)
        self.followed = self.followed and bool(relay)  # (without a relay they are done)
        num_logits = sum(r.num_logits for r in batch.rows)
        plp = self._prompt_logprobs(batch, logits[num_logits:], num_prompt_logprobs)
        if not rows:  # only partial chunked-prefill rows: nothing samples this step (no relay)
            return self._to_host(torch.empty(0, dtype=torch.int64), None, plp)
        logits, companions = guide(batch, logits[:num_logits])
        if masks is not None:
            masks.apply(logits)
        spec = self._spec_rows(batch, logits, rows) if self.draft is not None else None
        out = self.sampler(logits, self.metadata.build(rows))
        tokens, emitted, last = self._verify(batch, out.sampled, spec)
        if spec is not None and out.logprobs is not None:  # an accepted draft or a residual draw: its own logprob
            fixed = self.sampler.logprobs_of(spec.raw, tokens[spec.positions], 1, spec.meta)
            out.logprobs.sampled[spec.positions], out.logprobs.ranks[spec.positions] = fixed.sampled, fixed.ranks
        if companions:  # a CFG companion's next input is its parent's token
            parents = to_device([j for j, _ in companions], torch.int64, last.device)
            last = torch.cat([last, last.index_select(0, parents)])
        if relay:  # (the followers' copy: one broadcast)
            last = self.tp.broadcast(last.to(torch.int64).contiguous())
            self.runner.set_prev_sampled(torch.tensor(relay, dtype=torch.int64), last)
        self.followed = False
        return self._to_host(tokens, out.logprobs, plp, emitted)

    def _spec_rows(self, batch: BatchSpec, logits: torch.Tensor, rows: list[SamplingRow]) -> _DraftCheck | None:
        """Draft-model speculation: the positions of the rows with drafts, their target distributions p (computed
        before the sampler works on the logits in place) and their draft distributions q (zero at bonus positions)."""
        idx, qs, pos = [], [], 0
        for r in batch.rows:
            if r.draft_token_ids and r.num_samples:  # (a CFG companion row is fed its parent's drafts too)
                k = len(r.draft_token_ids)
                idx += range(pos, pos + k + 1)
                q = self.draft.q.pop(r.request_id)[:k]  # used once: not kept beyond this step
                qs += [q, q.new_zeros(1, q.shape[1])]
            pos += r.num_samples
        if not idx:
            return None
        sub, raw = [rows[i] for i in idx], logits[idx]  # (a copy: the sampler then works on the logits in place)
        meta = SamplingMetadata.build(sub, logits.shape[1], logits.device)
        p = self.sampler.probs(raw, meta)
        return _DraftCheck(to_device(idx, torch.int64, logits.device), p, torch.cat(qs), sub, raw, meta)

    def _verify(self, batch: BatchSpec, sampled: torch.Tensor, spec: _DraftCheck | None):
        """(the token at each sampled position, how many positions each sampling row emits (None: one each), each
        row's last emitted token): point-mass drafts verified by comparison, draft-model ones by rejection
        sampling (gpu/sampling/spec.py)."""
        if len(sampled) == len(batch.sampling_rows):
            return sampled, None, sampled
        counts = to_device([r.num_samples for r in batch.rows if r.num_samples], torch.int64, sampled.device)
        drafts = [t for r in batch.rows if r.num_samples for t in (*r.draft_token_ids, NO_DRAFT)]
        drafts = to_device(drafts, torch.int64, sampled.device)
        accepted = sampled == drafts
        if spec is not None:
            idx = spec.positions
            u_accept, u_residual = (row_uniforms(spec.rows, stream, sampled.device) for stream in (ACCEPT, RESIDUAL))
            token, ok = verify_draft_probs(spec.p, spec.q, drafts[idx], sampled[idx], u_accept, u_residual)
            sampled, accepted = sampled.index_put((idx,), token), accepted.index_put((idx,), ok)
        emitted = num_emitted(accepted, counts)
        return sampled, emitted, sampled[counts.cumsum(0) - counts + emitted - 1]

    def _prompt_logprobs(self, batch: BatchSpec, logits: torch.Tensor, n: int) -> LogprobsTensors | None:
        """Raw logprobs of each prompt target under the logits of the token before it, and the top-n."""
        if not len(logits):
            return None
        targets = to_device([t for r in batch.rows for t in r.prompt_targets], torch.int64, logits.device)
        return self.sampler.logprobs_of(logits, targets, max(n, 1))

    def _to_host(
        self,
        sampled: torch.Tensor,
        lp: LogprobsTensors | None,
        plp: LogprobsTensors | None,
        emitted: torch.Tensor | None = None,
    ) -> StepTensors:
        if self.device.type == "cpu":
            return StepTensors(sampled, lp, None, plp, emitted)

        def copy(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

        def copies(x: LogprobsTensors | None) -> LogprobsTensors | None:
            return x and LogprobsTensors(*(copy(t) for t in (x.sampled, x.ranks, x.top_ids, x.top_logprobs)))

        host, host_lp, host_plp = copy(sampled), copies(lp), copies(plp)
        host_emitted = None if emitted is None else copy(emitted)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))  # (the copies' stream: this thread is bound to the device)
        return StepTensors(host, host_lp, event, host_plp, host_emitted)

    def _check_relay(self, batch: BatchSpec) -> None:
        """Debug mode: every placeholder reads a relay slot that some earlier step wrote."""
        for row in batch.rows:
            if row.token_ids and row.token_ids[-1] == -1:
                value = int(self.runner.prev_sampled[row.slot])
                assert value >= 0, f"{row.request_id}: relay slot {row.slot} read before it was written"

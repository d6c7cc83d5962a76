"""Classifier-free guidance in the scheduler: a guided request and its Companion are planned as one unit.

The companion's logits must come from the step in which its parent samples, at the same output position: in a
step where the parent feeds its last token (and samples) the companion feeds its own last token too, and its row
guides the parent's; in any other step each half is fed short of its end. Both halves end a sampling step fully
computed, and every output token extends both, so whenever the parent has tokens left the companion has at least
one too. Decoding, a pair costs two tokens of the step's budget, two slots and both halves' KV blocks.

A pair must fit the KV cache alone at its longest (`pair_fit_error`), or it can never finish: the scheduler
guarantees progress only to a request that fits alone (actors/engine/scheduler.py), and a pair that outgrew the
cache would preempt everyone, then itself, re-prefill and repeat. Its longest: each half holds its prompt and every
output token but the last (sampled, never fed); the output ends at max_tokens or where the longer prompt reaches
max_model_len. A pair that may outgrow the cache is refused before it runs, naming guidance_scale (one sequence
of max_model_len always fits: the scheduler checks it at construction).
"""

from __future__ import annotations

from actors.engine.block_manager import BlockManager
from actors.engine.config import EngineConfig
from actors.engine.request import EngineRequest
from gpu.batch import ScheduledRow
from gpu.loading.config import ModelConfig
from messages.sampling_params import ParamError, SamplingParams


def guidance_error(
    params: SamplingParams, config: EngineConfig, model: ModelConfig, num_prompt_tokens: int, cache: BlockManager
) -> ParamError | None:
    """Why the engine cannot guide this request (of that many prompt tokens, in the scheduler's KV cache), naming
    the request field at fault (None: it can)."""
    negative = params.negative_prompt_token_ids
    if negative is None and model.bos_token_id is None:
        return ParamError("negative_prompt", "negative_prompt is required: the model has no BOS token to guide against")
    max_model_len = min(config.max_model_len, model.max_model_len)
    if negative is not None and len(negative) >= max_model_len:
        return ParamError(
            "negative_prompt", f"the negative prompt has {len(negative)} tokens; max_model_len is {max_model_len}"
        )
    if config.max_num_seqs < 2 or config.max_num_batched_tokens < 2:
        return ParamError(
            "guidance_scale", "guidance_scale needs a server with max_num_seqs and max_num_batched_tokens of 2 or more"
        )
    num_negative = len(negative) if negative is not None else 1  # (BOS alone)
    return pair_fit_error(num_prompt_tokens, num_negative, params.max_tokens, max_model_len, cache)


def pair_fit_error(
    num_prompt: int, num_negative: int, max_tokens: int, max_model_len: int, cache: BlockManager
) -> ParamError | None:
    """Why a guided pair cannot run in the KV cache: it may outgrow it (module docstring); None: it fits alone."""
    out = min(max_tokens, max_model_len - max(num_prompt, num_negative))
    need = sum(cache.num_blocks_for(n + out - 1) for n in (num_prompt, num_negative))
    if need <= cache.num_blocks:
        return None
    return ParamError(
        "guidance_scale",
        f"guidance_scale runs a second sequence beside the request: with {num_prompt} prompt and {num_negative} "
        f"negative prompt tokens and up to {out} output tokens the pair needs {need} KV blocks of {cache.block_size} "
        f"tokens at its longest; the KV cache has {cache.num_blocks}",
    )


def pair_tokens(req: EngineRequest, budget: int, chunk: int) -> tuple[int, int]:
    """(request tokens, companion tokens) a guided pair feeds this step: both whole when they fit the budget and each
    the per-request chunk (the parent samples), else each short of its end (prefill progress; (0, 0): wait)."""
    left = req.num_tokens - req.num_computed_tokens
    c = req.companion
    c_left = c.num_tokens - c.num_computed_tokens
    if left + c_left <= budget and max(left, c_left) <= chunk:
        return left, c_left
    n = min(left - 1, chunk, budget)
    return n, min(c_left - 1, chunk, budget - n)


def companion_row(req: EngineRequest, m: int, block_manager: BlockManager, drafts: list[int] = ()) -> ScheduledRow:
    """The companion's row feeding its next m tokens, the parent's drafts among them (its blocks grown to cover
    them); it guides its parent when they reach its end. Counted in the parent's in-flight steps."""
    c = req.companion
    block_manager.append_slots(c, m)
    start, fed = c.num_computed_tokens, m - len(drafts)
    tokens = c.token_ids(start, start + fed) + list(drafts)
    sent, blocks = block_manager.unsent(c)
    row = ScheduledRow(
        req.request_id,
        c.slot,
        tokens,
        start,
        blocks,
        blocks_from=sent,
        sample=start + fed == c.num_tokens,
        draft_token_ids=list(drafts),
        guidance_scale=req.params.guidance_scale,
        lora=req.params.lora,  # (the unconditional logits are the same adapter's)
    )
    c.num_computed_tokens += m
    block_manager.cache_full_blocks(c)
    req.num_inflight_steps += 1
    return row

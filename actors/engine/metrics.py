"""The engine's counters: EngineStats for /metrics, read off the scheduler, and speculative decoding's periodic log
line (vLLM's; its counters are actors/engine/spec_stats.py's, below the scheduler, which keeps them)."""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from actors.engine.spec_stats import SpecStats
from messages.wire import EngineStats

if TYPE_CHECKING:
    from actors.engine.scheduler import Scheduler

log = logging.getLogger("sluice.engine")


def idle_details(sched: Scheduler) -> dict[str, int]:
    """The scheduler's per-request state left over: all zero when the engine is idle."""
    bm = sched.block_manager
    return {
        "requests": len(sched.requests),
        "running": len(sched.running),
        "waiting": len(sched.waiting),
        "used_blocks": bm.num_blocks - bm.num_free_blocks,
        "used_slots": sched.max_num_seqs - len(sched.free_slots),
        "in_flight_steps": len(sched.in_flight),
        "undrained_aborts": len(sched.aborted_freed),
        "matchers": sched.matchers,  # grammar matchers not released
        "searches": len(sched.searches),  # beam searches not freed
        "groups": sched.num_groups,  # beam groups held
    }


def engine_stats(sched: Scheduler, late_aborts_total: int = 0, queue_times_s: list[float] = ()) -> EngineStats:
    """The numbers /metrics shows; the actor adds what only it knows."""
    spec, bm = sched.spec, sched.block_manager
    cache = {"block_size": bm.block_size, "num_gpu_blocks": bm.num_blocks, "enable_prefix_caching": bm.enable_caching}
    return EngineStats(
        num_running=sched.num_running,
        num_waiting=sched.num_waiting,
        kv_usage=sched.block_manager.usage,
        prompt_tokens_total=sched.prompt_tokens_total,
        generation_tokens_total=sched.generation_tokens_total,
        late_aborts_total=late_aborts_total,
        discarded_samples_total=sched.num_discarded_samples,
        num_preemptions_total=sched.num_preemptions,
        queue_times_s=list(queue_times_s),
        spec_num_drafts=spec.num_drafts,
        spec_num_draft_tokens=spec.num_draft_tokens,
        spec_num_accepted_tokens=spec.num_accepted_tokens,
        spec_accepted_per_pos=list(spec.accepted_per_pos),
        prefix_cache_queries_total=bm.queries,
        prefix_cache_hits_total=bm.hits,
        cache_config={k: str(v) for k, v in cache.items()},
        prefix_anchors=list(bm.anchors),
        lora_info=lora_info(sched),
    )


def lora_info(sched) -> dict[str, str]:
    """vLLM's lora_requests_info labels, and the adapters read from disk and evicted (EngineStats.lora_info)."""
    if sched.max_loras is None:
        return {}
    adapters = {name: {r.params.lora for r in reqs} - {None}
                for name, reqs in (("running", sched.running), ("waiting", sched.waiting))}  # fmt: skip
    table = {"loads": str(sched.loras.loads), "evictions": str(sched.loras.evictions)} if sched.loras else {}
    names = {f"{k}_lora_adapters": ",".join(sorted(v)) for k, v in adapters.items()}
    return {"max_lora": str(sched.max_loras), **names, **table}


async def log_speculation(current: Callable[[], SpecStats], every_s: float = 10.0) -> None:
    """vLLM's periodic SpecDecoding line: acceptance since the last one."""
    last = SpecStats()
    while True:
        await asyncio.sleep(every_s)
        if line := current().since(last):
            log.info("speculative decoding: %s", line)
        last = copy.deepcopy(current())

"""A tensor-parallel gang (actors/engine/gang.py) through the whole engine on CPU: two gloo ranks in their own
processes give the one-rank worker's tokens, greedy and seeded, on a workload through prefill, chunked prefill,
decode, preemption (a KV cache too small for every row), prefix hits (a second wave of the same prompts), a regex
grammar and a CFG request, with async scheduling (the relay ids broadcast to each rank), on the CUDA graphs' static
decode buffers, and with n-gram speculation (verification rows); the counters show each path ran. A follower rank killed (kill -9) or stopped
(SIGSTOP: a hung rank) mid-stream ends the gang: every stream then finishes with the undisturbed run's tokens, the
worker is reset (a new epoch) and the engine ends idle. An idle gang outlives its collectives' deadline. Two
data-parallel replicas of two ranks each give the same tokens."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from actors.engine.config import SpeculativeConfig
from frontend.offline import AsyncLLM
from messages.names import WORKER
from messages.sampling_params import SamplingParams, StructuredOutput
from tests.cancel_harness import assert_idle, engine_config, model_dir, start, wait_for  # noqa: F401

REPEAT = [5, 6, 7, 8] * 4  # one full block: the second wave hits it; n-gram drafts from it
PROMPTS = [REPEAT, list(range(100, 150)), [42] * 9, [7, 300, 12, 4000, 91, 17], [1, 200, 201, 202]]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=24, ignore_eos=True),  # chunked: 50 > 32
    SamplingParams(
        temperature=1.0, seed=5, max_tokens=16, structured=StructuredOutput(kind="regex", spec="[a-z ]{4,30}")
    ),
    SamplingParams(temperature=1.0, top_k=30, seed=8, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, guidance_scale=2.0),
]


def config(model_dir, tp: int, **extra):  # noqa: F811
    return engine_config(
        model_dir, worker="process", tensor_parallel_size=tp, step_gate=False, max_model_len=96, num_kv_blocks=9,
        **extra,
    )  # fmt: skip


async def waves(llm: AsyncLLM) -> list[tuple]:
    """The workload twice, one wave after the other: (tokens, finish reason) per request."""
    outs = [*await llm.generate(PROMPTS, PARAMS), *await llm.generate(PROMPTS, PARAMS)]
    return [(o.token_ids, o.finish_reason) for o in outs]


async def run(model_dir, tp: int, speculative: bool = False, **extra):  # noqa: F811
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3) if speculative else None
    async with AsyncLLM(config(model_dir, tp, speculative=spec, **extra), log_level="WARNING") as llm:
        outs = await waves(llm)
        stats, _ = await llm.fresh_stats()
        await assert_idle(llm)
    return outs, stats


@pytest.fixture(scope="module")
async def one_rank(model_dir):  # noqa: F811
    return (await run(model_dir, 1))[0]


@pytest.mark.parametrize("variant", ["async", "static", "ngram"])
async def test_two_ranks_give_one_ranks_tokens(model_dir, one_rank, variant):  # noqa: F811
    """ "static": decode steps on the CUDA graphs' static buffers (gpu/runner/graphs.py, run eagerly here)."""
    speculative = variant == "ngram"
    reference = (await run(model_dir, 1, speculative))[0] if speculative else one_rank
    outs, stats = await run(model_dir, 2, speculative, static_decode=variant == "static")
    assert outs == reference
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total > 0
    assert not speculative or stats.spec_num_accepted_tokens > 0


async def test_two_replicas_of_two_ranks_give_one_ranks_tokens(model_dir, one_rank):  # noqa: F811
    """-dp 2 -tp 2: each replica is a gang of its own (its own rendezvous and ranks), the requests spread over both."""
    async with AsyncLLM(config(model_dir, 2, data_parallel_size=2), log_level="WARNING") as llm:
        assert await waves(llm) == one_rank
        routed = llm.client.streams.replicas.routed
        assert sum(routed.values()) == 2 * len(PROMPTS) and routed["cache_aware", "no_hit"] >= 2, routed
        await assert_idle(llm)


def stat(pid: int | str) -> list[str]:
    """/proc/<pid>/stat's fields after the command: state, ppid, ... ([] once the process is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return []


def followers(leader: int) -> list[int]:
    """The pids of the leader's live child processes (its gang's followers)."""
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and stat(p.name)[1:2] == [str(leader)]
            and running(p.name)]  # fmt: skip


def running(pid: int | str) -> bool:
    return stat(pid)[:1] not in ([], ["Z"], ["X"])


@pytest.fixture(scope="module")
async def gang(model_dir):  # noqa: F811
    """A TP = 2 engine whose steps are given up after 2 s without progress (a hung rank is found quickly), and the
    undisturbed run's outputs of the long workload."""
    async with AsyncLLM(config(model_dir, 2, step_timeout_s=STEP_TIMEOUT_S), log_level="WARNING") as llm:
        yield llm, await llm.generate(PROMPTS, LONG)


STEP_TIMEOUT_S = 2.0
LONG = [SamplingParams(temperature=0.8, seed=i, max_tokens=48, ignore_eos=True) for i in range(len(PROMPTS))]


async def test_an_idle_gang_outlives_its_collectives_deadline(gang):
    """A follower waits for the next step under the group's deadline (2 x step_timeout_s = 4 s here): the leader's
    keepalives hold an idle gang together."""
    llm, undisturbed = gang
    leader = llm.system.pids()[WORKER]
    (follower,) = followers(leader)
    await asyncio.sleep(1.5 * 2 * STEP_TIMEOUT_S)  # (idle past the deadline by half: the deadline is what is tested)
    assert (llm.system.pids()[WORKER], followers(leader)) == (leader, [follower])
    outs = await llm.generate(PROMPTS, LONG)
    assert [o.token_ids for o in outs] == [o.token_ids for o in undisturbed]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
async def test_a_lost_rank_ends_the_gang_and_streams_continue_exactly(gang, sig):
    llm, undisturbed = gang
    before, _ = await llm.fresh_stats()
    leader = llm.system.pids()[WORKER]
    (follower,) = followers(leader)
    runs = [start(llm, prompt, params) for prompt, params in zip(PROMPTS, LONG, strict=True)]
    await wait_for(lambda: all(len(r.token_ids) >= 4 for r in runs), what="every stream under way")
    os.kill(follower, sig)
    for run in runs:
        await run.done(timeout=120)
    assert [(r.token_ids, r.text) for r in runs] == [(o.token_ids, o.text) for o in undisturbed]
    assert all(r.finished.finish_reason == "length" for r in runs)  # (no error event)
    await wait_for(lambda: llm.system.pids().get(WORKER) not in (None, leader), what="a new gang")
    after, _ = await llm.fresh_stats()
    assert after.worker_resets_total > before.worker_resets_total  # a new epoch
    (new_follower,) = followers(llm.system.pids()[WORKER])
    assert new_follower != follower
    await assert_idle(llm)
    await wait_for(lambda: not running(follower), what="the old follower gone")  # (a hung one too: PDEATHSIG)

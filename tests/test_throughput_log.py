"""The serving log's throughput line (frontend/throughput_log.py): the interval's rates from the detokenizer's token
counters, the engine's latest load, the interval's prefix hit rate; one line when a replica goes idle, then silence;
a restarted actor's counters (counting from zero again) are read as a reset."""

from __future__ import annotations

from frontend.metrics import Metrics
from frontend.throughput_log import ThroughputLog
from messages.wire import DetokStats, EngineStats


def report(metrics: Metrics, prompt: int, generation: int, running: int, waiting: int, queries: int, hits: int):
    metrics.on_engine_stats(EngineStats(
        num_running=running, num_waiting=waiting, kv_usage=0.25, prompt_tokens_total=0, generation_tokens_total=0,
        late_aborts_total=0, prefix_cache_queries_total=queries, prefix_cache_hits_total=hits,
    ))  # fmt: skip
    metrics.on_detok_stats(DetokStats(
        stale_outputs_dropped_total=0, protocol_violations_total=0, num_tombstones=0, prompt_tokens_total=prompt,
        generation_tokens_total=generation,
    ))  # fmt: skip


def test_rates_load_and_hit_rate_then_one_idle_line():
    metrics = Metrics("sluice:", "SmolLM2")
    pulse = ThroughputLog(metrics, now=100.0, interval_s=10.0)
    assert pulse.lines(110.0) == []  # no report yet
    report(metrics, prompt=500, generation=100, running=0, waiting=0, queries=100, hits=0)
    assert pulse.lines(110.5) == []  # the first report is the baseline (what it counted before this server)
    report(metrics, prompt=1500, generation=600, running=3, waiting=1, queries=300, hits=50)
    assert pulse.lines(115.0) == []  # (before the interval has passed)
    assert pulse.lines(120.5) == [
        "engine 0: prompt 100.0 tok/s, generation 50.0 tok/s, running 3, waiting 1, KV cache 25.0%, "
        "prefix cache hit rate 25.0%"
    ]
    report(metrics, prompt=1500, generation=600, running=0, waiting=0, queries=300, hits=50)  # gone idle
    assert pulse.lines(130.5) == [
        "engine 0: prompt 0.0 tok/s, generation 0.0 tok/s, running 0, waiting 0, KV cache 25.0%, prefix cache hit rate -"
    ]
    assert pulse.lines(140.5) == [] and pulse.lines(150.5) == []
    report(metrics, prompt=40, generation=20, running=1, waiting=0, queries=0, hits=0)  # restarted: from zero
    assert pulse.lines(160.5)[0].startswith("engine 0: prompt 4.0 tok/s, generation 2.0 tok/s, running 1,")


def test_token_counts_count_delivered_tokens_and_their_prompts():
    """A request refused before any token counts nothing; a prompt is counted with its request's first tokens."""
    from actors.detokenizer.token_counts import TokenCounts
    from messages.wire import Finished, TextDelta

    counts = TokenCounts()
    refused = Finished(request_id="a", finish_reason="error", num_prompt_tokens=500, num_output_tokens=0)
    counts.output(500, [], refused)
    counts.end_step()
    counts.output(5, [TextDelta(request_id="b", seq=0, text="x", token_ids=[1, 2])], None)
    counts.output(None, [TextDelta(request_id="c", seq=3, text="y", token_ids=[3])], None)
    counts.end_step()
    assert counts.report() == {"prompt_tokens_total": 5, "generation_tokens_total": 3, "iteration_tokens": [8]}
    assert counts.report()["iteration_tokens"] == []

"""/metrics: Prometheus text, vLLM's metric names under the `sluice:` prefix.

The HTTP actor's own observations (latencies, finished requests, aborts) are prometheus_client
metrics. The engine's and the detokenizer's totals arrive as absolute values in EngineStats /
DetokStats every stats interval and are exported from the latest snapshot by a collector (a
restarted actor counts from zero again, which Prometheus reads as a counter reset). Protocol
counters carry an `actor` label: the HTTP actor's own and the detokenizer's.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from actors.engine.config import DETOKENIZER
from messages.wire import DetokStats, EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
HTTP = "http"  # the `actor` label of the HTTP actor's own counters

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)

NO_ENGINE_STATS = EngineStats(
    num_running=0, num_waiting=0, kv_usage=0.0, prompt_tokens_total=0, generation_tokens_total=0, late_aborts_total=0
)
NO_DETOK_STATS = DetokStats(stale_outputs_dropped_total=0, protocol_violations_total=0, num_tombstones=0)


class Metrics:
    def __init__(self) -> None:
        disable_created_metrics()  # no `_created` series (as vLLM); the HTTP process has only this registry
        self.registry = r = CollectorRegistry()
        self.request_success = Counter(
            "sluice:request_success",
            "Finished requests (per choice) by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.aborts = Counter("sluice:request_aborts", "Aborts sent to the engine, by reason.", ["reason"], registry=r)
        self.ttft = Histogram(
            "sluice:time_to_first_token_seconds", "Arrival to first token.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "sluice:inter_token_latency_seconds", "Gap between a choice's outputs.", buckets=ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "sluice:e2e_request_latency_seconds", "Arrival to finish.", buckets=REQUEST_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "sluice:request_queue_time_seconds", "Arrival to first scheduled.", buckets=REQUEST_BUCKETS, registry=r
        )
        self.http_requests = Counter(
            "sluice:http_requests", "HTTP responses by endpoint and status code.", ["endpoint", "status"], registry=r
        )
        # the HTTP actor's protocol counters (RequestTable increments them)
        self.stale_dropped = 0
        # by kind: unknown_id, duplicate, gap, after_finished (output past the count a Finished reported)
        self.violations: collections.Counter[str] = collections.Counter()
        # requests re-submitted from their record (DESIGN I8), by cause: death (of an engine-side process),
        # lost_output (a gap in a request's outputs, DESIGN I6)
        self.resumes: collections.Counter[str] = collections.Counter()
        self.num_tombstones: Callable[[], int] = lambda: 0
        self.engine = NO_ENGINE_STATS
        self.detok = NO_DETOK_STATS
        r.register(_Snapshots(self))

    def on_engine_stats(self, msg: EngineStats) -> None:
        self.engine = msg
        for t in msg.queue_times_s:
            self.queue_time.observe(t)

    def on_detok_stats(self, msg: DetokStats) -> None:
        self.detok = msg

    def forget(self, actor: str) -> None:
        """`actor` died: its gauges read 0 and its counters restart (a counter reset) until it reports again."""
        if actor == DETOKENIZER:
            self.detok = NO_DETOK_STATS
        else:
            self.engine = NO_ENGINE_STATS

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Snapshots:
    """Exports the engine's and the detokenizer's latest totals, and the HTTP actor's protocol counters."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def collect(self):
        e, d, m = self.m.engine, self.m.detok, self.m
        yield _gauge("sluice:num_requests_running", "Requests in the engine's running batch.", e.num_running)
        yield _gauge("sluice:num_requests_waiting", "Requests waiting in the engine.", e.num_waiting)
        yield _gauge("sluice:kv_cache_usage_perc", "KV cache usage (1 = full).", e.kv_usage)
        yield _counter("sluice:prompt_tokens", "Prompt tokens processed.", e.prompt_tokens_total)
        yield _counter("sluice:generation_tokens", "Tokens generated.", e.generation_tokens_total)
        yield _counter("sluice:late_aborts", "Aborts for finished or unknown requests (ignored).", e.late_aborts_total)
        yield _counter("sluice:num_preemptions", "Recompute preemptions.", e.num_preemptions_total)
        yield _counter(
            "sluice:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", e.prefix_cache_queries_total
        )
        yield _counter(
            "sluice:prefix_cache_hits", "Prompt tokens found in the prefix cache.", e.prefix_cache_hits_total
        )
        yield _counter("sluice:discarded_samples", "Samples of aborted requests discarded.", e.discarded_samples_total)
        yield _counter("sluice:spec_decode_num_drafts", "Rows that verified draft tokens.", e.spec_num_drafts)
        yield _counter("sluice:spec_decode_num_draft_tokens", "Draft tokens verified.", e.spec_num_draft_tokens)
        yield _counter("sluice:spec_decode_num_accepted_tokens", "Draft tokens accepted.", e.spec_num_accepted_tokens)
        per_pos = CounterMetricFamily(
            "sluice:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position.", labels=["position"]
        )
        for pos, count in enumerate(e.spec_accepted_per_pos):
            per_pos.add_metric([str(pos)], count)
        yield per_pos
        stale = CounterMetricFamily(
            "sluice:stale_outputs_dropped", "Outputs for tombstoned requests (dropped).", labels=["actor"]
        )
        stale.add_metric([HTTP], m.stale_dropped)
        stale.add_metric([DETOKENIZER], d.stale_outputs_dropped_total)
        yield stale
        violations = CounterMetricFamily(
            "sluice:protocol_violations",
            "Outputs for unknown ids, duplicates, gaps, past a Finished.",
            labels=["actor", "kind"],
        )
        for kind in ("unknown_id", "duplicate", "gap", "after_finished"):
            violations.add_metric([HTTP, kind], m.violations[kind])
        violations.add_metric([DETOKENIZER, "any"], d.protocol_violations_total)
        yield violations
        resumes = CounterMetricFamily(
            "sluice:request_resumes",
            "Requests re-submitted from what their client has, by who re-submitted them and why.",
            labels=["actor", "cause"],
        )
        for cause in ("death", "lost_output"):
            resumes.add_metric([HTTP, cause], m.resumes[cause])
        resumes.add_metric([DETOKENIZER, "lost_output"], d.repairs_total)
        yield resumes
        tombstones = GaugeMetricFamily(
            "sluice:num_tombstones", "Requests aborted, awaiting Finished.", labels=["actor"]
        )
        tombstones.add_metric([HTTP], m.num_tombstones())
        tombstones.add_metric([DETOKENIZER], d.num_tombstones)
        yield tombstones


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)

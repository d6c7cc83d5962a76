"""/metrics: Prometheus text, vLLM's metric names under the `sluice:` prefix (`--metrics-prefix vllm:` for
dashboards built for vLLM).

The HTTP actor's own observations (latencies, finished requests, aborts) are prometheus_client
metrics. The engine's and the detokenizer's totals arrive as absolute values in EngineStats /
DetokStats every stats interval and are exported from the latest snapshot by a collector (a
restarted actor counts from zero again, which Prometheus reads as a counter reset). Protocol
counters carry an `actor` label: the HTTP actor's own and the detokenizer's.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from actors.protocol import ProtocolCounts
from messages.names import DETOKENIZER, HTTP
from messages.sampling_params import SamplingParams
from messages.wire import DetokStats, EngineStats, Finished

DEFAULT_PREFIX = "sluice:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)

NO_ENGINE_STATS = EngineStats(
    num_running=0, num_waiting=0, kv_usage=0.0, prompt_tokens_total=0, generation_tokens_total=0, late_aborts_total=0
)
NO_DETOK_STATS = DetokStats(stale_outputs_dropped_total=0, protocol_violations_total=0, num_tombstones=0)


class Metrics:
    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        """`prefix`: of every series' name (--metrics-prefix: `vllm:` serves dashboards built for vLLM)."""
        disable_created_metrics()  # no `_created` series (as vLLM); the HTTP process has only this registry
        self.registry = r = CollectorRegistry()
        self.prefix = prefix

        def histogram(name: str, doc: str, buckets, labels=()) -> Histogram:
            return Histogram(prefix + name, doc, labels, buckets=buckets, registry=r)

        self.request_success = Counter(
            prefix + "request_success",
            "Finished requests (per choice) by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.aborts = Counter(
            prefix + "request_aborts", "Aborts sent to the engine, by reason.", ["reason"], registry=r
        )
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Gap between a choice's outputs.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS)
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", REQUEST_BUCKETS
        )
        self.decode_time = histogram("request_decode_time_seconds", "First token to last token.", REQUEST_BUCKETS)
        self.inference_time = histogram(
            "request_inference_time_seconds", "First scheduled to last token.", REQUEST_BUCKETS
        )
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.generation_tokens = histogram("request_generation_tokens", "Tokens generated per request.", TOKEN_BUCKETS)
        self.max_tokens = histogram("request_params_max_tokens", "max_tokens per request.", TOKEN_BUCKETS)
        self.max_generation = histogram(
            "request_max_num_generation_tokens", "Most tokens a request could generate.", TOKEN_BUCKETS
        )
        self.params_n = histogram("request_params_n", "n per HTTP request.", (1, 2, 5, 10, 20))
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens per engine step.", ITERATION_BUCKETS)
        self.http_requests = Counter(
            prefix + "http_requests", "HTTP responses by endpoint and status code.", ["endpoint", "status"], registry=r
        )
        self.protocol = ProtocolCounts()  # the HTTP actor's (its RequestTable counts in it)
        self.num_tombstones: Callable[[], int] = lambda: 0
        self.engine = NO_ENGINE_STATS
        self.detok = NO_DETOK_STATS
        r.register(_Snapshots(self))

    def finished(self, fin: Finished, params: SamplingParams) -> None:
        """A choice ended: its sizes and (when the engine timed it) its prefill and decode times."""
        self.request_success.labels(fin.finish_reason).inc()
        self.prompt_tokens.observe(fin.num_prompt_tokens)
        self.generation_tokens.observe(fin.num_output_tokens)
        self.max_tokens.observe(params.max_tokens)
        self.max_generation.observe(fin.num_prompt_tokens + params.max_tokens)
        if fin.timings:
            prefill, decode = fin.timings
            self.prefill_time.observe(prefill)
            self.decode_time.observe(decode)
            self.inference_time.observe(prefill + decode)

    def on_engine_stats(self, msg: EngineStats) -> None:
        self.engine = msg
        for t in msg.queue_times_s:
            self.queue_time.observe(t)
        for n in msg.iteration_tokens:
            self.iteration_tokens.observe(n)

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
        e, d, m, p = self.m.engine, self.m.detok, self.m, self.m.prefix
        if e.cache_config:  # (vLLM's info gauge: 1, the configuration in its labels)
            info = GaugeMetricFamily(
                p + "cache_config_info", "The KV cache's configuration.", labels=list(e.cache_config)
            )
            info.add_metric(list(e.cache_config.values()), 1)
            yield info
        yield _gauge(p + "num_requests_running", "Requests in the engine's running batch.", e.num_running)
        yield _gauge(p + "num_requests_waiting", "Requests waiting in the engine.", e.num_waiting)
        yield _gauge(p + "kv_cache_usage_perc", "KV cache usage (1 = full).", e.kv_usage)
        yield _counter(p + "prompt_tokens", "Prompt tokens processed.", e.prompt_tokens_total)
        yield _counter(p + "generation_tokens", "Tokens generated.", e.generation_tokens_total)
        yield _counter(p + "late_aborts", "Aborts for finished or unknown requests (ignored).", e.late_aborts_total)
        yield _counter(p + "num_preemptions", "Recompute preemptions.", e.num_preemptions_total)
        yield _counter(p + "worker_resets", "Worker states lost (a death, a lost step): running requests recomputed.",
                       e.worker_resets_total)  # fmt: skip
        yield _counter(
            p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", e.prefix_cache_queries_total
        )
        yield _counter(p + "prefix_cache_hits", "Prompt tokens found in the prefix cache.", e.prefix_cache_hits_total)
        yield _counter(p + "discarded_samples", "Samples of aborted requests discarded.", e.discarded_samples_total)
        yield _counter(p + "spec_decode_num_drafts", "Rows that verified draft tokens.", e.spec_num_drafts)
        yield _counter(p + "spec_decode_num_draft_tokens", "Draft tokens verified.", e.spec_num_draft_tokens)
        yield _counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", e.spec_num_accepted_tokens)
        per_pos = CounterMetricFamily(
            p + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position.", labels=["position"]
        )
        for pos, count in enumerate(e.spec_accepted_per_pos):
            per_pos.add_metric([str(pos)], count)
        yield per_pos
        stale = CounterMetricFamily(
            p + "stale_outputs_dropped", "Outputs for tombstoned requests (dropped).", labels=["actor"]
        )
        stale.add_metric([HTTP], m.protocol.stale)
        stale.add_metric([DETOKENIZER], d.stale_outputs_dropped_total)
        yield stale
        violations = CounterMetricFamily(
            p + "protocol_violations",
            "Outputs for unknown ids, duplicates, gaps, past a Finished.",
            labels=["actor", "kind"],
        )
        for kind in ("unknown_id", "duplicate", "gap", "after_finished"):
            violations.add_metric([HTTP, kind], m.protocol.violations[kind])
        violations.add_metric([DETOKENIZER, "any"], d.protocol_violations_total)
        yield violations
        resumes = CounterMetricFamily(
            p + "request_resumes",
            "Requests re-submitted from what their client has, by who re-submitted them and why.",
            labels=["actor", "cause"],
        )
        for cause in ("death", "lost_output"):
            resumes.add_metric([HTTP, cause], m.protocol.resumes[cause])
        resumes.add_metric([DETOKENIZER, "lost_output"], d.repairs_total)
        yield resumes
        tombstones = GaugeMetricFamily(p + "num_tombstones", "Requests aborted, awaiting Finished.", labels=["actor"])
        tombstones.add_metric([HTTP], m.num_tombstones())
        tombstones.add_metric([DETOKENIZER], d.num_tombstones)
        yield tombstones


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)

"""/metrics: Prometheus text, vLLM's metric names under the `sluice:` prefix (`--metrics-prefix vllm:` for
dashboards built for vLLM).

Every series carries vLLM's `model_name` (the served model's name) and `engine` ("0": one engine per server)
labels, which vLLM's dashboards select on; the Metrics object binds them once, so a call site names only the
series' own labels (`metrics.aborts.labels(reason)`).

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


BASE_LABELS = ("model_name", "engine")
ENGINE = "0"  # vLLM's engine index: one engine per server


class _Labelled:
    """A labelled metric with model_name and engine bound: `.labels(reason)` is `.labels(model, engine, reason)`."""

    def __init__(self, metric: Counter, bound: tuple[str, str]):
        self.metric, self.bound = metric, bound

    def labels(self, *values: str):
        return self.metric.labels(*self.bound, *values)


class Metrics:
    def __init__(self, prefix: str = DEFAULT_PREFIX, model_name: str = "") -> None:
        """`prefix`: of every series' name (--metrics-prefix: `vllm:` serves dashboards built for vLLM);
        `model_name`: the served model's (its first name), every series' model_name label."""
        disable_created_metrics()  # no `_created` series (as vLLM); the HTTP process has only this registry
        self.registry = r = CollectorRegistry()
        self.prefix = prefix
        self.bound = (model_name, ENGINE)

        def histogram(name: str, doc: str, buckets):
            return Histogram(prefix + name, doc, BASE_LABELS, buckets=buckets, registry=r).labels(*self.bound)

        def counter(name: str, doc: str, *labels: str) -> _Labelled:
            return _Labelled(Counter(prefix + name, doc, [*BASE_LABELS, *labels], registry=r), self.bound)

        self.request_success = counter(
            "request_success", "Finished requests (per choice) by finish reason.", "finished_reason"
        )
        self.aborts = counter("request_aborts", "Aborts sent to the engine, by reason.", "reason")
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
            "request_max_num_generation_tokens", "Most tokens generated by one of a prompt's n choices.", TOKEN_BUCKETS
        )
        self.params_n = histogram("request_params_n", "n per prompt.", (1, 2, 5, 10, 20))
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens per engine step.", ITERATION_BUCKETS)
        self.http_requests = counter(
            "http_requests", "HTTP responses by endpoint and status code.", "endpoint", "status"
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
        if fin.timings:
            prefill, decode = fin.timings
            self.prefill_time.observe(prefill)
            self.decode_time.observe(decode)
            self.inference_time.observe(prefill + decode)

    def prompt_finished(self, n: int, most_generated: int) -> None:
        """The n choices of one prompt have all ended (vLLM's parallel sampling observes once per prompt, then):
        its n, and the most tokens one of them generated."""
        self.params_n.observe(n)
        self.max_generation.observe(most_generated)

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

    def family(self, kind, name: str, doc: str, labels=(), rows=()):
        """A family whose samples are (the values of `labels`, value) rows, model_name and engine first."""
        family = kind(self.m.prefix + name, doc, labels=[*BASE_LABELS, *labels])
        for values, value in rows:
            family.add_metric([*self.m.bound, *values], value)
        return family

    def gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        return self.family(GaugeMetricFamily, name, doc, rows=[((), value)])

    def counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        return self.family(CounterMetricFamily, name, doc, rows=[((), value)])

    def counters(self, name: str, doc: str, labels, rows) -> CounterMetricFamily:
        return self.family(CounterMetricFamily, name, doc, labels, rows)

    def collect(self):
        e, d, proto = self.m.engine, self.m.detok, self.m.protocol
        if e.cache_config:  # (vLLM's info gauge: 1, the configuration in its labels)
            config = [(list(e.cache_config.values()), 1)]
            yield self.family(
                GaugeMetricFamily, "cache_config_info", "The KV cache's configuration.", e.cache_config, config
            )
        yield self.gauge("num_requests_running", "Requests in the engine's running batch.", e.num_running)
        yield self.gauge("num_requests_waiting", "Requests waiting in the engine.", e.num_waiting)
        yield self.gauge("kv_cache_usage_perc", "KV cache usage (1 = full).", e.kv_usage)
        yield self.counter("prompt_tokens", "Prompt tokens processed.", e.prompt_tokens_total)
        yield self.counter("generation_tokens", "Tokens generated.", e.generation_tokens_total)
        yield self.counter("late_aborts", "Aborts for finished or unknown requests (ignored).", e.late_aborts_total)
        yield self.counter("num_preemptions", "Recompute preemptions.", e.num_preemptions_total)
        resets = "Worker states lost (a death, a lost step): running requests recomputed."
        yield self.counter("worker_resets", resets, e.worker_resets_total)
        ranks = [((str(rank),), int(e.worker_up)) for rank in range(e.worker_ranks)]
        doc = "1 while the worker's rank serves (a tensor-parallel gang's ranks: all or none), 0 while it restarts."
        yield self.family(GaugeMetricFamily, "worker_rank_up", doc, ["rank"], ranks)
        yield self.counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", e.prefix_cache_queries_total
        )
        yield self.counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", e.prefix_cache_hits_total)
        yield self.counter("discarded_samples", "Samples of aborted requests discarded.", e.discarded_samples_total)
        yield self.counter("spec_decode_num_drafts", "Rows that verified draft tokens.", e.spec_num_drafts)
        yield self.counter("spec_decode_num_draft_tokens", "Draft tokens verified.", e.spec_num_draft_tokens)
        yield self.counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", e.spec_num_accepted_tokens)
        per_pos = [((str(pos),), count) for pos, count in enumerate(e.spec_accepted_per_pos)]
        by_pos = "Draft tokens accepted, by position."
        yield self.counters("spec_decode_num_accepted_tokens_per_pos", by_pos, ["position"], per_pos)
        stale = [((HTTP,), proto.stale), ((DETOKENIZER,), d.stale_outputs_dropped_total)]
        yield self.counters("stale_outputs_dropped", "Outputs for tombstoned requests (dropped).", ["actor"], stale)
        kinds = ("unknown_id", "duplicate", "gap", "after_finished")
        violations = [
            *(((HTTP, k), proto.violations[k]) for k in kinds),
            ((DETOKENIZER, "any"), d.protocol_violations_total),
        ]
        bad = "Outputs for unknown ids, duplicates, gaps, past a Finished."
        yield self.counters("protocol_violations", bad, ["actor", "kind"], violations)
        resumes = [
            *(((HTTP, c), proto.resumes[c]) for c in ("death", "lost_output")),
            ((DETOKENIZER, "lost_output"), d.repairs_total),
        ]
        why = "Requests re-submitted from what their client has, by who re-submitted them and why."
        yield self.counters("request_resumes", why, ["actor", "cause"], resumes)
        tombstones = [((HTTP,), self.m.num_tombstones()), ((DETOKENIZER,), d.num_tombstones)]
        yield self.family(
            GaugeMetricFamily, "num_tombstones", "Requests aborted, awaiting Finished.", ["actor"], tombstones
        )

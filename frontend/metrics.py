"""/metrics: Prometheus text, vLLM's metric names under the `sluice:` prefix (`--metrics-prefix vllm:` for
dashboards built for vLLM).

Every series carries vLLM's `model_name` (the served model's name) and `engine` labels, which vLLM's dashboards
select on: `engine` is the engine replica (--data-parallel-size) that served the request or reports the value; the
server's own series (HTTP responses, the HTTP actor's protocol counters, routing) carry engine "0". The Metrics
object binds the model once, so a call site names the engine and the series' own labels
(`metrics.aborts.labels(engine, reason)`).

The HTTP actor's own observations (latencies, finished requests, aborts) are prometheus_client
metrics. The engine's and the detokenizer's totals arrive as absolute values in EngineStats /
DetokStats every stats interval and are exported from the latest snapshot by a collector (a
restarted actor counts from zero again, which Prometheus reads as a counter reset). Protocol
counters carry an `actor` label: the HTTP actor's own and the detokenizer's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from actors.protocol import ProtocolCounts
from actors.routing import Replicas
from frontend.metrics_merge import render, to_wire
from messages.names import DETOKENIZER, HTTP
from messages.sampling_params import SamplingParams
from messages.servers import Family
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
SERVER = 0  # the engine label of the server's own series


class _Labelled:
    """A labelled metric with model_name bound: `.labels(engine, reason)` is `.labels(model, str(engine), reason)`.
    Its children are kept here too (a dict hit, not prometheus_client's lock and label checks: a stream's every token
    observes its inter-token latency); they are never removed."""

    def __init__(self, metric: Counter | Histogram, model: str):
        self.metric, self.model = metric, model
        self.children: dict[tuple, Counter | Histogram] = {}

    def labels(self, engine: int, *values: str):
        key = (engine, *values)
        child = self.children.get(key)
        if child is None:
            child = self.children[key] = self.metric.labels(self.model, str(engine), *values)
        return child


class Metrics:
    def __init__(self, prefix: str = DEFAULT_PREFIX, model_name: str = "", replicas: Replicas | None = None) -> None:
        """`prefix`: of every series' name (--metrics-prefix: `vllm:` serves dashboards built for vLLM);
        `model_name`: the served model's (its first name), every series' model_name label; `replicas`: the HTTP
        actor's view of the engine replicas (their routing)."""
        disable_created_metrics()  # no `_created` series (as vLLM); the HTTP process has only these registries
        self.registry = r = CollectorRegistry()  # what this HTTP server observes itself (summed over the servers)
        self.reported = e = CollectorRegistry()  # the engine's reports: every server has the same (its own shown)
        self.prefix = prefix
        self.model = model_name
        self.replicas = replicas or Replicas()
        self.lora_names: dict[str, str] = {}  # LoRA adapters' served names, by digest (the HTTP actor's)

        def histogram(name: str, doc: str, buckets, registry: CollectorRegistry = r) -> _Labelled:
            metric = Histogram(prefix + name, doc, BASE_LABELS, buckets=buckets, registry=registry)
            labelled = _Labelled(metric, model_name)
            for engine in range(len(self.replicas)):  # (each engine's series from the start, as vLLM)
                labelled.labels(engine)
            return labelled

        def counter(name: str, doc: str, *labels: str) -> _Labelled:
            return _Labelled(Counter(prefix + name, doc, [*BASE_LABELS, *labels], registry=r), model_name)

        self.request_success = counter(
            "request_success", "Finished requests (per choice) by finish reason.", "finished_reason"
        )
        self.aborts = counter("request_aborts", "Aborts sent to the engine, by reason.", "reason")
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Gap between a choice's outputs.", ITL_BUCKETS)
        self.tpot = histogram(
            "request_time_per_output_token_seconds", "A choice's decode time per token after its first.", ITL_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS, e)
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
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens per engine step.", ITERATION_BUCKETS, e)
        self.http_requests = counter(
            "http_requests", "HTTP responses by endpoint and status code.", "endpoint", "status"
        )
        self.protocol = ProtocolCounts()  # the HTTP actor's (its RequestTable counts in it)
        self.num_tombstones: Callable[[], int] = lambda: 0
        # per replica: (engine, restarts of its processes, the seconds left of its back-off): frontend/readiness.py
        self.restarts: Callable[[], list[tuple[int, int, float]]] = lambda: []
        self.num_background_responses: Callable[[], int] = lambda: 0  # (the Responses endpoint's)
        self.engine: dict[int, EngineStats] = {}  # by replica: the latest report (none: all zero)
        self.detok: dict[int, DetokStats] = {}
        r.register(_ServerCounts(self))
        e.register(_Snapshots(self))

    def finished(self, fin: Finished, params: SamplingParams, engine: int) -> None:
        """A choice ended: its sizes and (when the engine timed it) its prefill and decode times."""
        self.request_success.labels(engine, fin.finish_reason).inc()
        self.prompt_tokens.labels(engine).observe(fin.num_prompt_tokens)
        self.generation_tokens.labels(engine).observe(fin.num_output_tokens)
        self.max_tokens.labels(engine).observe(params.max_tokens)
        if fin.timings:
            prefill, decode = fin.timings
            self.prefill_time.labels(engine).observe(prefill)
            self.decode_time.labels(engine).observe(decode)
            self.inference_time.labels(engine).observe(prefill + decode)
            tpot = decode / (fin.num_output_tokens - 1) if fin.num_output_tokens > 1 else 0.0
            self.tpot.labels(engine).observe(tpot)  # (vLLM's: 0 for a single token)

    def prompt_finished(self, n: int, most_generated: int, engine: int) -> None:
        """The n choices of one prompt have all ended (vLLM's parallel sampling observes once per prompt, then):
        its n, and the most tokens one of them generated."""
        self.params_n.labels(engine).observe(n)
        self.max_generation.labels(engine).observe(most_generated)

    def on_engine_stats(self, msg: EngineStats) -> None:
        if not 0 <= msg.replica < len(self.replicas):
            return
        self.engine[msg.replica] = msg
        for t in msg.queue_times_s:
            self.queue_time.labels(msg.replica).observe(t)

    def on_detok_stats(self, msg: DetokStats) -> None:
        if 0 <= msg.replica < len(self.replicas):
            self.detok[msg.replica] = msg
            for n in msg.iteration_tokens:
                self.iteration_tokens.labels(msg.replica).observe(n)

    def forget(self, actor: str) -> None:
        """`actor` died: its gauges read 0 and its counters restart (a counter reset) until it reports again."""
        if (replica := self.replicas.of(actor)) is not None:
            reports = self.detok if actor == replica.names.detokenizer else self.engine
            reports.pop(replica.index, None)

    def lora_label(self, info: dict[str, str], key: str) -> str:
        """A lora_requests_info label: max_lora, or the adapters' served names (EngineStats.lora_info: digests)."""
        value = info.get(key, "")
        return value if key == "max_lora" else ",".join(self.lora_names.get(d, d) for d in value.split(",") if d)

    def own(self) -> list[Family]:
        """The series this server observed itself (what it tells another server rendering /metrics)."""
        return to_wire(self.registry.collect())

    def render(self, others: list[Family] = ()) -> bytes:
        """Every series: this server's own with the other servers' (`others`) summed, and the engine's reports."""
        return render([*self.registry.collect(), *self.reported.collect()], others)


class _Series:
    def __init__(self, metrics: Metrics):
        self.m = metrics

    def family(self, kind, name: str, doc: str, labels=(), rows=()):
        """A family whose samples are ((engine, the values of `labels`...), value) rows (model_name first)."""
        family = kind(self.m.prefix + name, doc, labels=[*BASE_LABELS, *labels])
        for values, value in rows:
            family.add_metric([self.m.model, *map(str, values)], value)
        return family

    def protocol(self, stale, violations, resumes, tombstones):
        """The protocol families: rows of (engine, actor, [kind or cause,] value)."""
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        rows = [((k, actor), n) for k, actor, n in stale]
        yield self.family(counter, "stale_outputs_dropped", "Outputs for tombstoned requests (dropped).", ["actor"],
                          rows)  # fmt: skip
        bad = "Outputs for unknown ids, duplicates, gaps, past a Finished."
        yield self.family(counter, "protocol_violations", bad, ["actor", "kind"], violations)
        why = "Requests re-submitted from what their client has, by who re-submitted them and why."
        yield self.family(counter, "request_resumes", why, ["actor", "cause"], resumes)
        rows = [((k, actor), n) for k, actor, n in tombstones]
        yield self.family(gauge, "num_tombstones", "Requests aborted, awaiting Finished.", ["actor"], rows)


class _Snapshots(_Series):
    """Exports each replica's engine and detokenizer latest totals (the engine's reports)."""

    def per_engine(self, kind, name: str, doc: str, value: Callable[[EngineStats], float]):
        return self.family(kind, name, doc, rows=[((k,), value(e)) for k, e in self.engines()])

    def engines(self) -> list[tuple[int, EngineStats]]:
        return [(k, self.m.engine.get(k, NO_ENGINE_STATS)) for k in range(len(self.m.replicas))]

    def collect(self):
        m, engines = self.m, self.engines()
        detoks = [(k, m.detok.get(k, NO_DETOK_STATS)) for k in range(len(m.replicas))]
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        configs = [((k, *e.cache_config.values()), 1) for k, e in engines if e.cache_config]
        if configs:  # (vLLM's info gauge: 1, the configuration in its labels)
            keys = list(next(e.cache_config for _, e in engines if e.cache_config))
            yield self.family(gauge, "cache_config_info", "The KV cache's configuration.", keys, configs)
        if loras := [(k, e.lora_info) for k, e in engines if e.lora_info]:  # (vLLM's: the time, adapters in labels)
            keys = ["max_lora", "waiting_lora_adapters", "running_lora_adapters"]
            rows = [((k, *(m.lora_label(info, key) for key in keys)), time.time()) for k, info in loras]
            yield self.family(gauge, "lora_requests_info", "Running and waiting LoRA adapters.", keys, rows)
            for name, doc in (("loads", "read from disk into a slot"), ("evictions", "evicted from their slots")):
                rows = [((k,), int(info.get(name, 0))) for k, info in loras]
                yield self.family(counter, f"lora_{name}", f"LoRA adapters {doc}.", rows=rows)
        yield self.per_engine(gauge, "num_requests_running", "Requests in the engine's running batch.",
                              lambda e: e.num_running)  # fmt: skip
        yield self.per_engine(gauge, "num_requests_waiting", "Requests waiting in the engine.", lambda e: e.num_waiting)
        yield self.per_engine(gauge, "kv_cache_usage_perc", "KV cache usage (1 = full).", lambda e: e.kv_usage)
        for name, doc, value in ENGINE_COUNTERS:
            yield self.per_engine(counter, name, doc, value)
        yield self.family(counter, "prompt_tokens", "Prompt tokens processed.",
                          rows=[((k,), d.prompt_tokens_total) for k, d in detoks])  # fmt: skip
        yield self.family(counter, "generation_tokens", "Tokens generated (given to requests).",
                          rows=[((k,), d.generation_tokens_total) for k, d in detoks])  # fmt: skip
        ranks = [((k, rank), int(e.worker_up)) for k, e in engines for rank in range(e.worker_ranks)]
        doc = "1 while the worker's rank serves (a tensor-parallel gang's ranks: all or none), 0 while it restarts."
        yield self.family(gauge, "worker_rank_up", doc, ["rank"], ranks)
        per_pos = [((k, pos), count) for k, e in engines for pos, count in enumerate(e.spec_accepted_per_pos)]
        by_pos = "Draft tokens accepted, by position."
        yield self.family(counter, "spec_decode_num_accepted_tokens_per_pos", by_pos, ["position"], per_pos)
        restarts = m.restarts()
        doc = "Restarts of the engine replica's processes (the supervisor's count)."
        yield self.family(counter, "engine_restarts", doc, rows=[((k,), n) for k, n, _ in restarts])
        doc = "Seconds left of the engine replica's restart back-off (past its restart intensity; else 0)."
        yield self.family(gauge, "engine_restart_backoff_seconds", doc, rows=[((k,), s) for k, _, s in restarts])
        serving = [((r.index,), int(r.serves)) for r in m.replicas.all]
        yield self.family(gauge, "dp_engine_serving", "1 while the engine replica is routed to, 0 while down.",
                          rows=serving)  # fmt: skip
        yield from self.protocol(
            [(k, DETOKENIZER, d.stale_outputs_dropped_total) for k, d in detoks],
            [((k, DETOKENIZER, "any"), d.protocol_violations_total) for k, d in detoks],
            [((k, DETOKENIZER, "lost_output"), d.repairs_total) for k, d in detoks],
            [(k, DETOKENIZER, d.num_tombstones) for k, d in detoks],
        )


class _ServerCounts(_Series):
    """Exports the HTTP server's protocol and routing counters (every server's are summed: frontend/http_servers.py)."""

    def collect(self):
        m, proto = self.m, self.m.protocol
        routed = [((SERVER, *key), n) for key, n in sorted(m.replicas.routed.items())]
        doc = "Requests routed to an engine replica, by policy and reason (actors/routing.py)."
        yield self.family(CounterMetricFamily, "dp_routed", doc, ["policy", "reason"], routed)
        yield from self.protocol(
            [(SERVER, HTTP, proto.stale)],
            [((SERVER, HTTP, k), proto.violations[k]) for k in ("unknown_id", "duplicate", "gap", "after_finished")],
            [((SERVER, HTTP, c), proto.resumes[c]) for c in ("death", "lost_output")],
            [(SERVER, HTTP, m.num_tombstones())],
        )
        background = [((SERVER,), m.num_background_responses())]
        yield self.family(GaugeMetricFamily, "num_background_responses", "Background responses not yet ended.",
                          rows=background)  # fmt: skip


ENGINE_COUNTERS: list[tuple[str, str, Callable[[EngineStats], float]]] = [  # (name, doc, value), one row per engine
    ("late_aborts", "Aborts for finished or unknown requests (ignored).", lambda e: e.late_aborts_total),
    ("num_preemptions", "Recompute preemptions.", lambda e: e.num_preemptions_total),
    ("worker_resets", "Worker states lost (a death, a lost step): running requests recomputed.",
     lambda e: e.worker_resets_total),
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", lambda e: e.prefix_cache_queries_total),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", lambda e: e.prefix_cache_hits_total),
    ("discarded_samples", "Samples of aborted requests discarded.", lambda e: e.discarded_samples_total),
    ("spec_decode_num_drafts", "Rows that verified draft tokens.", lambda e: e.spec_num_drafts),
    ("spec_decode_num_draft_tokens", "Draft tokens verified.", lambda e: e.spec_num_draft_tokens),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", lambda e: e.spec_num_accepted_tokens),
]  # fmt: skip

"""Writes docs/grafana/sluice.json: a Grafana dashboard of Sluice's /metrics (as vLLM ships one for its own), for a
Prometheus data source that scrapes the server. Every panel filters on the `model_name` variable and shows each engine
replica (`engine` label) apart where that reads better.

    python scripts/grafana_dashboard.py          # rewrite the file
    python scripts/grafana_dashboard.py --check  # exit 1 if the file is not what this writes (tests run this)

The file is generated so it cannot drift from the series' names: tests/test_grafana.py checks that every series a
panel queries is exported by a running server.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PATH = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "sluice.json"
SEL = '{model_name="$model_name"}'


def rate(name: str, by: str = "engine", window: str = "1m") -> str:
    return f"sum by ({by}) (rate(sluice:{name}{SEL}[{window}]))"


def quantiles(name: str) -> list[tuple[str, str]]:
    return [
        (f"p{int(q * 100)}", f"histogram_quantile({q}, sum by (le) (rate(sluice:{name}_bucket{SEL}[1m])))")
        for q in (0.5, 0.9, 0.99)
    ] + [("mean", f"sum(rate(sluice:{name}_sum{SEL}[1m])) / sum(rate(sluice:{name}_count{SEL}[1m]))")]


PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [  # (title, unit, [(legend, PromQL)])
    ("Token throughput", "short", [("prompt tok/s {{engine}}", rate("prompt_tokens_total")),
                                   ("generation tok/s {{engine}}", rate("generation_tokens_total"))]),
    ("Requests running and waiting", "short", [("running {{engine}}", f"sluice:num_requests_running{SEL}"),
                                               ("waiting {{engine}}", f"sluice:num_requests_waiting{SEL}")]),
    ("Time to first token", "s", quantiles("time_to_first_token_seconds")),
    ("Time per output token (TPOT)", "s", quantiles("request_time_per_output_token_seconds")),
    ("Inter-token latency", "s", quantiles("inter_token_latency_seconds")),
    ("End-to-end request latency", "s", quantiles("e2e_request_latency_seconds")),
    ("Queue time", "s", quantiles("request_queue_time_seconds")),
    ("KV cache usage", "percentunit", [("{{engine}}", f"sluice:kv_cache_usage_perc{SEL}")]),
    ("Prefix cache hit rate", "percentunit", [("{{engine}}", f"{rate('prefix_cache_hits_total', window='5m')} / "
                                                             f"{rate('prefix_cache_queries_total', window='5m')}")]),
    ("Speculative decoding acceptance", "percentunit", [
        ("{{engine}}", f"{rate('spec_decode_num_accepted_tokens_total', window='5m')} / "
                       f"{rate('spec_decode_num_draft_tokens_total', window='5m')}")]),
    ("Finished requests by reason", "reqps", [("{{finished_reason}}", rate("request_success_total", "finished_reason"))]),
    ("Aborts by reason", "reqps", [("{{reason}}", rate("request_aborts_total", "reason"))]),
    ("Recoveries: resumes, worker resets, preemptions", "short", [
        ("resumed by {{actor}} ({{cause}})", rate("request_resumes_total", "actor, cause", "5m")),
        ("worker resets {{engine}}", rate("worker_resets_total", window="5m")),
        ("preemptions {{engine}}", rate("num_preemptions_total", window="5m"))]),
    ("Engine replicas serving", "short", [("{{engine}}", f"sluice:dp_engine_serving{SEL}")]),
    ("HTTP responses by status", "reqps", [("{{status}}", rate("http_requests_total", "status"))]),
    ("Protocol repairs: stale outputs and violations", "short", [
        ("stale {{actor}}", rate("stale_outputs_dropped_total", "actor", "5m")),
        ("violations {{actor}}", rate("protocol_violations_total", "actor", "5m"))]),
]  # fmt: skip


def dashboard() -> dict:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title,
            "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(65 + j), "expr": expr, "legendFormat": legend}
                        for j, (legend, expr) in enumerate(targets)],
        })  # fmt: skip
    model = {
        "name": "model_name", "type": "query", "label": "model",
        "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"},
        "query": "label_values(sluice:num_requests_running, model_name)", "refresh": 1, "current": {},
    }  # fmt: skip
    source = {"name": "DS_PROMETHEUS", "type": "datasource", "label": "Prometheus", "query": "prometheus"}
    return {
        "title": "Sluice", "uid": "sluice-overview", "schemaVersion": 39, "version": 1, "editable": True,
        "time": {"from": "now-30m", "to": "now"}, "refresh": "10s", "tags": ["sluice", "llm"],
        "templating": {"list": [source, model]}, "panels": panels,
    }  # fmt: skip


def text() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    if "--check" in sys.argv:
        sys.exit(0 if PATH.read_text() == text() else 1)
    PATH.write_text(text())
    print(f"wrote {PATH}")

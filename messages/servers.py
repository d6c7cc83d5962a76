"""Between the HTTP servers of --api-server-count (frontend/http_servers.py): server 0 is the one that loads and
unloads LoRA adapters while serving and answers /metrics, for which it asks the others for their own series."""

from __future__ import annotations

import msgspec

from messages.wire import Msg, Query, Reply


class Family(msgspec.Struct, array_like=True):
    """A Prometheus metric family a server observed itself (not the engine's reports, which every server has)."""

    name: str
    doc: str
    kind: str  # counter, gauge, histogram (prometheus_client's Metric.type)
    samples: list[tuple[str, dict[str, str], float]]  # (sample name, labels, value)


class MetricsQuery(Query, kw_only=True):
    """HTTP server -> another: its own series, now."""


class MetricsReport(Reply, kw_only=True):
    families: list[Family] = []
    incarnation: int = 0  # the reporting process's (random): a report of one that died is not taken


class ServedLora(msgspec.Struct, kw_only=True):
    """An adapter served by name (actors/engine/config.py LoraModule's fields)."""

    name: str
    path: str
    digest: str
    base_model_name: str | None = None


class LorasServed(Query, kw_only=True):
    """HTTP server 0 -> the others: the adapters served by name, after each runtime load or unload, and to a server
    that (re)started. The whole set, so a late or repeated message changes nothing."""

    modules: list[ServedLora] = []


class LorasTaken(Reply, kw_only=True):
    """-> server 0: the adapters are served here too (it answers the load or unload once every server took them)."""


SERVER_TYPES: tuple[type[Msg], ...] = (MetricsQuery, MetricsReport, LorasServed, LorasTaken)

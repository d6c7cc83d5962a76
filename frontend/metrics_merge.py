"""/metrics over several HTTP servers (frontend/http_servers.py): the families of every server in one exposition, a
family's samples of the same name and labels summed."""

from __future__ import annotations

from prometheus_client import Metric, generate_latest
from prometheus_client.samples import Sample

from messages.servers import Family


def to_wire(families: list[Metric]) -> list[Family]:
    return [Family(m.name, m.documentation, m.type, [s[:3] for s in m.samples]) for m in families]


def render(own: list[Metric], others: list[Family]) -> bytes:
    """Prometheus text of `own` families and the other servers' `others`: samples with the same name and labels are
    summed (counters, histograms' buckets, counts and sums, and the servers' gauges alike: each one's share)."""
    out: dict[str, tuple[Metric, dict]] = {}
    for name, doc, kind, samples in [(m.name, m.documentation, m.type, m.samples) for m in own] + [
        (f.name, f.doc, f.kind, f.samples) for f in others
    ]:
        metric, values = out.get(name) or out.setdefault(name, (Metric(name, doc, kind), {}))
        for sample in samples:
            sample_name, labels, value = sample[:3]
            key = (sample_name, tuple(sorted(labels.items())))
            before = values.get(key)
            values[key] = (sample_name, labels, value + (before[2] if before else 0.0))
    for metric, values in out.values():
        metric.samples = [Sample(n, labels, v) for n, labels, v in values.values()]
    return generate_latest(_Families([metric for metric, _ in out.values()]))


class _Families:
    """A registry's face (generate_latest's argument) over families already collected."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families

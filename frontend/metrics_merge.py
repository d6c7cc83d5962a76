"""/metrics over several HTTP servers (frontend/http_servers.py): the families of every server in one exposition, a
family's samples of the same name and labels summed. Server 0 keeps the others' last reports (a server late to answer
counts as it last did) and, once one dies, its counters and histograms as they last were, carried on: a sum that
goes down only if server 0 itself restarts (as one server's counters do) or cannot be reached (the server called then
answers with what it has, until server 0 is back). What a server counted after its last report is lost with it."""

from __future__ import annotations

from prometheus_client import Metric, generate_latest
from prometheus_client.samples import Sample

from messages.servers import Family, MetricsReport


def to_wire(families: list[Metric]) -> list[Family]:
    return [Family(m.name, m.documentation, m.type, [s[:3] for s in m.samples]) for m in families]


class OtherServers:
    def __init__(self):
        self.last: dict[str, MetricsReport] = {}  # by server: its latest report
        self.dead: set[int] = set()  # incarnations that died (a report of theirs still on its way is not taken)
        self.carried: list[Family] = []  # the counters and histograms of the servers' dead incarnations, summed

    def reported(self, server: str, report: MetricsReport) -> None:
        if report.incarnation not in self.dead:
            self.last[server] = report

    def died(self, server: str) -> None:
        if (report := self.last.pop(server, None)) is not None:
            self.dead.add(report.incarnation)
            kept = [f for f in report.families if f.kind != "gauge"]  # (a dead server holds nothing now)
            self.carried = to_wire(merged([], [*self.carried, *kept]))

    def families(self) -> list[Family]:
        return [*self.carried, *(f for report in self.last.values() for f in report.families)]


def render(own: list[Metric], others: list[Family]) -> bytes:
    """Prometheus text of `own` families and the other servers' `others`."""
    return generate_latest(_Families(merged(own, others)))


def merged(own: list[Metric], others: list[Family]) -> list[Metric]:
    """`own` and `others` in one list of families: samples with the same name and labels are summed (counters,
    histograms' buckets, counts and sums, and the servers' gauges alike: each one's share)."""
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
    return [metric for metric, _ in out.values()]


class _Families:
    """A registry's face (generate_latest's argument) over families already collected."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families

"""The Grafana dashboard (docs/grafana/sluice.json) is what scripts/grafana_dashboard.py writes, and every series its
panels query exists on a running server (the shared one), with every label a panel groups or selects by."""

from __future__ import annotations

import json
import re

from prometheus_client.parser import text_string_to_metric_families

from scripts.grafana_dashboard import PATH, text

SERIES = re.compile(r"(sluice:[A-Za-z0-9_:]+)")
GROUPED = re.compile(r"sum by \(([^)]*)\) \(rate\((sluice:[A-Za-z0-9_:]+)")


def test_the_file_is_generated():
    assert PATH.read_text() == text(), "run: python scripts/grafana_dashboard.py"


async def test_every_series_and_label_a_panel_queries_exists(server):
    client = server.client()  # a request, and one aborted: every series has samples
    aborts = await server.metric("sluice:request_aborts_total", reason="client")
    await client.completions.create(model=None, prompt="Hello", max_tokens=2)
    stream = await client.completions.create(model=None, prompt="Hi", max_tokens=400, stream=True,
                                             extra_body={"ignore_eos": True})  # fmt: skip
    async for _ in stream:
        break
    await stream.close()
    await server.wait_metrics({("sluice:request_aborts_total", (("reason", "client"),)): aborts + 1})
    async with server.session() as s, s.get("/metrics") as resp:
        samples = [x for f in text_string_to_metric_families(await resp.text()) for x in f.samples]
    labels: dict[str, set[str]] = {}
    for x in samples:
        labels.setdefault(x.name, set()).update(x.labels)
    board = json.loads(PATH.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    queried = {name for e in exprs for name in SERIES.findall(e)}
    assert len(queried) >= 20 and not queried - set(labels), sorted(queried - set(labels))
    for e in exprs:
        for by, name in GROUPED.findall(e):
            assert {label.strip() for label in by.split(",")} <= labels[name], (name, by)
    assert all("model_name" in labels[name] for name in queried)

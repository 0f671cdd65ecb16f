"""The Grafana dashboard: in sync with its generator, and every metric it queries is one the components export."""

from __future__ import annotations

import json
import re
from pathlib import Path

from mixplane.metrics import make_metrics
from mixplane.operator.dashboard import PANELS, all_queries, dashboard_json

REPO = Path(__file__).resolve().parents[2]
CHART_DASHBOARD = REPO / "charts" / "mixplane" / "dashboards" / "mixplane.json"


def test_chart_dashboard_in_sync():
    assert CHART_DASHBOARD.read_text() == dashboard_json(), \
        "regenerate: python -m mixplane.operator.dashboard > charts/mixplane/dashboards/mixplane.json"


def exported_names() -> set[str]:
    names = set()
    for component in ("planner", "loader", "constructor"):
        for fam in make_metrics(component).registry.collect():
            for s in fam.samples:
                names.add(s.name)
            names.add(fam.name)
            if fam.type == "counter":
                names.add(fam.name + "_total")
            if fam.type == "histogram":
                names.update({fam.name + "_bucket", fam.name + "_sum", fam.name + "_count"})
    return names


def test_every_queried_metric_is_exported():
    have = exported_names()
    used = {m for q in all_queries() for m in re.findall(r"\b((?:mixplane|process)_[a-z_]+)\b", q)}
    assert used, "the dashboard queries mixplane metrics"
    missing = sorted(used - have)
    assert not missing, f"dashboard queries metrics no component exports: {missing}"


def test_the_panels_the_issue_asks_for():
    titles = {p.title for p in PANELS}
    for want in ("Tokens read per source", "Realised vs target weight", "Loader window depth", "Plan latency",
                 "Rank imbalance", "Quarantined pages", "Quarantined samples", "Memory per component",
                 "Source Loaders per source"):
        assert want in titles
    d = json.loads(dashboard_json())
    assert all(p["targets"] and p["datasource"]["uid"] == "${datasource}" for p in d["panels"])
    assert len({p["id"] for p in d["panels"]}) == len(d["panels"])

"""The Grafana dashboard of a mixplane deployment, generated from one list of panels.

Pure: the panel list in, dashboard JSON out. The Helm chart ships the result
(charts/mixplane/dashboards/mixplane.json, regenerate with `python -m mixplane.operator.dashboard`); a test
keeps it in sync and runs every query against a real Prometheus scraping a real run. Every metric comes from
mixplane.metrics, so the names cannot drift from what the components export.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

# counters that only get a series once something happens: shown as 0 per source until then
_ZERO_PER_SOURCE = "(sum by (source) (mixplane_loader_buffer_samples) * 0)"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    queries: tuple[Query, ...]
    description: str = ""


PANELS: tuple[Panel, ...] = (
    Panel("Tokens planned per source", "short", (
        Query("sum by (source) (rate(mixplane_planner_tokens_total[1m]))", "{{source}}"),),
        "Tokens per second the planner schedules from each source (the trainer's consumption)."),
    Panel("Tokens read per source", "short", (
        Query("sum by (source) (rate(mixplane_loader_tokens_total[1m]))", "{{source}}"),),
        "Tokens per second the Source Loaders read and transform (supply)."),
    Panel("Realised vs target weight", "percentunit", (
        Query("max by (source) (mixplane_planner_realized_fraction)", "{{source}} realised"),
        Query("max by (source) (mixplane_planner_target_fraction)", "{{source}} target")),
        "Share of each source in the current phase: realised by the planner vs the mixture's target."),
    Panel("Loss per source", "short", (
        Query("max by (source) (mixplane_planner_source_loss)", "{{source}}"),),
        "Mean token loss of each source in the trainer ranks' newest reports (MixtureLoader.report_loss): read it beside "
        "the realised weights, e.g. to see what a mixture change or an adaptive mixture does to each source."),
    Panel("Loader window depth", "short", (
        Query("sum by (source) (mixplane_planner_window_samples)", "{{source}} window (planner)"),
        Query("sum by (source) (mixplane_loader_buffer_samples)", "{{source}} read buffer (loaders)")),
        "Samples visible to the planner per source, and samples held in the loaders' read buffers."),
    Panel("Plan latency", "s", (
        Query("histogram_quantile(0.5, sum by (le) (rate(mixplane_planner_plan_seconds_bucket[1m])))", "p50"),
        Query("histogram_quantile(0.99, sum by (le) (rate(mixplane_planner_plan_seconds_bucket[1m])))", "p99")),
        "Time to plan one step."),
    Panel("Rank imbalance", "short", (
        Query("max by (part) (mixplane_planner_rank_imbalance)", "{{part}}"),),
        "The balancer's max / mean cost across ranks of the last step (1 = perfectly balanced)."),
    Panel("Quarantined pages", "short", (
        Query(f"sum by (source) (mixplane_loader_quarantined_pages_total) or {_ZERO_PER_SOURCE}", "{{source}}"),),
        "Bad pages, row groups or files skipped since the loaders started (most are found when a file is opened)."),
    Panel("Quarantined samples", "short", (
        Query(f"sum by (source) (mixplane_loader_quarantined_samples_total) or {_ZERO_PER_SOURCE}", "{{source}}"),),
        "Samples a transform could not decode (e.g. a broken image) since the loaders started."),
    Panel("Memory per component", "bytes", (
        Query("max by (component, instance) (process_resident_memory_bytes"
              " * on (instance, job) group_left (component) mixplane_component_info)", "{{component}} {{instance}}"),),
        "Resident memory of each component process."),
    Panel("Source Loaders per source", "short", (
        Query("count by (source) (mixplane_loader_buffer_samples)", "{{source}}"),),
        "Source Loaders (loader pods, one per partition unless grouped) serving each source."),
    Panel("Step and phase", "short", (
        Query("max(mixplane_planner_step)", "step"),
        Query("max(mixplane_planner_phase)", "phase")),
        "Last planned step and the mixture phase it belongs to."),
    Panel("Client wait", "s", (
        Query("histogram_quantile(0.99, sum by (le) (rate(mixplane_constructor_client_wait_seconds_bucket[1m])))", "p99"),),
        "How long trainer requests waited for their step at the constructors (data stalls)."),
)


def all_queries() -> list[str]:
    return [q.expr for p in PANELS for q in p.queries]


def dashboard() -> dict:
    panels = []
    for i, p in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": p.title, "description": p.description,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(ord("A") + j), "expr": q.expr, "legendFormat": q.legend,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}} for j, q in enumerate(p.queries)],
        })
    return {
        "uid": "mixplane", "title": "mixplane", "tags": ["mixplane", "training", "data"],
        "timezone": "utc", "schemaVersion": 39, "version": 1, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}]},
        "panels": panels,
    }


def dashboard_json() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":  # pragma: no cover - regeneration helper
    sys.stdout.write(dashboard_json())

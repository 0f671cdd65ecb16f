"""The planner's per-step metrics (server.StepMetrics): the series a step updates, with the values the
per-call `labels()` loop set."""

from __future__ import annotations

import numpy as np

from mixplane.metrics import make_metrics
from mixplane.planner.core import StepPlanner
from mixplane.planner.server import StepMetrics

from .planner_helpers import fill, make_spec


def _value(m, name: str, **labels) -> float:
    got = m.registry.get_sample_value(name, labels)
    assert got is not None, (name, labels)
    return got


def test_step_metrics_per_source_and_window():
    spec = make_spec(sources=3, replicas=2, rows=8, seq_len=128, window=16, weights={"s0": 1, "s1": 2, "s2": 0})
    planner = StepPlanner(spec)
    m = make_metrics("planner")
    sm = StepMetrics(m, spec.source_names(), planner.windows)
    tokens = np.zeros(3)
    samples = np.zeros(3)
    for step in range(4):
        fill(planner)
        plan = planner.plan()
        probs = planner.schedule.at(step).probs
        sm.record(plan, probs, planner.sampler.realized)
        tokens += plan.tokens_by_source
        samples += plan.samples_by_source
        realized = planner.sampler.realized
        lay = plan.layout
        assert _value(m, "mixplane_planner_steps_planned_total") == step + 1
        assert _value(m, "mixplane_planner_step") == step
        assert _value(m, "mixplane_planner_packing_efficiency") == lay.row_fill().sum() / float(lay.rows * lay.seq_len)
        for i, name in enumerate(spec.source_names()):
            assert _value(m, "mixplane_planner_tokens_total", source=name) == tokens[i]
            assert _value(m, "mixplane_planner_samples_total", source=name) == samples[i]
            assert _value(m, "mixplane_planner_target_fraction", source=name) == float(probs[i])
            assert _value(m, "mixplane_planner_realized_fraction", source=name) == float(realized[i] / realized.sum())
        for w in planner.windows:
            got = _value(m, "mixplane_planner_window_samples", source=spec.source_names()[w.source], replica=str(w.replica))
            assert got == len(w)


def test_source_series_scrape_text():
    """What Prometheus reads: nothing per source before the first step, then one typed family per series."""
    from prometheus_client import generate_latest

    spec = make_spec(sources=2, replicas=1, rows=4, seq_len=64, window=8)
    planner = StepPlanner(spec)
    m = make_metrics("planner")
    sm = StepMetrics(m, spec.source_names(), planner.windows)
    assert b'mixplane_planner_tokens_total{source=' not in generate_latest(m.registry)
    fill(planner)
    plan = planner.plan()
    sm.record(plan, planner.schedule.at(0).probs, planner.sampler.realized)
    text = generate_latest(m.registry).decode()
    assert "# TYPE mixplane_planner_tokens_total counter" in text
    assert "# HELP mixplane_planner_window_samples Samples visible in a loader replica's window" in text
    for name in spec.source_names():
        assert f'mixplane_planner_tokens_total{{source="{name}"}} ' in text
        assert f'mixplane_planner_window_samples{{replica="0",source="{name}"}} ' in text

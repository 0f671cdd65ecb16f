"""Runtime changes of the planner: elastic resharding to a new topology and the buffer summary."""

from __future__ import annotations

import numpy as np
import pytest

from mixplane.planner.core import StepPlanner, check_coverage
from mixplane.planner.strategies import resolve_strategy

from .planner_helpers import fill, make_spec, run

MODEL = {"backbone": {"hidden": 512, "layers": 4, "heads": 8, "vocab": 1000}}


def test_reconfigure_to_a_new_topology_keeps_the_stream_and_the_mix():
    a = make_spec(dp=2, rows=16, microbatches=2, strategy="llm_balance", model=MODEL)
    b = make_spec(dp=4, tp=2, rows=16, microbatches=2, strategy="llm_balance", model=MODEL)
    planner = StepPlanner(a, resolve_strategy(a))
    first = run(planner, 3)
    planner.reconfigure(b, generation=1)
    planner.strategy = resolve_strategy(b)
    after = run(planner, 3)
    assert planner.tree.backbone.dp == 4 and planner.tree.world == 8
    for p in after:
        assert p.layout.dp == 4 and p.layout.rows_per_rank == 4
        check_coverage(p.layout, p.pieces)
    # nothing is delivered twice across the change
    seen = set()
    for p in first + after:
        for k in zip(p.pieces.source.tolist(), p.pieces.key.tolist(), p.pieces.start.tolist()):
            assert k not in seen
            seen.add(k)
    with pytest.raises(ValueError, match="sources"):
        planner.reconfigure(make_spec(sources=2), generation=2)


def test_summary_buffer_counts_what_the_windows_hold():
    spec = make_spec(sources=2, replicas=2)
    planner = StepPlanner(spec)
    fill(planner)
    summ = planner.summary_buffer()
    assert set(summ) == {"s0", "s1"} and summ["s0"]["replicas"] == 2
    for name, si in (("s0", 0), ("s1", 1)):
        ws = [w for w in planner.windows if w.source == si]
        assert summ[name]["samples"] == sum(len(w) for w in ws)
        assert summ[name]["tokens"] == sum(int((w.tokens - w.done).sum()) for w in ws)

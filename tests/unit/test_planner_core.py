"""The planner core: windows, mixing + packing into rows, and exact resume from a cursor."""

from __future__ import annotations

import numpy as np
import pytest

from mixplane.planner.core import StepPlanner

from mixplane.planner.windows import ReplicaWindow, WindowError
from mixplane.spec import parse_spec

from .planner_helpers import fill

MEANS = (60, 150, 900)  # the third source has documents longer than seq_len


def make_spec(**batch):
    return parse_spec({
        "sources": [{"name": n, "uri": f"/x/{n}", "kind": "tokens", "columns": ["t"]} for n in ("a", "b", "c")],
        "mixture": {"weights": {"a": 0.5, "b": 0.3, "c": 0.2},
                    "phases": [{"start_step": 6, "weights": {"a": 0.1, "c": 0.7}, "lr_scale": 0.5}]},
        "batch": {"sequences": 8, "seq_len": 256, "microbatches": 2, **batch},
        "topology": {"modules": {"backbone": {"dp": 2}}}, "strategy": {"name": "vanilla"},
        "runtime": {"window": 16},
    })


def sample_len(source: int, pos: int) -> int:
    return int(np.random.default_rng([source, pos]).lognormal(np.log(MEANS[source]), 0.8)) + 1


def meta(source: int, replica: int, pos: np.ndarray, seq_len: int):
    """Stream position p of a source holds sample p + 1000 * source of length sample_len(source, p)."""
    return pos + 1000 * source, np.array([sample_len(source, int(p)) for p in pos], np.int64), np.zeros(len(pos), np.int64)


def run(planner: StepPlanner, steps: int):
    out = []
    for _ in range(steps):
        fill(planner, meta=meta)  # what the loaders do: the shortest unconsumed stream prefix that fills
        out.append(planner.plan())
    return out


def test_plan_needs_full_windows():
    p = StepPlanner(make_spec())
    with pytest.raises(RuntimeError, match="windows not full"):
        p.plan()


def test_every_piece_lands_once_and_rows_are_full():
    plans = run(StepPlanner(make_spec()), 12)
    seen = set()
    for plan in plans:
        lay = plan.layout
        lay.validate()
        assert lay.rows == 8 and lay.seq_len == 256
        spans = list(zip(lay.seg_source.tolist(), lay.seg_key.tolist(), lay.seg_start.tolist()))
        assert len(spans) == len(set(spans)) == len(plan.pieces)
        assert not seen & set(spans), "a span was delivered twice"
        seen |= set(spans)
        assert lay.row_fill().sum() / (8 * 256) > 0.95
    # split documents continue exactly where the previous piece ended
    by_doc: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for plan in plans:
        lay = plan.layout
        for s, k, st, ln in zip(lay.seg_source, lay.seg_key, lay.seg_start, lay.seg_len):
            by_doc.setdefault((int(s), int(k)), []).append((int(st), int(ln)))
    for pieces in by_doc.values():
        pieces.sort()
        for (s0, l0), (s1, _) in zip(pieces, pieces[1:]):
            assert s1 == s0 + l0


def test_phase_and_lr_scale_travel_with_the_layout():
    plans = run(StepPlanner(make_spec()), 8)
    assert [p.layout.phase for p in plans] == [0] * 6 + [1] * 2
    assert [p.layout.lr_scale for p in plans] == [1.0] * 6 + [0.5] * 2


def test_token_fractions_track_targets_per_phase():
    plans = run(StepPlanner(make_spec(sequences=32)), 40)
    early = sum(p.tokens_by_source for p in plans[:6])
    late = sum(p.tokens_by_source for p in plans[6:])
    assert np.allclose(early / early.sum(), [0.5, 0.3, 0.2], atol=0.02)
    assert np.allclose(late / late.sum(), np.array([0.1, 0.3, 0.7]) / 1.1, atol=0.01)


def test_resume_from_cursor_equals_uninterrupted_run():
    full = run(StepPlanner(make_spec()), 10)
    first = StepPlanner(make_spec())
    part = run(first, 4)
    cursor = first.cursor()
    resumed = StepPlanner(make_spec())
    resumed.restore(cursor)
    rest = run(resumed, 6)
    for a, b in zip(full, part + rest):
        for name in ("seg_row", "seg_source", "seg_key", "seg_start", "seg_len"):
            assert np.array_equal(getattr(a.layout, name), getattr(b.layout, name)), (a.layout.step, name)
        assert a.layout.phase == b.layout.phase


def test_window_rejects_inconsistent_metadata():
    w = ReplicaWindow(0, 0, 4, 100, 6)
    w.add(np.array([0, 1]), np.array([10, 11]), np.array([5, 6]), np.array([0, 0]))
    with pytest.raises(WindowError, match="out of order"):
        w.add(np.array([1]), np.array([11]), np.array([5]), np.array([0]))
    with pytest.raises(WindowError, match="no tokens"):
        w.add(np.array([2]), np.array([12]), np.array([0]), np.array([0]))
    with pytest.raises(WindowError, match="beyond a full window"):
        w.add(np.array([2, 3, 4]), np.array([1, 2, 3]), np.array([50, 50, 1]), np.array([0, 0, 0]))
    w.add(np.array([2, 3]), np.array([1, 2]), np.array([50, 50]), np.array([0, 0]))
    assert w.ready and w.unconsumed_tokens == 111


def test_a_window_refuses_metadata_arrays_of_another_shape_and_keeps_planning():
    """A LOADER_META whose key or patches array has the right length but two dimensions is refused when it
    arrives (the server answers a WindowError as a WireError), instead of being kept and failing every later
    step's gather of the window store."""
    planner = StepPlanner(make_spec())
    w = planner.windows[0]
    one = {"pos": np.arange(2), "key": np.arange(2), "tokens": np.full(2, 10), "patches": np.zeros(2, np.int64)}
    for name, bad in (("key", np.zeros((2, 2), np.int64)), ("patches", np.zeros((2, 3), np.int64)),
                      ("tokens", np.ones((2, 1), np.int64)), ("pos", np.zeros((2, 1), np.int64)), ("key", np.int64(3))):
        with pytest.raises(WindowError, match="one-dimensional"):
            w.add(**{**one, name: bad})
        assert len(w) == 0
    run(planner, 2)  # nothing was kept: the planner plans on


def test_truncate_policy_consumes_whole_documents():
    plans = run(StepPlanner(make_spec(overlong="truncate")), 5)
    for plan in plans:
        assert np.all(plan.layout.seg_start == 0) and np.all(plan.layout.seg_len <= 256)


def test_the_window_store_refuses_to_compact_windows_it_does_not_hold():
    """WindowStore.compact works on the gathered block only: after an `add` since the gather it refuses instead of
    losing the new samples (and moving the window's low mark past them)."""
    planner = StepPlanner(make_spec())
    run(planner, 2)
    planner.store.sync()
    w = planner.windows[0]
    before = len(w)
    w.add(np.array([w.next_pos]), np.array([7]), np.array([5]), np.array([0]))
    with pytest.raises(RuntimeError, match="compact after windows changed"):
        planner.store.compact()
    assert len(w) == before + 1
    planner.store.sync()
    planner.store.compact()  # gathered again: fine
    assert len(w) == before + 1

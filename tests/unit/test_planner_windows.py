"""The planner's columnar window store (windows.WindowStore): windows announced in chunks, in any order across
windows, plan as the same windows announced whole; a rollback after new samples arrived is refused; a layout
edited after build_layout is paired by the search, a broken one refused; the cursor's JSON is json.dumps'.
(Windows, cursors and whole plans through re-mixes, failed strategies and restores are pinned by the recorded
outputs in test_planner_goldens.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from mixplane.layout import layout_digest
from mixplane.planner.core import CoverageError, StepPlanner

from .planner_goldens import PIECE_FIELDS, Digest, edited, observe_plan, observe_planner, swap_rows, window_state
from .planner_helpers import fill, make_spec


def test_a_rollback_after_new_samples_is_refused():
    """Adds between steps detach single windows; the next step gathers them again, and a rollback after new
    samples arrived is refused rather than applied to the wrong columns."""
    p = StepPlanner(make_spec(sources=3, rows=8, seq_len=128, window=16))
    for _ in range(3):
        fill(p)
        assert any(w.stored is None for w in p.windows)
        p.plan()
        assert all(w.stored is p.store for w in p.windows)
    snap = p._snapshot()
    fill(p)
    with pytest.raises(RuntimeError, match="new samples since the snapshot"):
        p._rollback(snap)


def _fill_chunked(whole: StepPlanner, chunked: StepPlanner, rng: np.random.Generator) -> None:
    """`fill` for `whole`, and what it announced to `chunked` as several LOADER_META per window, windows
    interleaved at random (each window's in stream order), as loaders' messages arrive."""
    calls: list[tuple] = []
    for w in whole.windows:  # record what each window takes
        w.add = lambda *a, w=w, real=w.add: (calls.append((w.source, w.replica, a)), real(*a))  # type: ignore[method-assign]
    fill(whole)
    for w in whole.windows:
        del w.add
    assert calls, "fill announced nothing"
    queues = []
    for source, replica, arrays in calls:
        n = len(arrays[0])
        cuts = sorted(rng.choice(np.arange(1, n), min(n - 1, int(rng.integers(0, 4))), replace=False).tolist()) if n > 1 else []
        queues.append([chunked.window(source, replica), [tuple(x[lo:hi] for x in arrays) for lo, hi in zip([0, *cuts], [*cuts, n])]])
    while queues:
        q = queues[int(rng.integers(0, len(queues)))]
        q[0].add(*q[1].pop(0))
        if not q[1]:
            queues.remove(q)


def _same(a: StepPlanner, b: StepPlanner, arrays: bool) -> None:
    if arrays:
        assert [window_state(w) for w in a.windows] == [window_state(w) for w in b.windows]
    da, db = Digest(), Digest()
    observe_planner(a, da, arrays=arrays)
    observe_planner(b, db, arrays=arrays)
    assert da.hex() == db.hex()


@pytest.mark.parametrize("seed", range(6))
def test_chunks_in_any_order_across_windows_plan_as_whole_windows(seed):
    """The store stages what windows take in arrival order and merges it window by window: several
    LOADER_META per window, windows interleaved, the staging area growing, plan exactly as the same windows
    announced whole; arrays read between steps (the compacted samples left out) are read-only copies."""
    rng = np.random.default_rng(seed)
    spec = make_spec(sources=6, rows=64, seq_len=256, window=32, replicas=1 + seed % 3)
    chunked, whole = StepPlanner(spec), StepPlanner(spec)
    for step in range(6):
        _fill_chunked(whole, chunked, rng)
        _same(chunked, whole, arrays=step % 2 == 0)
        a, b = chunked.plan(), whole.plan()
        assert layout_digest(a.layout) == layout_digest(b.layout)
        da, db = Digest(), Digest()
        observe_plan(chunked, a, da)
        observe_plan(whole, b, db)
        assert da.hex() == db.hex(), step
        for f in PIECE_FIELDS:
            assert np.array_equal(getattr(a.pieces, f), getattr(b.pieces, f)), f
        _same(chunked, whole, arrays=step % 3 == 0)
    w = next(w for w in chunked.windows if len(w))
    with pytest.raises(ValueError, match="read-only"):
        w.done[0] = 1


def _shift_start(lay) -> None:
    lay.seg_start[0] += 1


def test_coverage_falls_back_to_a_search_and_refuses_a_broken_cover():
    """A layout edited after build_layout: a still-exact cover is paired by the search (the plans are
    recorded: the golden case coverage-swap), a broken one is refused and the planner rolls back."""
    p = StepPlanner(make_spec(sources=3, rows=8, seq_len=128, window=16))
    p.strategy = edited(swap_rows)
    for _ in range(3):
        fill(p)
        plan = p.plan()
        assert plan.piece_of_seg[:2].tolist() != [0, 1]  # the search's pairing, not build_layout's
    fill(p)
    before = p.cursor()
    p.strategy = edited(_shift_start)
    with pytest.raises(CoverageError):
        p.plan()
    assert p.cursor() == before


def test_cursor_json_with_listings_restored_progress_and_partial_samples():
    """PlannerCursor.json() is json.dumps of the cursor also when windows carry a live listing, progress restored
    from a cursor, or samples planned in part (the entries it hands to json.dumps or writes itself)."""
    spec = make_spec(sources=4, rows=4, seq_len=64, window=16, overlong="split", replicas=2)
    planner = StepPlanner(spec)
    for _ in range(40):  # until a sample is planned in part (a long document split across steps)
        fill(planner)
        planner.plan()
        cur = planner.cursor()
        if any(w["partial"] for w in cur["windows"]):
            break
    assert any(w["partial"] for w in cur["windows"]), "no partial progress: the test needs samples planned in part"
    planner.restore(cur)
    planner.windows[1].listing = [["a.parquet", "b.parquet"], ["c.parquet"]]
    planner.windows[2].listing = [["d.parquet"]]
    assert {1, 2} <= set(planner.cursor_later().windows.odd)  # written by json.dumps, in their places
    for _ in range(2):
        assert planner.cursor_later().json() == json.dumps(planner.cursor(), separators=(",", ":"))
        fill(planner)
        planner.plan()
    assert planner.cursor_later().json() == json.dumps(planner.cursor(), separators=(",", ":"))

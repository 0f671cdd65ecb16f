"""The planner's columnar window store (core.WindowStore) against the former per-window code
(core_reference.py, verbatim): the same windows, cursors, retire flags and whole plans on random specs,
through re-mixes with exclusions, failed strategies (rollback), restores, and odd window operations."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mixplane.layout import layout_digest
from mixplane.planner.core import CoverageError, PlanContext, ReplicaWindow, StepPlanner, WindowError, vanilla_strategy
from mixplane.planner.routing import image_segments

from . import core_reference as ref
from .planner_helpers import fill, make_spec

PIECE_FIELDS = ("bin", "source", "key", "start", "length", "patches", "replica", "pos")


def window_state(w) -> tuple:
    return (w.source, w.replica, w.pos.tolist(), w.key.tolist(), w.tokens.tolist(), w.patches.tolist(),
            w.done.tolist(), w.low, w.next_pos, sorted(w.skip), sorted(w.restored_done.items()), w.dry,
            w.unconsumed_tokens, w.ready, len(w))


def assert_same_planners(new: StepPlanner, old, *, arrays: bool = True) -> None:
    """Same windows and cursors. arrays=False leaves the windows' arrays unread: reading them joins what
    `add` took into arrays of the window's own, and the store's gather then takes its general path
    instead of the merge of block slices and chunks -- both are exercised."""
    if arrays:
        assert [window_state(w) for w in new.windows] == [window_state(w) for w in old.windows]
    assert [len(w) for w in new.windows] == [len(w) for w in old.windows]
    assert new.cursor() == old.cursor()
    # the JSON the planner sends every constructor, written without the dicts: json.dumps' text
    assert new.cursor_later().json() == json.dumps(new.cursor(), separators=(",", ":"))
    assert new.ready == old.ready
    assert [(w.source, w.replica) for w in new.waiting_for()] == [(w.source, w.replica) for w in old.waiting_for()]
    assert new.summary_buffer() == old.summary_buffer()


def assert_same_plans(a, b, old) -> None:
    assert layout_digest(a.layout) == layout_digest(b.layout)
    for f in PIECE_FIELDS:
        x, y = getattr(a.pieces, f), getattr(b.pieces, f)
        assert np.array_equal(x, y) and x.dtype == y.dtype, f
    assert a.cursor_before == b.cursor_before
    assert np.array_equal(a.tokens_by_source, b.tokens_by_source)
    assert np.array_equal(a.samples_by_source, b.samples_by_source)
    assert a.retired is not None and a.retired.dtype == np.uint8
    assert np.array_equal(a.piece_of_seg, b.piece_of_seg)  # build_layout's pairing = the one searched for
    want = image_segments(b.layout, b.piece_of_seg, b.pieces.patches)
    if a.seg_of_img is not None:
        assert want is not None and np.array_equal(a.seg_of_img, want)
    assert np.array_equal(a.retired, old.retired(b.pieces))


def remixing(every: int):
    """A strategy that mixes, then re-mixes without every `every`-th piece's sample (rollback + general path)."""
    def strategy(ctx: PlanContext):
        p = ctx.mix()
        ctx.mix(exclude=list(zip(p.source.tolist(), p.key.tolist()))[::every])
        return vanilla_strategy(ctx)
    return strategy


class Boom(RuntimeError):
    pass


def failing(ctx: PlanContext):
    ctx.mix()
    raise Boom("strategy failed after mixing")


@settings(max_examples=25, deadline=None)
@given(sources=st.integers(1, 5), weights=st.lists(st.sampled_from([0.0, 0.3, 1.0, 3.0]), min_size=5, max_size=5),
       unit=st.sampled_from(["tokens", "samples"]), packing=st.sampled_from(["best_fit", "next_fit", "none"]),
       overlong=st.sampled_from(["split", "truncate"]), rows=st.sampled_from([4, 8, 16]),
       seq_len=st.sampled_from([64, 256]), replicas=st.integers(1, 3), window=st.sampled_from([4, 16, 64]),
       images=st.booleans(), events=st.lists(st.sampled_from(["plan", "plan", "plan", "remix", "fail", "restore"]),
                                             min_size=4, max_size=10))
def test_plans_windows_and_cursors_match_the_former_core(sources, weights, unit, packing, overlong, rows, seq_len,
                                                         replicas, window, images, events):
    w = {f"s{i}": weights[i] for i in range(sources)}
    if sum(w.values()) <= 0:
        w["s0"] = 1.0
    spec = make_spec(sources=sources, weights=w, unit=unit, packing=packing, overlong=overlong, rows=rows,
                     seq_len=seq_len, replicas=replicas, window=window, dp=2, microbatches=2, encoder=images,
                     strategy="vlm_balance" if images else "llm_balance")
    new, old = StepPlanner(spec), ref.StepPlanner(spec)
    cursors = []
    for ev in events:
        fill(new, images=images)
        fill(old, images=images)
        assert_same_planners(new, old, arrays=len(cursors) % 2 == 1)
        if ev == "restore" and cursors:
            cur = cursors[len(cursors) // 2]
            new.restore(cur)
            old.restore(cur)
            assert_same_planners(new, old)
            continue
        if ev == "fail":
            new.strategy = old.strategy = failing
            for p in (new, old):
                with pytest.raises(Boom):
                    p.plan()
            assert_same_planners(new, old)
        new.strategy = old.strategy = remixing(3) if ev == "remix" else new.__class__(spec).strategy
        a, b = new.plan(), old.plan()
        assert_same_plans(a, b, old)
        assert (a.seg_of_img is not None) == bool(len(a.layout.img_key))  # build_layout's layouts: known
        assert_same_planners(new, old)
        cursors.append(new.cursor())


def test_store_follows_windows_filled_one_by_one():
    """Adds between steps detach single windows; the next step gathers them again (and a rollback after
    new samples arrived is refused rather than applied to the wrong columns)."""
    spec = make_spec(sources=3, rows=8, seq_len=128, window=16)
    new, old = StepPlanner(spec), ref.StepPlanner(spec)
    for _ in range(5):
        fill(new)
        fill(old)
        assert any(w.stored is None for w in new.windows)
        a, b = new.plan(), old.plan()
        assert_same_plans(a, b, old)
        assert all(w.stored is new.store for w in new.windows)
    snap = new._snapshot()
    fill(new)
    with pytest.raises(RuntimeError, match="new samples since the snapshot"):
        new._rollback(snap)


def as_sent(arrays: tuple, form: int) -> tuple:
    """LOADER_META arrays in the forms `add` may get: int64 arrays (its compiled path), read-only ones as the
    wire decodes them, one of them int32, lists, or the key as floats (the step-by-step path)."""
    if form == 1:
        return tuple(np.frombuffer(np.asarray(a, np.int64).tobytes(), np.int64) for a in arrays)
    if form == 2:
        return (arrays[0], arrays[1], np.asarray(arrays[2], np.int32), arrays[3])
    if form == 3:
        return tuple(np.asarray(a).tolist() for a in arrays)
    if form == 4:
        return (arrays[0], np.asarray(arrays[1], np.float64), *arrays[2:])
    return arrays


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_a_window_on_its_own_behaves_as_before(seed):
    """Random adds (valid and not), partial and whole consumption written into `done`, compactions,
    cursors and restores: the same state, the same cursors and the same refusals as the former window.
    (`unconsumed_tokens` counts what `done` says as of the last add / compact / restore.)"""
    rng = np.random.default_rng(seed)
    lo, tokens, hi = int(rng.integers(1, 6)), int(rng.integers(0, 200)), int(rng.integers(6, 12))
    new, old = ReplicaWindow(0, 0, lo, tokens, hi), ref.ReplicaWindow(0, 0, lo, tokens, hi)
    saved = [new.cursor()]
    for _ in range(40):
        op = rng.random()
        if op < 0.45:
            start = new.next_pos + int(rng.integers(-2, 3)) if rng.random() < 0.2 else new.next_pos
            n = int(rng.integers(0, 5))
            pos = start + np.cumsum(rng.integers(0 if rng.random() < 0.05 else 1, 3, n))
            tok = rng.integers(0 if rng.random() < 0.05 else 1, 60, n)
            args = as_sent((pos, pos * 7 + 1, tok, rng.integers(0, 3, n)), int(rng.integers(0, 5)))
            errs = []
            for w in (new, old):
                try:
                    w.add(*args)
                    errs.append(None)
                except (WindowError, ref.WindowError) as e:
                    errs.append(str(e))
            assert errs[0] == errs[1]
        elif op < 0.7 and len(new):  # consumption written into `done`, then compacted (as the planner does)
            for i in rng.choice(len(new), int(rng.integers(1, len(new) + 1)), replace=False).tolist():
                d = int(new.done[i]) + int(rng.integers(1, max(0, int(new.tokens[i] - new.done[i])) + 2))
                for w in (new, old):
                    w.done[i] = min(d, int(w.tokens[i]))
            assert new.compact().tolist() == old.compact().tolist()
        elif op < 0.85:
            assert new.compact().tolist() == old.compact().tolist()
        elif op < 0.95:
            saved.append(new.cursor())
        else:
            cur = saved[int(rng.integers(0, len(saved)))]
            new.restore(cur)
            old.restore(cur)
        assert window_state(new) == window_state(old)
        assert new.cursor() == old.cursor()


def _edited(edit):
    def strategy(ctx: PlanContext):
        lay = vanilla_strategy(ctx)
        edit(lay)
        return lay
    return strategy


def _swap_rows(lay) -> None:
    """Segments 0 and 1 trade places (rows included): still a cover, but not build_layout's pairing."""
    for f in ("seg_row", "seg_source", "seg_key", "seg_start", "seg_len"):
        a = getattr(lay, f)
        a[[0, 1]] = a[[1, 0]]


def _shift_start(lay) -> None:
    lay.seg_start[0] += 1


def test_coverage_verifies_the_builders_pairing_and_falls_back_to_a_search():
    """A layout edited after build_layout: a still-exact cover is paired by the search (same plan as the
    former core), a broken one is refused and the planner rolls back."""
    spec = make_spec(sources=3, rows=8, seq_len=128, window=16)
    new, old = StepPlanner(spec), ref.StepPlanner(spec)
    for p in (new, old):
        p.strategy = _edited(_swap_rows)
    for _ in range(3):
        fill(new)
        fill(old)
        assert_same_plans(new.plan(), old.plan(), old)
    fill(new)
    before = new.cursor()
    new.strategy = _edited(_shift_start)
    with pytest.raises(CoverageError):
        new.plan()
    assert new.cursor() == before


def _fill_both(new: StepPlanner, old, rng: np.random.Generator) -> None:
    """`fill` for the former core, and what it announced to `new` as several LOADER_META per window,
    windows interleaved at random (each window's in stream order), as loaders' messages arrive."""
    calls: list[tuple] = []
    for w in old.windows:  # record what each window takes
        w.add = lambda *a, w=w, real=w.add: (calls.append((w.source, w.replica, a)), real(*a))  # type: ignore[method-assign]
    fill(old)
    for w in old.windows:
        del w.add
    queues = []
    for source, replica, arrays in calls:
        n = len(arrays[0])
        cuts = sorted(rng.choice(np.arange(1, n), min(n - 1, int(rng.integers(0, 4))), replace=False).tolist()) if n > 1 else []
        queues.append([new.window(source, replica), [tuple(x[lo:hi] for x in arrays) for lo, hi in zip([0, *cuts], [*cuts, n])]])
    while queues:
        q = queues[int(rng.integers(0, len(queues)))]
        q[0].add(*q[1].pop(0))
        if not q[1]:
            queues.remove(q)


@pytest.mark.parametrize("seed", range(6))
def test_chunks_in_any_order_across_windows_plan_as_before(seed):
    """The store stages what windows take in arrival order and merges it window by window: several
    LOADER_META per window, windows interleaved, the staging area growing; arrays read between steps (the
    compacted samples left out) are read-only copies."""
    rng = np.random.default_rng(seed)
    spec = make_spec(sources=6, rows=64, seq_len=256, window=32, replicas=1 + seed % 3)
    new, old = StepPlanner(spec), ref.StepPlanner(spec)
    for step in range(6):
        _fill_both(new, old, rng)
        assert_same_planners(new, old, arrays=step % 2 == 0)
        assert_same_plans(new.plan(), old.plan(), old)
        assert_same_planners(new, old, arrays=step % 3 == 0)
    w = next(w for w in new.windows if len(w))
    with pytest.raises(ValueError, match="read-only"):
        w.done[0] = 1


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

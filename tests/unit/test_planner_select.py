"""StepPlanner.select runs the mixing sampler (DeficitSampler.pick, incrementally through EDFQueue):
the same picks as the reference rule, and the same plans as the planner's former inlined loop."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mixplane.layout import layout_digest
from mixplane.mixing import DeficitSampler, EDFQueue, apply_temperature
from mixplane.planner.core import StepPlanner

from .planner_helpers import fill, make_spec
from .planner_reference import old_select


class FormerPlanner(StepPlanner):
    """The planner with its former select (verbatim copy in planner_reference)."""

    select = old_select


@settings(max_examples=80, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.01, 0.1, 0.3, 1.0, 2.5, 7.0]), min_size=1, max_size=9).filter(lambda w: sum(w) > 0),
       st.integers(0, 2**31 - 1), st.sampled_from([1.0, 64.0, 1000.0]))
def test_edf_queue_picks_what_pick_picks(weights, seed, scale):
    """Random eligibility changes, sizes (0 included: continuation pieces in samples mode) and records:
    the incremental queue and the vectorised reference agree at every pick, -1 included."""
    rng = np.random.default_rng(seed)
    p = apply_temperature(np.array(weights), 1.0)
    n = len(p)
    ref = DeficitSampler(n)
    ref.realized[:] = rng.integers(0, 50, n) * (p > 0)
    q = EDFQueue(p, ref.realized, scale)
    eligible = np.zeros(n, bool)
    sizes = np.zeros(n)
    for i in range(n):
        if p[i] > 0 and rng.random() < 0.9:
            eligible[i] = True
            sizes[i] = float(rng.integers(0, int(scale) + 1))
            q.set(i, sizes[i])
    for _ in range(400):
        want = ref.pick(p, eligible, sizes=sizes, scale=scale, fallback=False)
        got = q.pick()
        assert got == want, (got, want, ref.realized.tolist(), sizes.tolist(), eligible.tolist())
        i = got if got >= 0 else int(rng.integers(0, n))
        op = rng.random()
        if got >= 0 and op < 0.75:  # placed: record it and move on to its next piece
            ref.record(i, sizes[i])
            q.record(i, sizes[i])
        if p[i] > 0 and op < 0.93:
            eligible[i] = True
            sizes[i] = float(rng.integers(0, int(scale) + 1))
            q.set(i, sizes[i])
        else:
            eligible[i] = False
            q.remove(i)
        assert q.total == float(ref.realized.sum())


def _pair(**kw):
    spec = make_spec(**kw)
    return StepPlanner(spec), FormerPlanner(spec)


@settings(max_examples=30, deadline=None)
@given(sources=st.integers(1, 6), weights=st.lists(st.sampled_from([0.0, 0.2, 1.0, 3.0]), min_size=6, max_size=6),
       unit=st.sampled_from(["tokens", "samples"]), packing=st.sampled_from(["best_fit", "next_fit", "none"]),
       overlong=st.sampled_from(["split", "truncate"]), rows=st.sampled_from([4, 8, 16]),
       seq_len=st.sampled_from([64, 256]), replicas=st.integers(1, 2), window=st.sampled_from([4, 16, 64]),
       images=st.booleans())
def test_select_plans_what_the_former_loop_planned(sources, weights, unit, packing, overlong, rows, seq_len,
                                                   replicas, window, images):
    w = {f"s{i}": weights[i] for i in range(sources)}
    if sum(w.values()) <= 0:
        w["s0"] = 1.0
    new, old = _pair(sources=sources, weights=w, unit=unit, packing=packing, overlong=overlong, rows=rows,
                     seq_len=seq_len, replicas=replicas, window=window, dp=2, microbatches=2, encoder=images)
    for _ in range(6):
        fill(new, images=images)
        fill(old, images=images)
        a, b = new.plan(), old.plan()
        assert layout_digest(a.layout) == layout_digest(b.layout)
        for f in ("bin", "source", "key", "start", "length", "patches", "replica", "pos"):
            assert np.array_equal(getattr(a.pieces, f), getattr(b.pieces, f)), f
            assert getattr(a.pieces, f).dtype == getattr(b.pieces, f).dtype, f
        assert a.cursor_before == b.cursor_before
        assert new.sampler.state_dict() == old.sampler.state_dict()


def test_select_with_exclusions_and_remix_matches_the_former_loop():
    new, old = _pair(sources=4, weights={"s0": 1, "s1": 2, "s2": 1, "s3": 0.5}, rows=8, seq_len=128)
    for planner in (new, old):
        fill(planner)
    pt = new.schedule.at(0)
    snaps = new._snapshot(), old._snapshot()
    first = new.select(0, pt)
    assert np.array_equal(first.key, old.select(0, pt).key)
    keys = list(zip(first.source.tolist(), first.key.tolist()))[::3]
    new._rollback(snaps[0])
    old._rollback(snaps[1])
    a = new.select(0, pt, keys)
    b = old.select(0, pt, keys)
    assert np.array_equal(a.key, b.key) and np.array_equal(a.bin, b.bin) and np.array_equal(a.start, b.start)
    assert not set(zip(a.source.tolist(), a.key.tolist())) & set(keys)


def test_retired_flags_match_a_per_window_check():
    """A piece's sample is retired when it left its window with the plan: below the window's low mark
    or among its consumed positions above it (several replicas, split documents, skips)."""
    planner = StepPlanner(make_spec(sources=4, replicas=3, rows=8, seq_len=128, window=8,
                                    weights={"s0": 1, "s1": 2, "s2": 1, "s3": 1}))
    seen_skip = seen_kept = False
    for _ in range(8):
        fill(planner)
        plan = planner.plan()
        p = plan.pieces
        want = np.zeros(len(p), np.uint8)
        for w in planner.windows:
            mine = (p.source == w.source) & (p.replica == w.replica)
            q = p.pos[mine]
            want[mine] = (q < w.low) | np.isin(q, np.array(sorted(w.skip), np.int64))
            seen_skip |= bool(w.skip)
        seen_kept |= bool((want == 0).any())
        assert np.array_equal(planner.retired(p), want)
        assert plan.retired is not None and np.array_equal(plan.retired, want)  # found while compacting
    assert seen_skip and seen_kept  # both kinds of consumed positions and unfinished samples occurred


def test_constructor_layouts_are_what_select_ranks_gives_each_constructor():
    from mixplane.planner.routing import constructor_layouts

    planner = StepPlanner(make_spec(sources=3, rows=24, seq_len=128, dp=6, microbatches=2, encoder=True))
    fill(planner, images=True)
    lay = planner.plan().layout
    groups = [[0], [1, 2], [3], [5, 4], [0, 2, 4], [], [1, 3, 5]]  # consecutive, unordered, gapped, empty
    for ranks, sub in zip(groups, constructor_layouts(lay, groups)):
        want = lay.select_ranks(ranks)
        assert sub.meta() == want.meta()
        for name, a in want.arrays().items():
            b = sub.arrays()[name]
            assert a.dtype == b.dtype and np.array_equal(a, b), (ranks, name)
    assert sum(len(s.seg_row) for s in constructor_layouts(lay, [[d] for d in range(6)])) == len(lay.seg_row)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(-2**63, 2**63 - 1) | st.integers(0, 3), st.integers(0, 2),
                          st.integers(1, 2)), max_size=60), st.integers(0, 2**31 - 1), st.integers(0, 3))
def test_match_pairs_equal_multisets_and_nothing_else(rows, seed, mutate):
    """selectloop.match (the coverage check's and routing's alignment) pairs a permutation row for row,
    and refuses a list with one row replaced (a duplicate of another, or a new row) or one row more."""
    from mixplane.planner.selectloop import match

    rng = np.random.default_rng(seed)
    a = tuple(np.array([r[i] for r in rows], np.int64) for i in range(4))
    perm = rng.permutation(len(rows))
    b = tuple(x[perm] for x in a)
    got, bad = match(a, b)
    assert bad == -1 and got is not None
    assert all(np.array_equal(x, y[got]) for x, y in zip(a, b))
    assert sorted(got.tolist()) == list(range(len(rows)))
    if not rows:
        return
    c = [x.copy() for x in b]
    if mutate == 3:
        c = [np.concatenate([x, x[:1]]) for x in c]
    else:
        j = int(rng.integers(0, len(rows)))
        other = int(rng.integers(0, len(rows)))
        if mutate == 0 and other != j:
            for x in c:
                x[j] = x[other]  # a duplicate in place of a row
        else:
            c[mutate][j] += 7  # a row that is not in a
    if sorted(map(tuple, np.stack(c, 1).tolist())) != sorted(map(tuple, np.stack(a, 1).tolist())):
        assert match(a, tuple(c))[0] is None


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(-5, 5) | st.integers(-2**62, 2**62)), max_size=80))
def test_row_order_is_the_three_key_lexsort(items):
    """build_layout's order (by row, then within-row key, then index) without the three-key sort."""
    from mixplane.planner.dgraph import _row_order

    rows = np.array([r for r, _ in items], np.int64)
    key = np.array([k for _, k in items], np.int64)
    want = np.lexsort((np.arange(len(items)), key, rows)) if items else np.zeros(0, np.int64)
    assert np.array_equal(_row_order(rows, key), want)

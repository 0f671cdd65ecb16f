"""StepPlanner.select runs the mixing sampler (DeficitSampler.pick, incrementally through EDFQueue):
the same picks as the reference rule, and the same plans as the planner's former inlined loop."""

from __future__ import annotations

import numpy as np
import pytest
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
    from tests.unit.routing_reference import constructor_layouts

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


# ---- the compiled loop against its former version (selectloop_reference), byte for byte -------------------

def _lengths(rng, kind: str, m: int, S: int) -> np.ndarray:
    if kind == "small":
        return rng.integers(1, max(2, S // 4) + 1, m)
    if kind == "equal":  # ties everywhere: equal pieces, equal free space, equal deadlines
        return np.full(m, max(1, S // 3))
    if kind == "row":  # exactly a row each
        return np.full(m, S)
    if kind == "long":  # split over several rows
        return rng.integers(S, 4 * S + 2, m)
    if kind == "ones":
        return np.ones(m, np.int64)
    if kind == "phased":  # a run of rows left with the same free space, then pieces that fit only there
        c = S // 2 + 1
        return np.concatenate([np.full(m // 2, c), rng.integers(1, max(2, S - c + 1), m - m // 2)])
    if kind == "bimodal":  # over half a row (one per row: many rows left with equal free space) or small
        big = rng.integers(S // 2 + 1, S + 1, m) if rng.random() < 0.5 else np.full(m, S // 2 + 1)
        return np.where(rng.random(m) < 0.5, big, rng.integers(1, max(2, S // 2), m))
    return np.maximum(1, np.minimum(5 * S, rng.lognormal(np.log(max(1.0, S / 3)), 1.2, m).astype(np.int64)))


def _select_case(rng, *, sources: int, rows: int, seq_len: int, per_source: int) -> dict:
    """A random loop input: sources with weights from zero to dominant, windows of assorted length
    distributions (some empty, some with partly or fully consumed samples), counters from zero to ~1e12."""
    w = rng.choice([0.0, 1e-6, 0.01, 0.3, 1.0, 5.0], sources)
    if rng.random() < 0.15:
        w = np.zeros(sources)
        w[int(rng.integers(0, sources))] = 1.0  # one source: p = 1
    if w.sum() <= 0:
        w[0] = 1.0
    probs = w / w.sum()
    counts = rng.integers(0, per_source + 1, sources)
    off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    kinds = ["small", "equal", "row", "long", "ones", "bimodal", "phased", "phased", "mixed"]
    tok = np.concatenate([_lengths(rng, str(rng.choice(kinds)), int(c), seq_len) for c in counts]).astype(np.int64) \
        if counts.sum() else np.zeros(0, np.int64)
    done = np.zeros(len(tok), np.int64)
    if len(tok):
        part = rng.random(len(tok)) < 0.1
        done[part] = (tok[part] * rng.random(int(part.sum()))).astype(np.int64)
        gone = rng.random(len(tok)) < 0.04
        done[gone] = tok[gone]  # fully consumed, still listed
    scale = float(rng.choice([1.0, float(seq_len), float(max(1, seq_len // 2))]))
    base = float(rng.choice([0.0, 1e3, 1e9, 1e12]))
    realized = np.where(probs > 0, np.floor(base * probs + rng.integers(0, 50, sources) * scale), 0.0)
    n_pos = int((probs > 0).sum())
    delta = (1.0 - 1.0 / (2 * n_pos - 2) if n_pos > 1 else 0.5) * scale
    return dict(c_tok=tok, c_done=done, off=off, probs=probs, realized=realized, scale=scale, delta=delta,
                limit=delta + 1e-9 * scale, unit_samples=bool(rng.random() < 0.25), truncate=bool(rng.random() < 0.25),
                seq_len=seq_len, rows=rows, policy=str(rng.choice(["best_fit", "best_fit", "next_fit", "none"])))


def _same_steps(case: dict, steps: int) -> None:
    """Several steps over the same windows (consumption and counters carried over, as the planner does):
    every output array, and the counters and consumption written back, byte-identical with the former loop."""
    from mixplane.planner import selectloop

    from .selectloop_reference import former_run

    a_done, b_done = case["c_done"].copy(), case["c_done"].copy()
    a_real, b_real = case["realized"].copy(), case["realized"].copy()
    fixed = {k: v for k, v in case.items() if k not in ("c_done", "realized", "c_tok", "off", "probs",
                                                          "scale", "delta", "limit")}
    for _ in range(steps):
        args = (case["scale"], case["delta"], case["limit"])
        got = selectloop.run(case["c_tok"], a_done, case["off"], case["probs"], a_real, *args, **fixed)
        want = former_run(case["c_tok"], b_done, case["off"], case["probs"], b_real, *args, **fixed)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.tobytes() == w.tobytes(), fixed
        assert a_done.tobytes() == b_done.tobytes() and a_real.tobytes() == b_real.tobytes()


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 2**63 - 1), st.sampled_from([1, 2, 3, 7, 16, 64, 100]), st.sampled_from([1, 2, 3, 5, 17, 64, 130]),
       st.integers(1, 14))
def test_loop_places_what_the_former_loop_placed(seed, seq_len, rows, sources):
    """Small random inputs over every policy, unit and overlong mode, tiny rows (many pieces that fit
    nowhere, sources exhausted and starved), ties of lengths, free space and deadlines."""
    _same_steps(_select_case(np.random.default_rng(seed), sources=sources, rows=rows, seq_len=seq_len,
                             per_source=int(np.random.default_rng(seed).integers(0, 40))), steps=3)


def test_loop_best_fit_reuses_rows_left_with_equal_space():
    """One source: eight rows each left with 7 of 16 tokens (one bucket of eight rows), then pieces of 7
    and less: each goes to the fullest row with room, the lowest among equals (the bucket's heap, popped
    with an odd number of children)."""
    tok = np.array([9] * 8 + [7] * 5 + [3, 2, 2, 1, 1, 1, 1, 1], np.int64)
    case = dict(c_tok=tok, c_done=np.zeros(len(tok), np.int64), off=np.array([0, len(tok)], np.int64),
                probs=np.array([1.0]), realized=np.zeros(1), scale=16.0, delta=8.0, limit=8.0 + 1.6e-8,
                unit_samples=False, truncate=False, seq_len=16, rows=8, policy="best_fit")
    from mixplane.planner import selectloop

    _, row, _, length = selectloop.run(tok, case["c_done"].copy(), case["off"], case["probs"], np.zeros(1),
                                       16.0, 8.0, 8.0 + 1.6e-8, unit_samples=False, truncate=False, seq_len=16,
                                       rows=8, policy="best_fit")
    assert row.tolist() == list(range(8)) + [0, 1, 2, 3, 4] + [5, 5, 5] + [6] * 5  # 3 + 2 + 2 fill row 5
    assert length.tolist() == tok.tolist()
    _same_steps(case, steps=1)


@pytest.mark.parametrize("seed", range(4))
def test_loop_places_what_the_former_loop_placed_at_scale(seed):
    """Closer to the bench's shape (hundreds of sources, thousands of 8k rows, lognormal lengths): deep
    best-fit buckets and a full ready heap."""
    rng = np.random.default_rng(1000 + seed)
    case = _select_case(rng, sources=300, rows=2048, seq_len=8192, per_source=200)
    case.update(unit_samples=False, truncate=False, policy="best_fit" if seed < 3 else "next_fit")
    _same_steps(case, steps=3)


def test_compiled_loops_release_the_gil():
    """The pick-and-place loop and its helpers compile with nogil (numba refuses nogil code that touches a
    Python object), so the server's planning thread runs them beside encoding and sending."""
    from mixplane.planner import selectloop

    selectloop.warm()
    for fn in (selectloop._loop, selectloop._spans, selectloop._match):
        assert fn.targetoptions.get("nogil") is True, fn

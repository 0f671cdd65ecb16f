"""StepPlanner.select runs the mixing sampler (DeficitSampler.pick, incrementally through EDFQueue): the same
picks as the reference rule; the compiled loop's placements as packing.OnlinePacker's (the packing rule's
readable form); retire flags, the coverage match and the row order against their definitions; best fit's tie-break. (Its plans and the compiled loop's outputs are pinned by the recorded
outputs in test_planner_goldens.py.)"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mixplane.mixing import DeficitSampler, EDFQueue, apply_temperature
from mixplane.planner.core import StepPlanner

from .planner_helpers import fill, make_spec


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


def test_loop_best_fit_reuses_rows_left_with_equal_space():
    """One source: eight rows each left with 7 of 16 tokens (one bucket of eight rows), then pieces of 7
    and less: each goes to the fullest row with room, the lowest among equals (the bucket's heap, popped
    with an odd number of children)."""
    tok = np.array([9] * 8 + [7] * 5 + [3, 2, 2, 1, 1, 1, 1, 1], np.int64)
    from mixplane.planner import selectloop

    _, row, _, length = selectloop.run(tok, np.zeros(len(tok), np.int64), np.array([0, len(tok)], np.int64),
                                       np.array([1.0]), np.zeros(1),
                                       16.0, 8.0, 8.0 + 1.6e-8, unit_samples=False, truncate=False, seq_len=16,
                                       rows=8, policy="best_fit")
    assert row.tolist() == list(range(8)) + [0, 1, 2, 3, 4] + [5, 5, 5] + [6] * 5  # 3 + 2 + 2 fill row 5
    assert length.tolist() == tok.tolist()


def test_compiled_loops_release_the_gil():
    """The pick-and-place loop and its helpers compile with nogil (numba refuses nogil code that touches a
    Python object), so the server's planning thread runs them beside encoding and sending."""
    from mixplane.planner import selectloop

    selectloop.warm()
    for fn in (selectloop._loop, selectloop._spans, selectloop._match):
        assert fn.targetoptions.get("nogil") is True, fn


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**63 - 1), st.sampled_from([1, 2, 3, 7, 16, 64, 100]), st.sampled_from([1, 2, 3, 5, 17, 64, 130]),
       st.integers(1, 14), st.integers(0, 40))
def test_loop_places_every_piece_where_the_online_packer_would(seed, seq_len, rows, sources, per_source):
    """The packing decision against its readable form: replaying the compiled loop's pieces, in its output order,
    through packing.OnlinePacker (best fit, next fit, one document per row) puts every piece in the same row;
    each piece starts where its sample's consumption stood, and the consumption written back is what the pieces
    took (no token skipped or taken twice), over three steps of the same windows."""
    from mixplane.planner import selectloop
    from mixplane.planner.packing import OnlinePacker

    from .planner_goldens import select_case

    case = select_case(np.random.default_rng(seed), sources=sources, rows=rows, seq_len=seq_len, per_source=per_source)
    done, real = case["c_done"].copy(), case["realized"].copy()
    for _ in range(3):
        before = done.copy()
        cand, row, start, length = selectloop.run(
            case["c_tok"], done, case["off"], case["probs"], real, case["scale"], case["delta"], case["limit"],
            unit_samples=case["unit_samples"], truncate=case["truncate"], seq_len=seq_len, rows=rows, policy=case["policy"])
        packer = OnlinePacker(rows, seq_len, case["policy"])
        at = before.copy()
        for c, r, s, n in zip(cand.tolist(), row.tolist(), start.tolist(), length.tolist()):
            assert packer.place(n) == r, (case["policy"], c, r, n)
            assert s == at[c] and 0 < n and s + n <= case["c_tok"][c]
            at[c] += n
        if case["truncate"]:  # a truncated sample is consumed whole: what did not fit is dropped, not left
            took = np.flatnonzero(at != before)
            assert np.all((done[took] == at[took]) | (done[took] == case["c_tok"][took]))
            assert np.array_equal(np.delete(done, took), np.delete(before, took))
        else:
            assert np.array_equal(done, at)


def test_retired_flags_hold_for_positions_of_any_size():
    """Positions may use all 63 bits (a source read block by block owns 2^30 slots a block): a skipped position of one
    window is no other window's, even where (window << 40) + position would make them equal."""
    from mixplane.planner.context import Pieces

    planner = StepPlanner(make_spec(sources=2, replicas=2, rows=8, seq_len=128, window=8))
    ws = planner.windows
    n = len(ws)
    big = 5 << 40
    # window i holds positions big + k; window 0 skips big + (1 << 40) + 3, which is window 1's (big + 3) packed
    src = np.repeat([w.source for w in ws], 4).astype(np.int64)
    rep = np.repeat([w.replica for w in ws], 4).astype(np.int64)
    pos = np.tile(np.arange(4, dtype=np.int64) + big, n)
    for w in ws:
        w.low = big
        w.skip = set()
    ws[0].skip = {big + (1 << 40) + 3, big + 2}
    zero = np.zeros(4 * n, np.int64)
    p = Pieces(zero, src, zero, zero, zero + 1, zero, rep, pos)
    want = np.zeros(4 * n, np.uint8)
    want[2] = 1  # window 0's skipped position big + 2; window 1's big + 3 is not skipped
    assert np.array_equal(planner.retired(p), want)
    ws[0].low = big + 1  # below the low mark: retired
    want[0] = 1
    assert np.array_equal(planner.retired(p), want)

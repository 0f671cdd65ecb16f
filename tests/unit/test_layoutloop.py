"""build_layout's compiled gather (planner/layoutloop.py) against the numpy gathers it replaced."""

from __future__ import annotations

import numpy as np
import pytest

from mixplane.layout import StepLayout
from mixplane.planner import layoutloop


def numpy_columns(order, rows, source, key, start, length, patches, img_rank):
    """The former build_layout's gathers, verbatim (then StepLayout's dtype conversion)."""
    n = len(order)
    img_mask = patches > 0
    rank_of_piece = np.full(n, -1, dtype=np.int64)
    rank_of_piece[img_mask] = np.asarray(img_rank, dtype=np.int64)
    o_img = order[img_mask[order]]
    lay = StepLayout(step=0, seq_len=1, dp=1, microbatches=1, rows_per_microbatch=1,
                     seg_row=rows[order], seg_source=source[order], seg_key=key[order], seg_start=start[order],
                     seg_len=length[order], img_source=source[o_img], img_key=key[o_img], img_rank=rank_of_piece[o_img],
                     img_patches=patches[o_img])
    return lay.arrays(), o_img


@pytest.mark.parametrize("seed", range(12))
def test_gather_equals_numpy(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 3000))
    big = seed % 3 == 0  # values past the narrow dtypes: both wrap the same way (C casts)
    hi = 1 << 40 if big else 1 << 14
    rows = rng.integers(0, hi, n).astype(np.int64)
    source = rng.integers(0, 1 << 20 if big else 1024, n).astype(np.int32 if seed % 2 else np.int64)
    key = rng.integers(-(1 << 62), 1 << 62, n).astype(np.int64)
    start = rng.integers(0, hi, n).astype(np.int64)
    length = rng.integers(1, hi, n).astype(np.int64 if seed % 2 else np.int32)
    patches = np.where(rng.random(n) < rng.random(), rng.integers(1, 5000, n), 0).astype(np.int64)
    img_rank = rng.integers(0, 1 << 35 if big else 16384, int((patches > 0).sum())).astype(np.int64)
    order = rng.permutation(n).astype(np.int64)
    want, want_o = numpy_columns(order, rows, source, key, start, length, patches, img_rank)
    got, got_o = layoutloop.gather_columns(order, rows, source, key, start, length, patches, img_rank)
    assert np.array_equal(got_o, want_o)
    assert got.keys() == want.keys()
    for name, arr in want.items():
        assert got[name].dtype == arr.dtype, name
        assert np.array_equal(got[name], arr), name


def test_gather_refuses_ranks_of_another_step():
    z = np.zeros(3, np.int64)
    with pytest.raises(ValueError, match="img_rank lists 1 ranks for 3 images"):
        layoutloop.gather_columns(np.arange(3), z, z, z, z, np.ones(3, np.int64), np.ones(3, np.int64), np.zeros(1, np.int64))


@pytest.mark.parametrize("seed", range(20))
def test_row_order_counting_sort_equals_lexsort(seed):
    """build_layout's order (by row, then within-row key, then index) via the compiled counting sort when keys
    increase, and via the sorts when they do not or rows are out of its range."""
    from mixplane.planner.dgraph import _row_order

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 5000))
    rows = rng.integers(0, [3, 16384, 1 << 40, 1 << 62][seed % 4], n).astype(np.int64)
    key = np.arange(n, dtype=np.int64) * int(rng.integers(1, 9)) - 7 if seed % 5 else rng.integers(-9, 9, n).astype(np.int64)
    want = np.lexsort((np.arange(n), key, rows))
    got, done = layoutloop.order_by_row(rows, key)
    assert done == (bool(seed % 5) and int(rows.max()) < 4 * n + 65536)
    if done:
        assert np.array_equal(got, want)
    assert np.array_equal(_row_order(rows, key), want)


def _layout(rng, n_rows: int, seq_len: int, n: int):
    rows = np.sort(rng.integers(0, n_rows, n))
    lens = rng.integers(1, max(2, seq_len // 12), n)
    return StepLayout(step=7, seq_len=seq_len, dp=1, microbatches=1, rows_per_microbatch=n_rows, seg_row=rows,
                      seg_source=np.zeros(n, np.int16), seg_key=np.arange(n), seg_start=rng.integers(0, 50, n), seg_len=lens)


def _error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("seed", range(60))
def test_validate_equals_steplayout_validate(seed):
    """The compiled validate raises what StepLayout.validate raises (the first failing check, same words), on valid
    layouts and on layouts broken in one or several ways."""
    rng = np.random.default_rng(seed)
    lay = _layout(rng, int(rng.integers(1, 40)), int(rng.integers(8, 300)), int(rng.integers(0, 200)))
    n = len(lay.seg_row)
    for _ in range(int(rng.integers(0, 4))):  # damage
        if not n:
            break
        i = int(rng.integers(0, n))
        what = int(rng.integers(0, 6))
        if what == 0:
            lay.seg_row[i] = -1 if rng.random() < 0.5 else lay.rows + int(rng.integers(0, 3))
        elif what == 1 and n > 1:
            lay.seg_row[i], lay.seg_row[(i + 1) % n] = lay.seg_row[(i + 1) % n], lay.seg_row[i]
        elif what == 2:
            lay.seg_len[i] = -int(rng.integers(0, 3))
        elif what == 3:
            lay.seg_start[i] = -1
        elif what == 4:
            lay.seg_len[i] = lay.seq_len + int(rng.integers(0, 5))
        else:
            lay.seg_key = lay.seg_key[:-1]
    assert _error(lambda: layoutloop.validate(lay)) == _error(lay.validate)


def test_warm_compiles_what_a_step_calls():
    """layoutloop.warm() compiles the signatures a planned step uses (StepPlanner's pieces' dtypes): the first step
    of a planner compiles nothing (a cold compile there would stall its socket for seconds)."""
    from .planner_helpers import fill, make_spec
    from mixplane.planner.core import StepPlanner

    layoutloop.warm()
    kernels = (layoutloop.gather, layoutloop.order_by_row, layoutloop._layout_faults)
    before = {k: len(k.signatures) for k in kernels}
    spec = make_spec(sources=3, replicas=1, rows=8, seq_len=128, window=16)
    planner = StepPlanner(spec)
    fill(planner)
    planner.plan()
    assert {k: len(k.signatures) for k in kernels} == before

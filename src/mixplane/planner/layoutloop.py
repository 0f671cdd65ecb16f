"""The StepLayout's gathers, compiled (numba): every segment and image column of a step in one pass.

build_layout ordered ~145k pieces (16,384 GPUs x 1,024 sources) and then gathered nine columns, each a
fancy index and a dtype conversion (~7 ms a step of numpy passes); this loop writes them all, in their
wire dtypes, in one walk over the order. The conversions are C casts, as numpy's astype: the same bits.
tests/unit/test_layoutloop.py compares it with the numpy version on random pieces.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mixplane.layout import _DTYPES as LAYOUT_DTYPES, IMAGE_ARRAYS, SEGMENT_ARRAYS, StepLayout, check_hybrid
from mixplane.planner import selectloop  # first: it names numba's cache directory before numba loads

from numba import njit  # noqa: E402


class GatherInput(NamedTuple):
    """`gather`'s arguments, in its parameter order (tests/unit/test_kernel_inputs.py holds the two together): the
    pieces' columns it reads, then the layout columns it writes (preallocated in their wire dtypes).
    `gather_columns` builds it and calls ``gather(*inp)``, so the compiled body stays positional (numba compiles a
    named tuple of arrays into a slower body: bench/results/structure_before_after.txt). A new column: a field
    here, the parameter at the same place in `gather`, its array in `gather_columns`."""

    order: np.ndarray  # int64 [pieces]: the layout's order of the pieces
    rows: np.ndarray  # [pieces]: each piece's row
    source: np.ndarray  # [pieces]: its source
    key: np.ndarray  # [pieces]: its sample key
    start: np.ndarray  # [pieces]: its first token in the sample
    length: np.ndarray  # [pieces]: its tokens
    patches: np.ndarray  # [pieces]: its image's patches (0: no image starts here)
    img_rank: np.ndarray  # int64 [images]: the encoder rank of each image, in piece order
    seg_row: np.ndarray  # out [pieces]
    seg_source: np.ndarray  # out [pieces]
    seg_key: np.ndarray  # out [pieces]
    seg_start: np.ndarray  # out [pieces]
    seg_len: np.ndarray  # out [pieces]
    o_img: np.ndarray  # out int64 [images]: the piece of every image, in layout order
    img_source: np.ndarray  # out [images]
    img_key: np.ndarray  # out [images]
    img_rank_out: np.ndarray  # out [images]: img_rank in layout order
    img_patches: np.ndarray  # out [images]


@njit(cache=True, nogil=True)
def gather(order, rows, source, key, start, length, patches, img_rank,  # pragma: no cover - compiled
           seg_row, seg_source, seg_key, seg_start, seg_len, o_img, img_source, img_key, img_rank_out, img_patches):
    """Segments in `order`; images (patches > 0) in the same order with the rank `img_rank` gives them
    (img_rank lists image pieces in piece order). Every output is preallocated by the caller."""
    n = len(order)
    img_of_piece = np.empty(n, np.int64)
    c = 0
    for i in range(n):
        if patches[i] > 0:
            img_of_piece[i] = c
            c += 1
        else:
            img_of_piece[i] = -1
    m = 0
    for j in range(n):
        i = order[j]
        seg_row[j] = rows[i]
        seg_source[j] = source[i]
        seg_key[j] = key[i]
        seg_start[j] = start[i]
        seg_len[j] = length[i]
        if patches[i] > 0:
            o_img[m] = i
            img_source[m] = source[i]
            img_key[m] = key[i]
            img_rank_out[m] = img_rank[img_of_piece[i]]
            img_patches[m] = patches[i]
            m += 1


@njit(cache=True, nogil=True)
def order_by_row(rows, key):  # pragma: no cover - compiled
    """(order, True): indices by row, then index -- a counting sort -- when `key` increases strictly (the
    within-row order is the index order: the common case) and rows are small non-negative numbers; else
    (empty, False) and the caller sorts."""
    n = len(rows)
    out = np.empty(n, np.int64)
    if n == 0:
        return out, True
    rmin = rows[0]
    rmax = rows[0]
    for i in range(1, n):
        r = rows[i]
        if r < rmin:
            rmin = r
        if r > rmax:
            rmax = r
        if key[i] <= key[i - 1]:
            return out[:0], False
    if rmin < 0 or rmax >= 4 * n + 65536:
        return out[:0], False
    start = np.zeros(rmax + 2, np.int64)
    for i in range(n):
        start[rows[i] + 1] += 1
    for r in range(rmax + 1):
        start[r + 1] += start[r]
    for i in range(n):
        r = rows[i]
        out[start[r]] = i
        start[r] += 1
    return out, True


@njit(cache=True, nogil=True)
def _layout_faults(seg_row, seg_start, seg_len, rows, seq_len):  # pragma: no cover - compiled
    """(row out of range, rows out of order, empty or negative segment, a row over seq_len) in one pass."""
    n = len(seg_row)
    bad_range = bad_order = bad_seg = False
    fill = np.zeros(rows, np.int64)
    for i in range(n):
        r = seg_row[i]
        if r < 0 or r >= rows:
            bad_range = True
        elif not bad_range:
            fill[r] += seg_len[i]
        if i and r < seg_row[i - 1]:
            bad_order = True
        if seg_len[i] <= 0 or seg_start[i] < 0:
            bad_seg = True
    over = False
    if not bad_range:
        for r in range(rows):
            if fill[r] > seq_len:
                over = True
                break
    return bad_range, bad_order, bad_seg, over


def validate(layout: StepLayout) -> None:
    """StepLayout.validate in one compiled pass: the same checks, the same first error (ValueError naming the step)."""
    n = len(layout.seg_row)
    if any(len(getattr(layout, a)) != n for a in SEGMENT_ARRAYS):
        raise ValueError(f"step {layout.step}: segment arrays differ in length")
    bad_range, bad_order, bad_seg, over = _layout_faults(layout.seg_row, layout.seg_start, layout.seg_len, layout.rows,
                                                         layout.seq_len)
    if bad_range:
        raise ValueError(f"step {layout.step}: segment row out of range")
    if bad_order:
        raise ValueError(f"step {layout.step}: segments are not ordered by row")
    if bad_seg:
        raise ValueError(f"step {layout.step}: empty or negative segment")
    if over:
        raise ValueError(f"step {layout.step}: a row holds more than seq_len={layout.seq_len} tokens")
    check_hybrid(layout.step, layout.hybrid_cp, n, layout.seg_cp_first, layout.seg_cp_size)


@selectloop.warm_once
def warm() -> None:
    """Compile (or load from numba's cache) the loop now, not in the first step; the seconds it took."""
    z = np.zeros(1, np.int64)  # the dtypes StepPlanner.select gives its pieces: a step compiles nothing
    gather_columns(z, z, np.zeros(1, np.int16), z, z, z + 1, z + 1, z)
    order_by_row(np.zeros(2, np.int64), np.arange(2, dtype=np.int64))
    one = np.ones(1, np.int64)
    validate(StepLayout(0, 1, 1, 1, 1, seg_row=one - 1, seg_source=one - 1, seg_key=one - 1, seg_start=one - 1, seg_len=one))


def gather_columns(order: np.ndarray, rows: np.ndarray, source: np.ndarray, key: np.ndarray, start: np.ndarray,
                   length: np.ndarray, patches: np.ndarray, img_rank: np.ndarray
                   ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The layout's nine columns (StepLayout dtypes) and the piece of every image."""
    n = len(order)
    n_img = int(np.count_nonzero(patches > 0))
    if len(img_rank) != n_img:
        raise ValueError(f"img_rank lists {len(img_rank)} ranks for {n_img} images")
    cols = {name: np.empty(n, LAYOUT_DTYPES[name]) for name in SEGMENT_ARRAYS}
    cols.update({name: np.empty(n_img, LAYOUT_DTYPES[name]) for name in IMAGE_ARRAYS})
    o_img = np.empty(n_img, np.int64)
    inp = GatherInput(np.ascontiguousarray(order, np.int64), rows, source, key, start, length, patches,
                      np.ascontiguousarray(img_rank, np.int64),
                      cols["seg_row"], cols["seg_source"], cols["seg_key"], cols["seg_start"], cols["seg_len"], o_img,
                      cols["img_source"], cols["img_key"], cols["img_rank"], cols["img_patches"])
    gather(*inp)
    return cols, o_img

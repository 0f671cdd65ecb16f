"""Routing and layout loops, compiled (numba): per-piece work of a step done in one pass each.

At 16,384 GPUs x 1,024 sources a step has ~145k pieces and ~48k images; in numpy, routing (the loader
instructions: fan-out, image flags, the split by loader) and the layout's row order cost a sort or a
gather per column, ~70 ms a step. Here each is a loop over flat arrays with counting sorts where numpy
sorted, compiled once (cache=True; `warm` before the planner binds its socket, like selectloop):

* `route`       -- routing.loader_instructions' arrays: every segment to each constructor of its DP rank
                   (the last copy carries the retire flag), pixels flagged on the instruction of the image's
                   first span for each constructor of its encoder rank, or an image-only instruction; then
                   a stable counting sort by (source, replica) -- the order numpy's stable argsort gave;
* `image_lists` -- routing.constructor_images: each constructor's images (those whose text starts on one
                   of its DP ranks, and those an encoder leader of one of its ranks encodes), ascending and
                   without duplicates, as one CSR -- the union of two fan-outs per image in one pass instead
                   of two expansions, two sorts and a union1d per constructor;
* `image_offsets` -- routing.image_offsets: each image's offset in the gathered encoder output and every
                   rank's merged tokens, as a counting sort's offsets.

The rules they implement are written plainly in planner/routespec.py; tests/unit/test_routeloop.py holds the
compiled routing to them, bit for bit, on random inputs.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mixplane.planner import selectloop  # first: it names numba's cache directory before numba loads

from numba import njit  # noqa: E402


# ---- loader instructions ------------------------------------------------------------------------

class RouteInput(NamedTuple):
    """`_route`'s inputs, in its parameter order (tests/unit/test_kernel_inputs.py holds the two together), in the
    dtypes the kernel is compiled for: `route` builds it and calls ``_route(*inp)``, so the compiled body stays
    positional (numba compiles a named tuple of arrays into a slower body: bench/results/structure_before_after.txt).
    A new column: a field here, the parameter at the same place in `_route`, its conversion in `route`."""

    pidx: np.ndarray  # int64 [segments]: the piece of every segment
    seg_row: np.ndarray  # [segments]: its row (the layout's dtype)
    rpr: int  # rows per DP rank
    seg_source: np.ndarray  # [segments]: its source
    seg_start: np.ndarray  # [segments]: its first token in the sample
    seg_len: np.ndarray  # [segments]: its tokens
    p_rep: np.ndarray  # int64 [pieces]: the loader replica that reads the piece
    p_pos: np.ndarray  # int64 [pieces]: the sample's position in that loader's stream
    p_ret: np.ndarray  # uint8 [pieces]: the piece retires its sample at the loader
    dp_off: np.ndarray  # int64 [dp ranks + 1]: CSR offsets of each DP rank's constructors
    dp_tgt: np.ndarray  # int32: those constructors
    fseg: np.ndarray  # int64 [images]: the first segment of every image (empty without images)
    img_rank: np.ndarray  # int64 [images]: the encoder rank of every image
    rank_off: np.ndarray  # int64 [ranks + 1]: CSR offsets of each encoder rank's constructors
    rank_tgt: np.ndarray  # int32: those constructors


@njit(cache=True)
def _route(pidx, seg_row, rpr, seg_source, seg_start, seg_len, p_rep, p_pos, p_ret, dp_off, dp_tgt,
           fseg, img_rank, rank_off, rank_tgt):
    n = len(seg_row)
    max_row = -1
    for i in range(n):
        if seg_row[i] > max_row:
            max_row = np.int64(seg_row[i])
    dp_of_row = np.empty(max_row + 1, np.int64)
    for r in range(max_row + 1):
        dp_of_row[r] = r // rpr
    first = np.empty(n + 1, np.int64)  # first instruction of every segment
    first[0] = 0
    for i in range(n):
        d = dp_of_row[seg_row[i]]
        first[i + 1] = first[i] + dp_off[d + 1] - dp_off[d]
    n_tok = first[n]
    m = len(fseg)
    n_img = 0
    for j in range(m):
        r = img_rank[j]
        n_img += rank_off[r + 1] - rank_off[r]
    # the loader (source, replica) of every segment, as a dense id
    max_src = 0
    max_rep = 0
    for i in range(n):
        if seg_source[i] > max_src:
            max_src = np.int64(seg_source[i])
        rp = p_rep[pidx[i]]
        if rp > max_rep:
            max_rep = rp
    width = max_rep + 1
    n_keys = (max_src + 1) * width
    s_wid = np.empty(n, np.int64)
    for i in range(n):
        s_wid[i] = np.int64(seg_source[i]) * width + p_rep[pidx[i]]
    cap = n_tok + n_img
    i_seg = np.empty(cap, np.int64)
    i_dest = np.empty(cap, np.int32)
    i_img = np.zeros(cap, np.uint8)
    i_ret = np.zeros(cap, np.uint8)
    for i in range(n):
        d = dp_of_row[seg_row[i]]
        k = first[i]
        for q in range(dp_off[d], dp_off[d + 1]):
            i_seg[k] = i
            i_dest[k] = dp_tgt[q]
            k += 1
        if k > first[i]:
            i_ret[k - 1] = p_ret[pidx[i]]  # the last copy of a segment retires its sample
    # pixels: on the image's first span for that constructor, else an image-only instruction
    k = n_tok
    for j in range(m):
        s = fseg[j]
        r = img_rank[j]
        for q in range(rank_off[r], rank_off[r + 1]):
            t = rank_tgt[q]
            found = False
            for u in range(first[s], first[s + 1]):
                if i_dest[u] == t:
                    i_img[u] = 1
                    found = True
            if not found:
                i_seg[k] = s
                i_dest[k] = t
                i_img[k] = 1
                k += 1
    tot = k
    # stable counting sort by loader: the output slot of every instruction
    slot = np.empty(tot, np.int64)
    if n_keys <= 4 * tot + (1 << 20):
        count = np.zeros(n_keys + 1, np.int64)
        for u in range(tot):
            count[s_wid[i_seg[u]] + 1] += 1
        for w in range(n_keys):
            count[w + 1] += count[w]
        n_groups = 0
        for w in range(n_keys):
            if count[w + 1] > count[w]:
                n_groups += 1
        g_src = np.empty(n_groups, np.int64)
        g_rep = np.empty(n_groups, np.int64)
        g_lo = np.empty(n_groups + 1, np.int64)
        g = 0
        for w in range(n_keys):
            if count[w + 1] > count[w]:
                g_src[g] = w // width
                g_rep[g] = w % width
                g_lo[g] = count[w]
                g += 1
        g_lo[n_groups] = tot
        for u in range(tot):
            w = s_wid[i_seg[u]]
            slot[u] = count[w]
            count[w] += 1
    else:  # sparse replica numbers: a stable sort instead of counting
        wid = np.empty(tot, np.int64)
        for u in range(tot):
            wid[u] = s_wid[i_seg[u]]
        order = np.argsort(wid, kind="mergesort")
        n_groups = 0
        for v in range(tot):
            if v == 0 or wid[order[v]] != wid[order[v - 1]]:
                n_groups += 1
        g_src = np.empty(n_groups, np.int64)
        g_rep = np.empty(n_groups, np.int64)
        g_lo = np.empty(n_groups + 1, np.int64)
        g = 0
        for v in range(tot):
            slot[order[v]] = v
            if v == 0 or wid[order[v]] != wid[order[v - 1]]:
                w = wid[order[v]]
                g_src[g] = w // width
                g_rep[g] = w % width
                g_lo[g] = v
                g += 1
        g_lo[n_groups] = tot
    o_pos = np.empty(tot, np.int64)
    o_start = np.empty(tot, np.int64)
    o_len = np.empty(tot, np.int64)
    o_dest = np.empty(tot, np.int32)
    o_ret = np.empty(tot, np.uint8)
    o_img = np.empty(tot, np.uint8)
    for u in range(tot):
        v = slot[u]
        s = i_seg[u]
        o_pos[v] = p_pos[pidx[s]]
        o_dest[v] = i_dest[u]
        o_img[v] = i_img[u]
        o_ret[v] = i_ret[u]
        if u < n_tok:
            o_start[v] = seg_start[s]
            o_len[v] = seg_len[s]
        else:  # image only
            o_start[v] = 0
            o_len[v] = 0
    return o_pos, o_start, o_len, o_dest, o_ret, o_img, g_src, g_rep, g_lo


def route(pidx: np.ndarray, seg_row: np.ndarray, rows_per_rank: int, seg_source: np.ndarray, seg_start: np.ndarray,
          seg_len: np.ndarray, p_rep: np.ndarray, p_pos: np.ndarray, p_ret: np.ndarray, dp_off: np.ndarray,
          dp_tgt: np.ndarray, fseg: np.ndarray, img_rank: np.ndarray, rank_off: np.ndarray,
          rank_tgt: np.ndarray) -> tuple[np.ndarray, ...]:
    """(pos, start, len, dest, retire, img) of every instruction, grouped by loader, and the groups'
    (source, replica, bounds [n_groups + 1]). `pidx`: the piece of every segment; `fseg`: the first
    segment of every image (empty without images)."""
    i64 = np.int64
    inp = RouteInput(np.ascontiguousarray(pidx, i64), np.ascontiguousarray(seg_row), int(rows_per_rank),
                     np.ascontiguousarray(seg_source), np.ascontiguousarray(seg_start), np.ascontiguousarray(seg_len),
                     np.ascontiguousarray(p_rep, i64), np.ascontiguousarray(p_pos, i64),
                     np.ascontiguousarray(p_ret, np.uint8), np.ascontiguousarray(dp_off, i64),
                     np.ascontiguousarray(dp_tgt, np.int32), np.ascontiguousarray(fseg, i64),
                     np.ascontiguousarray(img_rank, i64), np.ascontiguousarray(rank_off, i64),
                     np.ascontiguousarray(rank_tgt, np.int32))
    return _route(*inp)


# ---- images per constructor --------------------------------------------------------------------

@njit(cache=True, inline="always")
def _list_image(i, at, off, tgt, last, slot, out):
    """Image i to every constructor of fan-out entry `at` that does not list it yet: counted in `slot`, and
    written at `out[slot]` when `out` is given (non-empty)."""
    for k in range(off[at], off[at + 1]):
        c = tgt[k]
        if last[c] != i:
            last[c] = i
            if len(out):
                out[slot[c]] = i
            slot[c] += 1


@njit(cache=True)
def _image_lists(img_dp, img_rank, dp_off, dp_tgt, ld_off, ld_tgt, n_cons):
    n = len(img_dp)
    offsets = np.zeros(n_cons + 1, np.int64)
    last = np.full(n_cons, -1, np.int64)  # the last image listed for each constructor (no duplicates)
    out = np.empty(0, np.int64)
    slot = np.zeros(n_cons, np.int64)  # first pass: counts
    for p in range(2):
        if p == 1:
            for c in range(n_cons):
                offsets[c + 1] = offsets[c] + slot[c]
            out = np.empty(offsets[n_cons], np.int64)
            slot[:] = offsets[:n_cons]
            last[:] = -1
        for i in range(n):  # images in order: every constructor's list comes out ascending
            _list_image(i, img_dp[i], dp_off, dp_tgt, last, slot, out)
            _list_image(i, img_rank[i], ld_off, ld_tgt, last, slot, out)
    return offsets, out


def image_lists(img_dp: np.ndarray, img_rank: np.ndarray, dp_off: np.ndarray, dp_tgt: np.ndarray, ld_off: np.ndarray,
                ld_tgt: np.ndarray, n_constructors: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets [n_constructors + 1], indices): constructor c needs the images indices[offsets[c]:offsets[c + 1]],
    ascending: those whose DP rank (`img_dp`) it serves (fan-out dp_off/dp_tgt) and those whose encoder rank
    (`img_rank`) leads one of its ranks (ld_off/ld_tgt)."""
    i64 = np.int64
    return _image_lists(np.ascontiguousarray(img_dp, i64), np.ascontiguousarray(img_rank, i64),
                        np.ascontiguousarray(dp_off, i64), np.ascontiguousarray(dp_tgt, np.int32),
                        np.ascontiguousarray(ld_off, i64), np.ascontiguousarray(ld_tgt, np.int32), int(n_constructors))


# ---- where each image's tokens sit in the gathered encoder output --------------------------------

@njit(cache=True)
def _image_offsets(img_rank, img_patches, merge, world):
    n = len(img_rank)
    per_rank = np.zeros(world, np.int64)
    for i in range(n):
        per_rank[img_rank[i]] += np.int64(img_patches[i]) // merge
    at = np.empty(world, np.int64)  # where each rank's next image goes: ranks in order, images in step order
    run = 0
    for r in range(world):
        at[r] = run
        run += per_rank[r]
    base = np.empty(n, np.int64)
    for i in range(n):
        r = img_rank[i]
        base[i] = at[r]
        at[r] += np.int64(img_patches[i]) // merge
    return base, per_rank


def image_offsets(img_rank: np.ndarray, img_patches: np.ndarray, merge: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    """routing.image_offsets of the images' merged tokens (patches // merge), in two passes (a counting sort's
    offsets) instead of a bincount, a stable sort and a running sum. Ranks must lie in [0, world)."""
    return _image_offsets(np.ascontiguousarray(img_rank), np.ascontiguousarray(img_patches), int(merge), int(world))


@selectloop.warm_once
def warm() -> None:
    """Compile (or load from numba's cache) every loop here now, not in the first step; the seconds it took."""
    z = np.zeros(1, np.int64)
    off = np.array([0, 1], np.int64)
    route(z, np.zeros(1, np.int32), 1, np.zeros(1, np.int16), np.zeros(1, np.int32), np.ones(1, np.int32), z, z,
          np.zeros(1, np.uint8), off, np.zeros(1, np.int32), z, z, off, np.zeros(1, np.int32))
    image_lists(z, z, off, np.zeros(1, np.int32), off, np.zeros(1, np.int32), 1)
    image_offsets(np.zeros(1, np.int32), np.zeros(1, np.int32), 1, 1)

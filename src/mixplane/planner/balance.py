"""Vectorised balancers: split items with costs into bins so that the most loaded bin is as light as possible.

Two methods (MegaScale-Data §4.2 `balance`): greedy bin packing (LPT: largest item to the least loaded
bin) and Karmarkar-Karp's largest differencing method. Both come in two forms:

* **equal count** — every bin receives the same number of items (± 1): used when the items are
  packed rows or microbatches and every rank must receive exactly its share of them.
* **free count** — any number of items per bin: used for samples (e.g. images onto encoder ranks).
  Items larger than a small fraction of the target load are placed by the method itself; the many
  small ones then *water-fill* the remaining gaps in one vectorised pass (overshoot at most one
  small item per bin).

Everything works on numpy arrays: LPT runs in rounds (one item per bin per round, the round's
largest item to the currently lightest bin), so its cost is O(rounds x bins log bins) numpy work
instead of one Python step per item; KK starts from balanced k-tuples (BLDM) so it merges only
items / bins tuples. Bins may start with initial loads (`init`), e.g. another module's cost, and
bins may be split into groups (`group_size`, MegaScale-Data: balance within subgroups to bound the
coordination cost on very large clusters).
"""

from __future__ import annotations

import heapq
from typing import Literal

import numpy as np

Method = Literal["greedy", "karmarkar_karp", "none"]
METHODS = ("greedy", "karmarkar_karp", "none")

# items costlier than this fraction of the target bin load are placed by LPT / KK, the rest water-fill
# (a bin overshoots its target by at most one small item, so this bounds the residual imbalance)
SMALL_FRACTION = 0.002
MAX_ROUNDS = 32  # at most this many LPT rounds: the threshold rises when there are more big items


def desc_order(c: np.ndarray) -> np.ndarray:
    """Indices of c from largest to smallest, ties by index. Large arrays are ordered on 16-bit
    log-scale keys (a radix sort, ~7x faster than a float sort; items within 0.02% of each other
    may swap, which no balancer here can notice)."""
    c = np.asarray(c, dtype=np.float64)
    n = len(c)
    if n < 4096:
        return np.argsort(-c, kind="stable")
    pos = c > 0
    key = np.zeros(n, dtype=np.uint16)
    if pos.any():
        lg = np.log(c[pos])
        lo, hi = float(lg.min()), float(lg.max())
        key[pos] = 1 + (((lg - lo) / (hi - lo)) * 65534).astype(np.uint16) if hi > lo else 1
    return np.argsort(65535 - key, kind="stable")


def slots_in_bins(bins: np.ndarray, n_bins: int) -> np.ndarray:
    """Position of every item among the items of its bin (in item order)."""
    bins = np.asarray(bins, dtype=np.int64)
    key = bins.astype(np.uint16) if n_bins <= 65535 else bins
    order = np.argsort(key, kind="stable")
    counts = np.bincount(bins, minlength=n_bins)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    out = np.empty(len(bins), dtype=np.int64)
    out[order] = np.arange(len(bins)) - np.repeat(starts, counts)
    return out


def _as_costs(costs: np.ndarray) -> np.ndarray:
    c = np.asarray(costs, dtype=np.float64)
    if c.ndim != 1:
        raise ValueError("costs must be a 1-D array")
    if len(c) and (not np.all(np.isfinite(c)) or c.min() < 0):
        raise ValueError("costs must be finite and >= 0")
    return c


# ---- greedy (LPT) ---------------------------------------------------------------------------

MAX_BLOCK = 32  # rounds dealt together in one snake block at most
EXACT_ROUNDS = 64  # LPT rounds that re-sort the bins every round; later rounds go in snake blocks


def _round_blocks(n_rounds: int) -> list[tuple[int, int]]:
    """[r0, r1) blocks of rounds: single rounds first, then blocks doubling in size (items get smaller)."""
    out = [(r, r + 1) for r in range(min(n_rounds, EXACT_ROUNDS))]
    r, size = EXACT_ROUNDS, 2
    while r < n_rounds:
        out.append((r, min(n_rounds, r + size)))
        r += size
        size = min(2 * size, MAX_BLOCK)
    return out


def _lpt_rounds(costs: np.ndarray, items: np.ndarray, item_group: np.ndarray, bin_group: np.ndarray,
                loads: np.ndarray, out: np.ndarray) -> None:
    """Equal-count LPT by rounds, within groups: round r gives each bin of a group one item, the round's
    largest item to the group's least loaded bin. The first EXACT_ROUNDS rounds re-sort the bins each
    time; after that rounds are dealt in blocks (doubling in size, as items are small by then) in
    snake order over the bins sorted once per block, so large problems (many items per bin) cost
    O(log) Python steps. Updates `loads` and `out` in place."""
    if len(items) == 0:
        return
    n_groups = int(bin_group.max()) + 1 if len(bin_group) else 0
    if n_groups == 1:
        _lpt_rounds_single(costs, items, loads, out)
        return
    bins_per_group = np.bincount(bin_group, minlength=n_groups)
    bin_first = np.concatenate([[0], np.cumsum(bins_per_group)[:-1]])
    # items sorted by group, then cost descending (stable: ties keep item order -> deterministic)
    ig = item_group[items]
    o1 = desc_order(costs[items])  # by cost, then (stable) by group
    order = o1[np.argsort(ig[o1], kind="stable")]
    items = items[order]
    ig = ig[order]
    start = np.searchsorted(ig, np.arange(n_groups))
    q = np.arange(len(items)) - start[ig]
    nb = bins_per_group[ig]
    rnd = q // nb
    slot = q % nb
    # a round with fewer items than bins (the last of a group) gives them to the lightest bins: keep
    # such rounds exact (never reversed by the snake)
    full_round = (np.minimum(nb, np.bincount(ig, minlength=n_groups)[ig] - rnd * nb) == nb)
    by_round = np.arange(len(items)) if n_groups == 1 else np.argsort(rnd, kind="stable")
    bounds = np.searchsorted(rnd[by_round], np.arange(int(rnd.max()) + 2))
    nbins = len(loads)
    for r0, r1 in _round_blocks(len(bounds) - 1):
        sel = by_round[bounds[r0]:bounds[r1]]
        if len(sel) == 0:
            continue
        bin_order = np.lexsort((np.arange(nbins), loads, bin_group))
        sl = slot[sel]
        odd = ((rnd[sel] - r0) % 2 == 1) & full_round[sel]
        sl = np.where(odd, nb[sel] - 1 - sl, sl)
        b = bin_order[bin_first[ig[sel]] + sl]
        out[items[sel]] = b
        loads += np.bincount(b, weights=costs[items[sel]], minlength=nbins)


def _lpt_rounds_single(costs: np.ndarray, items: np.ndarray, loads: np.ndarray, out: np.ndarray) -> None:
    """_lpt_rounds for one group of bins, on contiguous slices of the sorted items."""
    nb = len(loads)
    c_items = costs[items]
    order = desc_order(c_items)
    items = items[order]
    c_sorted = c_items[order]
    n = len(items)
    n_rounds = -(-n // nb)
    arange_nb = np.arange(nb)
    for r0, r1 in _round_blocks(n_rounds):
        lo, hi = r0 * nb, min(r1 * nb, n)
        bin_order = np.argsort(loads, kind="stable")
        m = hi - lo
        if r1 - r0 == 1:
            b = bin_order[:m]
        else:
            k = np.arange(m)
            rr = k // nb
            sl = k - rr * nb
            full = (r0 + rr + 1) * nb <= n
            sl = np.where((rr % 2 == 1) & full, nb - 1 - sl, sl)
            b = bin_order[sl]
        out[items[lo:hi]] = b
        if m == nb and r1 - r0 == 1:
            loads[b] += c_sorted[lo:hi]
        else:
            loads += np.bincount(b, weights=c_sorted[lo:hi], minlength=nb)
    del arange_nb


def _lpt_open_rounds(costs: np.ndarray, items: np.ndarray, item_group: np.ndarray, bin_group: np.ndarray,
                     loads: np.ndarray, out: np.ndarray, target: np.ndarray, max_rounds: int) -> np.ndarray:
    """Free-count LPT by rounds, within groups: each round hands the group's next largest items to its
    *open* bins (load below the group's target), largest to lightest; a bin that reaches the target
    closes, so a bin holding one huge item takes nothing more. Returns the items left unassigned after
    max_rounds rounds (the caller water-fills them)."""
    if len(target) == 1 and len(items):
        return _lpt_open_rounds_single(costs, items[desc_order(costs[items])], loads, out, float(target[0]), max_rounds)
    return lpt_open_rounds_groups(costs, items, item_group, bin_group, loads, out, target, max_rounds)


def lpt_open_rounds_groups(costs: np.ndarray, items: np.ndarray, item_group: np.ndarray, bin_group: np.ndarray,
                           loads: np.ndarray, out: np.ndarray, target: np.ndarray, max_rounds: int) -> np.ndarray:
    """_lpt_open_rounds for any number of groups (vectorised over them): the rule's readable form, which
    _lpt_open_rounds_single must equal for one group (tests/unit/test_planner_balance.py)."""
    if len(items) == 0:
        return items
    n_groups = len(target)
    ig = item_group[items]
    o1 = desc_order(costs[items])
    order = o1[np.argsort(ig[o1], kind="stable")] if n_groups > 1 else o1
    items, ig = items[order], ig[order]
    gcount = np.bincount(ig, minlength=n_groups)
    gstart = np.concatenate([[0], np.cumsum(gcount)[:-1]])
    ptr = np.zeros(n_groups, dtype=np.int64)
    nbins = len(loads)
    bin_t = target[bin_group]
    bidx = np.arange(nbins)
    for _ in range(max_rounds):
        left = gcount - ptr
        if not left.any():
            break
        open_ = loads < bin_t
        # groups whose bins are all closed (overshoot) hand items to every bin
        n_open = np.bincount(bin_group[open_], minlength=n_groups)
        open_ |= (n_open == 0)[bin_group]
        # as in LPT, only bins within one (next) item of the group's lightest bin take part this round
        gmin = np.full(n_groups, np.inf)
        np.minimum.at(gmin, bin_group[open_], loads[open_])
        nxt = np.where(left > 0, costs[items[np.minimum(gstart + ptr, len(items) - 1)]], 0.0)
        open_ &= loads <= (gmin + nxt)[bin_group]
        ob = bidx[open_]
        ob = ob[np.lexsort((ob, loads[ob], bin_group[ob]))]  # open bins by group, then load
        og = bin_group[ob]
        n_open = np.bincount(og, minlength=n_groups)
        take = np.minimum(n_open, left)
        ostart = np.concatenate([[0], np.cumsum(n_open)[:-1]])
        g_rep = np.repeat(np.arange(n_groups), take)
        j = np.arange(int(take.sum())) - np.repeat(np.concatenate([[0], np.cumsum(take)[:-1]]), take)
        it = items[gstart[g_rep] + ptr[g_rep] + j]
        b = ob[ostart[g_rep] + j]
        out[it] = b
        loads += np.bincount(b, weights=costs[it], minlength=nbins)
        ptr += take
    rest = [items[gstart[g] + ptr[g]: gstart[g] + gcount[g]] for g in range(n_groups) if ptr[g] < gcount[g]]
    return np.concatenate(rest) if rest else items[:0]


def _lpt_open_rounds_single(costs: np.ndarray, items: np.ndarray, loads: np.ndarray, out: np.ndarray, target: float,
                            max_rounds: int) -> np.ndarray:
    """_lpt_open_rounds for one group of bins (items largest first): the same rounds without the per-group
    bookkeeping (the image balancer's case, 16,384 encoder ranks: ~15 passes over every bin a round and a
    three-key sort of the open ones, ~4 ms a step). The same bins for every item."""
    ptr, n = 0, len(items)
    for _ in range(max_rounds):
        if ptr == n:
            break
        open_ = loads < target
        if not open_.any():  # every bin overshot: all take part
            open_[:] = True
        cut = loads[open_].min() + costs[items[ptr]]  # within one (next) item of the lightest open bin
        ob = np.flatnonzero(open_ & (loads <= cut))
        ob = ob[np.argsort(loads[ob], kind="stable")][: n - ptr]  # lightest first, then by index
        it = items[ptr: ptr + len(ob)]
        out[it] = ob
        loads[ob] += costs[it]  # one item per bin: what the bincount of the general rounds adds
        ptr += len(ob)
    return items[ptr:]


def _repair_over_target(costs: np.ndarray, items: np.ndarray, out: np.ndarray, loads: np.ndarray,
                        bin_target: np.ndarray, bin_group: np.ndarray, max_moves: int | None = None) -> None:
    """Move items out of bins above their target into the lightest bin of the same group while that lowers
    the heavier of the two (KK balances the large items among themselves, unaware of the small ones
    that will fill the other bins later)."""
    if len(items) == 0:
        return
    members: dict[int, list[int]] = {}
    for i in items.tolist():
        members.setdefault(int(out[i]), []).append(i)
    for _ in range(max_moves if max_moves is not None else 4 * len(loads)):
        over = np.nonzero(loads > bin_target * (1 + 1e-9))[0]
        if len(over) == 0:
            break
        hi = int(over[np.argmax(loads[over] - bin_target[over])])
        mem = members.get(hi)
        if not mem:
            break
        same = np.nonzero(bin_group == bin_group[hi])[0]
        lo = int(same[np.argmin(loads[same])])
        i = min(mem, key=lambda x: costs[x])
        if lo == hi or loads[lo] + costs[i] >= loads[hi]:
            break
        mem.remove(i)
        members.setdefault(lo, []).append(i)
        out[i] = lo
        loads[hi] -= costs[i]
        loads[lo] += costs[i]


def _water_fill(costs: np.ndarray, items: np.ndarray, item_group: np.ndarray, bin_group: np.ndarray,
                loads: np.ndarray, out: np.ndarray) -> None:
    """Fill each group's bins up to the group's mean load with small items, contiguously."""
    if len(items) == 0:
        return
    n_groups = int(bin_group.max()) + 1
    ig = item_group[items]
    if n_groups > 1:  # contiguous per group; inside a group any order works (overshoot <= one item)
        order = np.argsort(ig, kind="stable")
        items, ig = items[order], ig[order]
    c = costs[items]
    tot_items = np.bincount(ig, weights=c, minlength=n_groups)
    tot_loads = np.bincount(bin_group, weights=loads, minlength=n_groups)
    nbins = np.bincount(bin_group, minlength=n_groups)
    target = (tot_items + tot_loads) / np.maximum(nbins, 1)
    deficit = np.maximum(target[bin_group] - loads, 0.0)
    dsum = np.bincount(bin_group, weights=deficit, minlength=n_groups)
    scale = np.where(dsum > 0, tot_items / np.where(dsum > 0, dsum, 1.0), 0.0)
    deficit = deficit * scale[bin_group]
    # bins sorted by group (stable), cumulative deficit within the group
    border = np.argsort(bin_group, kind="stable")
    bg = bin_group[border]
    cd = np.cumsum(deficit[border])
    gstart_b = np.searchsorted(bg, np.arange(n_groups))
    base_b = np.where(gstart_b > 0, cd[np.maximum(gstart_b - 1, 0)], 0.0)
    cdg = cd - base_b[bg]  # cumulative within group
    # cumulative item cost within group; place each item where its midpoint falls
    ci = np.cumsum(c)
    gstart_i = np.searchsorted(ig, np.arange(n_groups))
    base_i = np.where(gstart_i > 0, ci[np.maximum(gstart_i - 1, 0)], 0.0)
    mid = ci - base_i[ig] - 0.5 * c
    # search within each group's slice of cdg: offset the keys by group so one searchsorted serves all
    span = float(cdg.max() if len(cdg) else 0.0) + float(mid.max() if len(mid) else 0.0) + 1.0
    keys_b = cdg + bg * span
    keys_i = mid + ig * span
    pos = np.searchsorted(keys_b, keys_i, side="right")
    last = gstart_b + nbins - 1
    pos = np.minimum(np.maximum(pos, gstart_b[ig]), last[ig])
    b = border[pos]
    out[items] = b
    loads += np.bincount(b, weights=c, minlength=len(loads))


# ---- Karmarkar-Karp (largest differencing, k-way) ------------------------------------------------

KK_SEQUENTIAL_MAX = 256  # up to this many k-tuples KK merges one pair at a time (heap); beyond, in batches


def _kk_equal_batched(costs: np.ndarray, items: np.ndarray, n_bins: int, init: np.ndarray | None) -> np.ndarray:
    """BLDM with the merges of one level done together: k-tuples sorted by spread are merged in pairs
    (1st with 2nd, 3rd with 4th, ...), each pair's largest subset with the other's smallest, until
    one tuple is left; log2(tuples) vectorised levels instead of one Python step per merge."""
    k = n_bins
    n = len(items)
    c_items = costs[items]
    order = desc_order(c_items)
    rows = -(-n // k)
    pad = rows * k - n
    vals = np.concatenate([c_items[order], np.zeros(pad)]).reshape(rows, k)
    has_init = init is not None and np.any(init != 0)
    if has_init:
        vals = np.vstack([vals, np.asarray(init, dtype=np.float64)[None, :]])
    T = vals.shape[0]
    # keep every tuple's sums sorted descending (leaves are chunks of a sorted list; init is sorted here)
    o = np.argsort(-vals, axis=1, kind="stable")
    vals = np.take_along_axis(vals, o, axis=1)
    leaf_inv = np.argsort(o, axis=1)  # original column -> sorted slot
    levels: list[tuple[np.ndarray, np.ndarray]] = []  # per level: tuple map (T_l,), slot map (T_l, k)
    rev = np.arange(k - 1, -1, -1)
    while vals.shape[0] > 1:
        t_l = vals.shape[0]
        spread = vals[:, 0] - vals[:, -1]
        so = np.argsort(-spread, kind="stable")
        m = len(so) // 2
        a, b = so[0:2 * m:2], so[1:2 * m:2]
        rest = so[2 * m:]
        merged = vals[a] + vals[b][:, ::-1]
        mo = np.argsort(-merged, axis=1, kind="stable")
        merged = np.take_along_axis(merged, mo, axis=1)
        minv = np.argsort(mo, axis=1)
        tmap = np.empty(t_l, dtype=np.int64)
        tmap[a] = np.arange(m)
        tmap[b] = np.arange(m)
        tmap[rest] = m + np.arange(len(rest))
        smap = np.tile(np.arange(k), (t_l, 1))
        smap[a] = minv  # slot s of a -> minv[p, s]
        smap[b] = minv[:, rev]  # slot s of b sits at k-1-s in the merge
        levels.append((tmap, smap))
        vals = np.vstack([merged, vals[rest]])
    # compose top-down: final subset of every (leaf tuple, slot)
    M = np.arange(k)[None, :]
    for tmap, smap in reversed(levels):
        M = M[tmap[:, None], smap]
    subset_to_bin = np.arange(k)
    if has_init:
        init_final = M[T - 1, leaf_inv[T - 1]]  # final subset holding bin b's initial load
        subset_to_bin = np.empty(k, dtype=np.int64)
        subset_to_bin[init_final] = np.arange(k)
    final = np.take_along_axis(M, leaf_inv, axis=1)[:rows].reshape(-1)  # by (row, original column)
    out = np.empty(n, dtype=np.int64)
    out[order] = subset_to_bin[final[:n]]
    return out


KK_FREE_EXACT_MAX = 2048  # up to this many (big) items free-count KK starts from singletons (true KK)


def _kk_free(costs: np.ndarray, items: np.ndarray, n_bins: int, init: np.ndarray | None) -> np.ndarray:
    """Karmarkar-Karp k-way (largest differencing) from singletons: any number of items per bin.

    Partial solutions are kept sparse (only their non-empty subsets), so a merge costs O(subsets)
    and the whole run O(n log n + n k) at worst; used for up to KK_FREE_EXACT_MAX items."""
    k = n_bins
    heap: list[tuple[float, int, np.ndarray, list[list[int]]]] = []
    counter = 0
    for i in items.tolist():
        heap.append((-float(costs[i]), counter, np.array([costs[i]]), [[i]]))
        counter += 1
    if init is not None and np.any(init != 0):
        desc = np.argsort(-init, kind="stable")
        heap.append((-(float(init.max() - init.min())), counter, init[desc].astype(np.float64), [[-1 - int(b)] for b in desc]))
        counter += 1
    if not heap:
        return np.zeros(0, dtype=np.int64)
    heapq.heapify(heap)
    while len(heap) > 1:
        _, _, va, ma = heapq.heappop(heap)
        _, _, vb, mb = heapq.heappop(heap)
        a, b = len(va), len(vb)
        o = max(0, a + b - k)  # subsets that pair up: a's smallest o with b's smallest o, crosswise
        if o:
            paired = va[a - o:] + vb[b - o:][::-1]
            pm = [ma[a - o + t] + mb[b - 1 - t] for t in range(o)]
            vals = np.concatenate([va[:a - o], vb[:b - o], paired])
            members = ma[:a - o] + mb[:b - o] + pm
        else:
            vals = np.concatenate([va, vb])
            members = ma + mb
        order = np.argsort(-vals, kind="stable")
        vals = vals[order]
        members = [members[i] for i in order]
        spread = float(vals[0] - (vals[-1] if len(vals) == k else 0.0))
        heapq.heappush(heap, (-spread, counter, vals, members))
        counter += 1
    _, _, vals, members = heap[0]
    out_bin: dict[int, int] = {}
    pinned: dict[int, int] = {}
    for si, mem in enumerate(members):
        pins = [-1 - x for x in mem if x < 0]
        if pins:
            pinned[si] = pins[0]
    used = set(pinned.values())
    free_bins = iter([b for b in range(k) if b not in used])
    for si, mem in enumerate(members):
        at = pinned.get(si)
        if at is None:
            at = next(free_bins)
        for x in mem:
            if x >= 0:
                out_bin[x] = at
    return np.array([out_bin[i] for i in items.tolist()], dtype=np.int64)


def _kk_equal(costs: np.ndarray, items: np.ndarray, n_bins: int, init: np.ndarray | None) -> np.ndarray:
    """Balanced largest differencing (BLDM): bins of `items`, equal counts (± 1); `init` pins loads to bins."""
    k = n_bins
    n = len(items)
    if -(-n // k) > KK_SEQUENTIAL_MAX:
        return _kk_equal_batched(costs, items, n_bins, init)
    c_items = costs[items]
    order = np.argsort(-c_items, kind="stable")
    rows = -(-n // k) if n else 0
    pad = rows * k - n
    vals = np.concatenate([c_items[order], np.zeros(pad)]).reshape(rows, k) if rows else np.zeros((0, k))
    ids = np.concatenate([order, np.full(pad, -1, dtype=np.int64)]).reshape(rows, k) if rows else np.zeros((0, k), np.int64)
    # nodes: leaves 0..rows-1 (chunks), optional init leaf, then merges
    sums: list[np.ndarray] = [vals[r].copy() for r in range(rows)]
    has_init = init is not None and np.any(init != 0)
    if has_init:
        sums.append(np.asarray(init, dtype=np.float64).copy())
    n_leaves = len(sums)
    children: list[tuple[int, int, np.ndarray, np.ndarray]] = []
    heap = [(-(float(s.max() - s.min())), i, i) for i, s in enumerate(sums)]
    heapq.heapify(heap)
    node_sums = {i: s for i, s in enumerate(sums)}
    next_id = n_leaves
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        sa, sb = node_sums.pop(a), node_sums.pop(b)
        oa = np.argsort(-sa, kind="stable")
        ob = np.argsort(sb, kind="stable")
        s = sa[oa] + sb[ob]
        children.append((a, b, oa, ob))
        node_sums[next_id] = s
        heapq.heappush(heap, (-(float(s.max() - s.min())), next_id, next_id))
        next_id += 1
    if not node_sums:
        return np.zeros(0, dtype=np.int64)
    root = next(iter(node_sums))
    # resolve: final subset index of each slot of every node, top-down
    slot_map: dict[int, np.ndarray] = {root: np.arange(k)}
    for nid in range(next_id - 1, n_leaves - 1, -1):
        a, b, oa, ob = children[nid - n_leaves]
        m = slot_map.pop(nid)
        ma = np.empty(k, dtype=np.int64)
        ma[oa] = m
        mb = np.empty(k, dtype=np.int64)
        mb[ob] = m
        slot_map[a] = ma
        slot_map[b] = mb
    # subset -> bin: identity, unless an init leaf pins subsets to bins
    subset_to_bin = np.arange(k)
    if has_init:
        m = slot_map[n_leaves - 1]  # slot b of the init leaf (= bin b) -> final subset
        subset_to_bin = np.empty(k, dtype=np.int64)
        subset_to_bin[m] = np.arange(k)
    out = np.empty(n, dtype=np.int64)
    for r in range(rows):
        sel = ids[r] >= 0
        out[ids[r][sel]] = subset_to_bin[slot_map[r][sel]]
    return out


REFINE_TOLERANCE = 5e-3  # heaviest - lightest below 0.5% of the mean: not worth the swaps
REFINE_MAX_ITER = 256

# ---- refinement ------------------------------------------------------------------------------------

def refine_swaps(costs: np.ndarray, bins: np.ndarray, n_bins: int, max_iter: int | None = None) -> np.ndarray:
    """Improve an assignment without changing any bin's item count: repeatedly swap one item of the
    heaviest bin with one of the lightest so that their difference comes closest to half the gap.

    Round-based LPT and BLDM both deal items in strata of similar size, so one item far larger than
    the rest of its stratum (a 16k-token document among short ones) can leave its bin heavy; a few
    such swaps hand that bin the smallest items instead. Stops when no swap between the extremes helps."""
    costs = np.asarray(costs, dtype=np.float64)
    bins = np.asarray(bins, dtype=np.int64).copy()
    n = len(bins)
    if n == 0 or n_bins < 2:
        return bins
    loads = np.bincount(bins, weights=costs, minlength=n_bins)
    mean = float(loads.mean())
    if loads.max() - loads.min() <= REFINE_TOLERANCE * mean:
        return bins
    order = np.argsort(bins.astype(np.uint16) if n_bins <= 65535 else bins, kind="stable")
    counts = np.bincount(bins, minlength=n_bins)
    start = np.concatenate([[0], np.cumsum(counts)])
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    for _ in range(max_iter if max_iter is not None else min(2 * n_bins + 16, REFINE_MAX_ITER)):
        hi = int(np.argmax(loads))
        lo = int(np.argmin(loads))
        gap = loads[hi] - loads[lo]
        if gap <= REFINE_TOLERANCE * mean or counts[hi] == 0 or counts[lo] == 0:
            break
        A = order[start[hi]:start[hi + 1]]
        Bs = order[start[lo]:start[lo + 1]]
        cb_o = np.argsort(costs[Bs], kind="stable")
        cb = costs[Bs][cb_o]
        ca = costs[A]
        want = ca - gap / 2  # ideal partner cost for each item of the heavy bin
        j = np.clip(np.searchsorted(cb, want), 1, len(cb) - 1) if len(cb) > 1 else np.zeros(len(ca), np.int64)
        cand = np.stack([j - 1, j]) if len(cb) > 1 else np.stack([j])
        d = ca[None, :] - cb[cand]  # cost moved from hi to lo by each candidate swap
        new_gap = np.abs(gap - 2 * d)
        new_gap = np.where(d > 0, new_gap, np.inf)
        best = np.unravel_index(int(np.argmin(new_gap)), new_gap.shape)
        if not new_gap[best] < gap * (1 - 1e-12):
            break
        ia = int(A[best[1]])
        ib = int(Bs[cb_o[cand[best]]])
        moved = costs[ia] - costs[ib]
        loads[hi] -= moved
        loads[lo] += moved
        bins[ia], bins[ib] = lo, hi
        pa, pb = pos[ia], pos[ib]
        order[pa], order[pb] = ib, ia
        pos[ia], pos[ib] = pb, pa
    return bins


# ---- public API ---------------------------------------------------------------------------------

def assign(costs: np.ndarray, n_bins: int, method: str = "greedy", *, equal_count: bool = False,
           init: np.ndarray | None = None, group_size: int | None = None,
           small_fraction: float = SMALL_FRACTION) -> np.ndarray:
    """Bin (0..n_bins-1) of every item.

    method: 'greedy' (LPT), 'karmarkar_karp' (largest differencing) or 'none' (round robin in
    item order, the unbalanced baseline). equal_count: every bin gets len(costs) // n_bins items
    or one more. init: loads the bins start with. group_size: bins are cut into groups of that many
    consecutive bins; items are first balanced over the groups, then inside each group.
    """
    costs = _as_costs(costs)
    n = len(costs)
    if n_bins < 1:
        raise ValueError("n_bins must be >= 1")
    if method not in METHODS:
        raise ValueError(f"unknown balance method {method!r} (expected one of {', '.join(METHODS)})")
    init = None if init is None else np.asarray(init, dtype=np.float64)
    if init is not None and init.shape != (n_bins,):
        raise ValueError(f"init must have one load per bin ({n_bins})")
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    scale = float(costs.mean()) or 1.0  # work in units of the mean item: keeps sums well inside float range
    costs = costs / scale
    if init is not None:
        init = init / scale
    if method == "none":
        if equal_count:  # contiguous runs, the first n % n_bins bins one item longer
            q, r = divmod(n, n_bins)
            return np.repeat(np.arange(n_bins, dtype=np.int64), q + (np.arange(n_bins) < r))
        return (np.arange(n) % n_bins).astype(np.int64)
    if group_size and 1 < group_size < n_bins:
        return _assign_grouped(costs, n_bins, method, equal_count, init, int(group_size), small_fraction)
    group = np.zeros(n, dtype=np.int64)
    bin_group = np.zeros(n_bins, dtype=np.int64)
    return _assign_in_groups(costs, group, bin_group, method, equal_count, init, small_fraction)


def _assign_in_groups(costs: np.ndarray, item_group: np.ndarray, bin_group: np.ndarray, method: str,
                      equal_count: bool, init: np.ndarray | None, small_fraction: float) -> np.ndarray:
    n_bins = len(bin_group)
    loads = np.zeros(n_bins) if init is None else init.astype(np.float64).copy()
    out = np.full(len(costs), -1, dtype=np.int64)
    everything = np.arange(len(costs))
    single = int(bin_group.max()) == 0
    if equal_count and single:
        if method == "greedy":
            _lpt_rounds(costs, everything, item_group, bin_group, loads, out)
        else:
            out = _kk_equal(costs, everything, n_bins, init)
        return refine_swaps(costs, out, n_bins) if init is None else out
    if equal_count:  # several groups (one group returned above)
        if method == "karmarkar_karp":
            # KK per group (groups are small when group_size is used)
            for g in range(int(bin_group.max()) + 1):
                its = everything[item_group == g]
                bins = np.nonzero(bin_group == g)[0]
                out[its] = bins[_kk_equal(costs, its, len(bins), None if init is None else init[bins])]
            return out
        _lpt_rounds(costs, everything, item_group, bin_group, loads, out)
        return out
    # free count: big items by the method, small ones water-fill
    n_groups = int(bin_group.max()) + 1
    tot = np.bincount(item_group, weights=costs, minlength=n_groups) + np.bincount(bin_group, weights=loads, minlength=n_groups)
    target = tot / np.maximum(np.bincount(bin_group, minlength=n_groups), 1)
    big = costs > small_fraction * target[item_group]
    if big.sum() > MAX_ROUNDS * n_bins:
        thr = np.partition(costs, len(costs) - MAX_ROUNDS * n_bins)[len(costs) - MAX_ROUNDS * n_bins]
        big &= costs > thr
    big_items = everything[big]
    small = everything[~big]
    more = big_items[:0]
    if method == "karmarkar_karp" and len(big_items) > KK_FREE_EXACT_MAX:
        # exact KK for the largest items only; the next ones go by target-aware LPT rounds
        o = desc_order(costs[big_items])
        more = big_items[o[KK_FREE_EXACT_MAX:]]
        big_items = big_items[o[:KK_FREE_EXACT_MAX]]
    if method == "karmarkar_karp" and len(big_items):
        def kk(its: np.ndarray, nb: int, ld: np.ndarray) -> np.ndarray:
            init_ = ld if np.any(ld) else None
            if len(its) <= 2 * KK_FREE_EXACT_MAX and n_groups <= 8:
                return _kk_free(costs, its, nb, init_)
            return _kk_equal(costs, its, nb, init_)  # balanced variant for very many big items

        if single:
            out[big_items] = kk(big_items, n_bins, loads)
        else:
            for g in range(n_groups):
                its = big_items[item_group[big_items] == g]
                bins = np.nonzero(bin_group == g)[0]
                if len(its):
                    out[its] = bins[kk(its, len(bins), loads[bins])]
        loads += np.bincount(out[big_items], weights=costs[big_items], minlength=n_bins)
        _repair_over_target(costs, big_items, out, loads, target[bin_group], bin_group)
        left = _lpt_open_rounds(costs, more, item_group, bin_group, loads, out, target, EXACT_ROUNDS)
        if len(left):
            small = np.concatenate([left, small])
    else:
        left = _lpt_open_rounds(costs, big_items, item_group, bin_group, loads, out, target, EXACT_ROUNDS)
        if len(left):
            small = np.concatenate([left, small])
    # water-fill in passes from the larger small items to the smallest: each pass levels the bins again,
    # so what one pass overshoots the next takes back; the final overshoot is half an item of the last pass
    small = small[desc_order(costs[small])]
    n_small = len(small)
    cuts = [0, n_small // 2, (3 * n_small) // 4, (7 * n_small) // 8, n_small]
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        if hi > lo:
            _water_fill(costs, small[lo:hi], item_group, bin_group, loads, out)
    return out


def _assign_grouped(costs: np.ndarray, n_bins: int, method: str, equal_count: bool, init: np.ndarray | None,
                    group_size: int, small_fraction: float) -> np.ndarray:
    """Items onto groups of group_size consecutive bins first, then onto the bins inside each group."""
    n_groups = -(-n_bins // group_size)
    bin_group = np.arange(n_bins) // group_size
    members = np.bincount(bin_group, minlength=n_groups)
    if np.all(members == members[0]):
        ginit = np.bincount(bin_group, weights=init, minlength=n_groups) if init is not None else None
        item_group = assign(costs, n_groups, method, equal_count=equal_count, init=ginit, small_fraction=small_fraction)
    else:  # a smaller last group: balance over every bin, then keep only the group of each item
        item_group = bin_group[assign(costs, n_bins, method, equal_count=equal_count, init=init,
                                      small_fraction=small_fraction)]
    return _assign_in_groups(costs, item_group, bin_group, method, equal_count, init, small_fraction)


def imbalance(loads: np.ndarray) -> float:
    """max / mean of bin loads (1.0 is perfect)."""
    loads = np.asarray(loads, dtype=np.float64)
    m = loads.mean() if len(loads) else 0.0
    return float(loads.max() / m) if m > 0 else 1.0


# ---- packing pieces into rows with balanced costs ---------------------------------------------------

def pack_balanced(lengths: np.ndarray, costs: np.ndarray, n_rows: int, seq_len: int,
                  method: str = "greedy") -> np.ndarray | None:
    """Rows (0..n_rows-1) for pieces so that no row exceeds seq_len tokens and row costs are even.

    Long pieces (more than seq_len / 8 tokens) are spread over rows by LPT rounds (or KK) on cost,
    each only into a row with room; the rest fill the remaining room by tokens, in a few vectorised
    passes, and a final best-fit pass places stragglers. Returns None when the pieces cannot all be
    placed this way (the caller then keeps a packing it already knows to be feasible).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    costs = _as_costs(costs)
    n = len(lengths)
    out = np.full(n, -1, dtype=np.int64)
    if n == 0:
        return out
    if lengths.max() > seq_len or lengths.min() <= 0:
        raise ValueError("pieces must be in 1..seq_len tokens")
    if lengths.sum() > n_rows * seq_len:
        return None
    free = np.full(n_rows, seq_len, dtype=np.int64)
    loads = np.zeros(n_rows)
    big = lengths > seq_len // 8
    big_items = np.nonzero(big)[0]
    if len(big_items):
        if method == "karmarkar_karp":
            trial = np.full(n, -1, dtype=np.int64)
            trial[big_items] = _kk_equal(costs, big_items, n_rows, None)
            rows_tok = np.bincount(trial[big_items], weights=lengths[big_items], minlength=n_rows)
            if np.all(rows_tok <= seq_len):
                out[big_items] = trial[big_items]
            else:
                method = "greedy"
        if method != "karmarkar_karp" or out[big_items[0]] < 0:
            order = big_items[np.argsort(-costs[big_items], kind="stable")]
            pending = order
            for _ in range(64):
                if len(pending) == 0:
                    break
                room_order = np.lexsort((np.arange(n_rows), loads))
                take = pending[:n_rows]
                cand = room_order[: len(take)]
                ok = free[cand] >= lengths[take]
                # rows are distinct within a round, so accepted pieces never collide
                acc = take[ok]
                out[acc] = cand[ok]
                np.subtract.at(free, cand[ok], lengths[acc])
                np.add.at(loads, cand[ok], costs[acc])
                rejected = take[~ok]
                if len(rejected) == len(take):
                    # nothing fitted in the load order: best fit by room for these
                    if not _best_fit_by_room(rejected, lengths, costs, free, loads, out):
                        return None
                    rejected = rejected[:0]
                pending = np.concatenate([rejected, pending[len(take):]])
            if len(pending):
                return None
        else:
            np.subtract.at(free, out[big_items], lengths[big_items])
            np.add.at(loads, out[big_items], costs[big_items])
    small = np.nonzero(~big)[0]
    small = small[np.argsort(-lengths[small], kind="stable")]
    for _ in range(8):
        if len(small) == 0:
            break
        room_rows = np.nonzero(free > 0)[0]
        if len(room_rows) == 0:
            return None
        # rows with the least cost first take the most
        room_rows = room_rows[np.argsort(loads[room_rows], kind="stable")]
        cum_room = np.cumsum(free[room_rows])
        cum_len = np.cumsum(lengths[small])
        end = cum_len
        beg = cum_len - lengths[small]
        r_end = np.searchsorted(cum_room, end, side="left")
        r_beg = np.searchsorted(cum_room, beg, side="right")
        fits = (r_end == r_beg) & (r_end < len(room_rows))
        rows = room_rows[np.minimum(r_end, len(room_rows) - 1)]
        acc = small[fits]
        out[acc] = rows[fits]
        np.subtract.at(free, rows[fits], lengths[acc])
        np.add.at(loads, rows[fits], costs[acc])
        small = small[~fits]
    if not _best_fit_by_room(small, lengths, costs, free, loads, out):  # stragglers
        return None
    return out


def _best_fit_by_room(items: np.ndarray, lengths: np.ndarray, costs: np.ndarray, free: np.ndarray,
                      loads: np.ndarray, out: np.ndarray) -> bool:
    """Place each item in the row with the least room that still fits it; False if one fits nowhere."""
    for i in items:
        fits = np.nonzero(free >= lengths[i])[0]
        if len(fits) == 0:
            return False
        r = fits[np.argmin(free[fits])]
        out[i] = r
        free[r] -= lengths[i]
        loads[r] += costs[i]
    return True

"""balance._lpt_open_rounds as it was before its one-group path (planner/balance._lpt_open_rounds_single), for
equivalence tests."""

from __future__ import annotations

import numpy as np

from mixplane.planner.balance import desc_order


def old_lpt_open_rounds(costs: np.ndarray, items: np.ndarray, item_group: np.ndarray, bin_group: np.ndarray,
                     loads: np.ndarray, out: np.ndarray, target: np.ndarray, max_rounds: int) -> np.ndarray:
    """Free-count LPT by rounds, within groups: each round hands the group's next largest items to its
    *open* bins (load below the group's target), largest to lightest; a bin that reaches the target
    closes, so a bin holding one huge item takes nothing more. Returns the items left unassigned after
    max_rounds rounds (the caller water-fills them)."""
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

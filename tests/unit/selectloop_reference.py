"""The former compiled pick-and-place loop (planner/selectloop.py before issue 14's rewrite: a bitset over
free * rows + row keys for best fit, versioned heap entries), verbatim, so that the rewrite can be compared
with it byte for byte on random and adversarial inputs (tests/unit/test_planner_select.py)."""

from __future__ import annotations

import numpy as np
from numba import njit

POLICY = {"best_fit": 0, "next_fit": 1, "none": 2}
_ONE = np.uint64(1)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)


# ---- heaps of (key, source, version), compared as Python tuples --------------------------------

@njit(cache=True, inline="always")
def _less(k1, s1, v1, k2, s2, v2):
    if k1 != k2:
        return k1 < k2
    if s1 != s2:
        return s1 < s2
    return v1 < v2


@njit(cache=True, inline="always")
def _put(hk, hs, hv, j, key, s, v):
    hk[j] = key
    hs[j] = s
    hv[j] = v


@njit(cache=True, inline="always")
def _push(hk, hs, hv, n, key, s, v):
    j = n
    while j > 0:
        p = (j - 1) >> 1
        if not _less(key, s, v, hk[p], hs[p], hv[p]):
            break
        _put(hk, hs, hv, j, hk[p], hs[p], hv[p])
        j = p
    _put(hk, hs, hv, j, key, s, v)
    return n + 1


@njit(cache=True, inline="always")
def _pop(hk, hs, hv, n):
    n -= 1
    if n <= 0:
        return 0
    key, s, v = hk[n], hs[n], hv[n]
    j = 0
    while True:
        c = 2 * j + 1
        if c >= n:
            break
        if c + 1 < n and _less(hk[c + 1], hs[c + 1], hv[c + 1], hk[c], hs[c], hv[c]):
            c += 1
        if not _less(hk[c], hs[c], hv[c], key, s, v):
            break
        _put(hk, hs, hv, j, hk[c], hs[c], hv[c])
        j = c
    _put(hk, hs, hv, j, key, s, v)
    return n


# ---- hierarchical bitset (successor queries) for best fit --------------------------------------

@njit(cache=True, inline="always")
def _ctz(x):
    n = 0
    if (x & np.uint64(0xFFFFFFFF)) == 0:
        n += 32
        x >>= np.uint64(32)
    if (x & np.uint64(0xFFFF)) == 0:
        n += 16
        x >>= np.uint64(16)
    if (x & np.uint64(0xFF)) == 0:
        n += 8
        x >>= np.uint64(8)
    if (x & np.uint64(0xF)) == 0:
        n += 4
        x >>= np.uint64(4)
    if (x & np.uint64(0x3)) == 0:
        n += 2
        x >>= np.uint64(2)
    if (x & _ONE) == 0:
        n += 1
    return n


@njit(cache=True, inline="always")
def _bset(bits, lo, nlev, key):
    idx = key
    for lv in range(nlev):
        w = idx >> 6
        old = bits[lo[lv] + w]
        bits[lo[lv] + w] = old | (_ONE << np.uint64(idx & 63))
        if old != 0:
            return
        idx = w


@njit(cache=True, inline="always")
def _bclear(bits, lo, nlev, key):
    idx = key
    for lv in range(nlev):
        w = idx >> 6
        nw = bits[lo[lv] + w] & ~(_ONE << np.uint64(idx & 63))
        bits[lo[lv] + w] = nw
        if nw != 0:
            return
        idx = w


@njit(cache=True, inline="always")
def _bsucc(bits, lo, nlev, x):
    """Smallest set key >= x, or -1."""
    idx = x
    lv = 0
    while lv < nlev:
        w = idx >> 6
        if w >= lo[lv + 1] - lo[lv]:
            return -1
        word = bits[lo[lv] + w] & (_ALL << np.uint64(idx & 63))
        if word != 0:
            idx = (w << 6) + _ctz(word)
            while lv > 0:
                lv -= 1
                idx = (idx << 6) + _ctz(bits[lo[lv] + idx])
            return idx
        idx = w + 1
        lv += 1
    return -1


def _levels(universe: int) -> np.ndarray:
    """Word offsets of each level of a bitset over `universe` keys (the last level is one word)."""
    lo = [0]
    n = max(1, universe)
    while True:
        words = (n + 63) // 64
        lo.append(lo[-1] + words)
        if words == 1:
            return np.array(lo, np.int64)
        n = words


# ---- the loop --------------------------------------------------------------------------------

@njit(cache=True, inline="always")
def _released(i, realized, probs, sz, total, limit):
    li = sz[i]
    return realized[i] + li - probs[i] * (total + li) <= limit


@njit(cache=True, inline="always")
def _size(c_tok, c_done, k, unit_samples, S):
    """What candidate k would add to its source's count: 1 / 0 samples (a continuation), or its next piece."""
    d = c_done[k]
    if unit_samples:
        return 1.0 if d == 0 else 0.0
    rem = c_tok[k] - d
    return float(rem if rem < S else S)


@njit(cache=True, inline="always")
def _queue(i, v, realized, probs, inv_p, sz, total, limit, delta, rk, rs, rv, nready, wk, ws, wv, nwait):
    """Source i (its next size in sz[i], entry version v) into the released heap by deadline, or else into the
    waiting heap by the total at which it is released; returns (nready, nwait)."""
    if _released(i, realized, probs, sz, total, limit):
        return _push(rk, rs, rv, nready, (realized[i] + delta) * inv_p[i], i, v), nwait
    return nready, _push(wk, ws, wv, nwait, (realized[i] + sz[i] - limit) * inv_p[i] - sz[i], i, v)


@njit(cache=True, inline="always")
def _starve(i, realized, probs, limit, st_at, st_i, nst):
    """starved.add(i): source i (nothing left) into the list ordered by the total at which it falls behind."""
    at = (realized[i] + limit) / probs[i]
    j = nst
    while j > 0 and (st_at[j - 1] > at or (st_at[j - 1] == at and st_i[j - 1] > i)):
        st_at[j] = st_at[j - 1]
        st_i[j] = st_i[j - 1]
        j -= 1
    st_at[j] = at
    st_i[j] = i
    return nst + 1


@njit(cache=True, inline="always")
def _exhaust(i, active, version, count, realized, probs, limit, st_at, st_i, nst):
    """Source i has no candidate left: out of the queue (remove), into the starved list; (count, nst)."""
    if active[i]:
        active[i] = False
        count -= 1
        version[i] += 1
    return count, _starve(i, realized, probs, limit, st_at, st_i, nst)


@njit(cache=True)
def _loop(c_tok, c_done, off, probs, inv_p, realized, total, delta, limit, scale, unit_samples, truncate,
          S, R, policy, bits, lo, cap_out, cap_heap):
    n = len(probs)
    nlev = len(lo) - 1
    # -- packer
    free = np.full(R, S, np.int64)  # next_fit / none
    cnt = np.zeros(S + 1, np.int64)  # best_fit: rows per free value
    maxfree = 0
    current = 0
    rowfree = np.full(R if policy == 0 else 0, S, np.int64)  # best_fit: each row's free tokens
    if policy == 0 and R > 0:
        for r in range(R):
            _bset(bits, lo, nlev, S * R + r)
        cnt[S] = R
        maxfree = S
    # -- queue
    sz = np.zeros(n, np.float64)
    version = np.zeros(n, np.int64)
    active = np.zeros(n, np.bool_)
    count = 0
    rk = np.empty(cap_heap, np.float64)
    rs = np.empty(cap_heap, np.int64)
    rv = np.empty(cap_heap, np.int64)
    wk = np.empty(cap_heap, np.float64)
    ws = np.empty(cap_heap, np.int64)
    wv = np.empty(cap_heap, np.int64)
    near = np.empty(cap_heap, np.int64)
    nready = 0
    nwait = 0
    nnear = 0
    # -- starved (sorted by (at, source))
    st_at = np.empty(n, np.float64)
    st_i = np.empty(n, np.int64)
    nst = 0
    # -- output
    o_cand = np.empty(cap_out, np.int64)
    o_bin = np.empty(cap_out, np.int64)
    o_start = np.empty(cap_out, np.int64)
    o_len = np.empty(cap_out, np.int64)
    n_out = 0
    ptr = off[:-1].copy()
    end = off[1:]

    for i in range(n):
        if ptr[i] < end[i] and probs[i] > 0:
            # set(i, size)
            version[i] += 1
            if not active[i]:
                active[i] = True
                count += 1
            sz[i] = _size(c_tok, c_done, ptr[i], unit_samples, S)
            nready, nwait = _queue(i, version[i], realized, probs, inv_p, sz, total, limit, delta,
                                   rk, rs, rv, nready, wk, ws, wv, nwait)
    for i in range(n):
        if probs[i] > 0 and ptr[i] >= end[i]:
            nst = _starve(i, realized, probs, limit, st_at, st_i, nst)

    again = -1
    while count > 0:
        # packer.largest_gap > 0
        if policy == 0:
            if maxfree <= 0:
                break
        elif current >= R:
            break
        elif policy == 2 or current + 1 >= R:
            if free[current] <= 0:
                break
        if again >= 0:
            best = again
            again = -1
        else:
            # pick()
            if nnear > 0:
                m = nnear
                nnear = 0
                for j in range(m):
                    i = near[j]
                    if active[i] and _released(i, realized, probs, sz, total, limit):
                        nready = _push(rk, rs, rv, nready, (realized[i] + delta) * inv_p[i], i, version[i])
                    elif active[i]:
                        near[nnear] = i
                        nnear += 1
            if nwait > 0:
                margin = total + 1e-9 * (total + scale + 1.0)
                while nwait > 0 and wk[0] <= margin:
                    i = ws[0]
                    v = wv[0]
                    nwait = _pop(wk, ws, wv, nwait)
                    if v != version[i]:
                        continue
                    if _released(i, realized, probs, sz, total, limit):
                        nready = _push(rk, rs, rv, nready, (realized[i] + delta) * inv_p[i], i, v)
                    else:
                        near[nnear] = i
                        nnear += 1
            best = -1
            while nready > 0:
                i = rs[0]
                if rv[0] == version[i]:
                    best = i
                    break
                nready = _pop(rk, rs, rv, nready)
        if best < 0:
            break
        if nst > 0:
            # starved.behind(total + size[best])
            x = total + sz[best]
            behind = False
            for j in range(nst):
                at = st_at[j]
                if at > x + 1e-9 * (abs(x) + abs(at) + 1.0):
                    break
                i = st_i[j]
                if probs[i] * x - realized[i] > limit:
                    behind = True
                    break
            if behind:
                break
        k = ptr[best]
        start = c_done[k]
        tokens = c_tok[k]
        remaining = tokens - start
        piece = remaining if remaining < S else S
        # place(piece)
        row = -1
        if piece > 0:
            if policy == 0:
                if piece <= maxfree:
                    key = _bsucc(bits, lo, nlev, piece * R)
                    fr = key // R
                    row = key - fr * R
                    _bclear(bits, lo, nlev, key)
                    cnt[fr] -= 1
                    left = fr - piece
                    rowfree[row] = left
                    if left > 0:
                        _bset(bits, lo, nlev, left * R + row)
                        cnt[left] += 1
                    while maxfree > 0 and cnt[maxfree] == 0:
                        maxfree -= 1
            elif piece <= S:
                if policy == 1:
                    while current < R and free[current] < piece:
                        current += 1
                    if current < R:
                        row = current
                        free[row] -= piece
                elif current < R:
                    row = current
                    free[row] -= piece
                    current += 1
        if row < 0:
            ptr[best] = k + 1
            if k + 1 >= end[best]:
                count, nst = _exhaust(best, active, version, count, realized, probs, limit, st_at, st_i, nst)
            else:
                # still_released(best, size): picked again at once, or re-queued with its new size
                sz[best] = _size(c_tok, c_done, k + 1, unit_samples, S)
                if _released(best, realized, probs, sz, total, limit):
                    again = best
                else:
                    version[best] += 1
                    nready, nwait = _queue(best, version[best], realized, probs, inv_p, sz, total, limit, delta,
                                           rk, rs, rv, nready, wk, ws, wv, nwait)
            continue
        o_cand[n_out] = k
        o_bin[n_out] = row
        o_start[n_out] = start
        o_len[n_out] = piece
        n_out += 1
        done = tokens if truncate else start + piece
        c_done[k] = done
        if unit_samples:
            if start == 0:
                realized[best] += 1.0
                total += 1.0
        else:
            realized[best] += piece
            total += piece
        if done >= tokens:
            ptr[best] = k + 1
            if k + 1 >= end[best]:
                count, nst = _exhaust(best, active, version, count, realized, probs, limit, st_at, st_i, nst)
                continue
        version[best] += 1
        sz[best] = _size(c_tok, c_done, ptr[best], unit_samples, S)
        nready, nwait = _queue(best, version[best], realized, probs, inv_p, sz, total, limit, delta,
                               rk, rs, rv, nready, wk, ws, wv, nwait)
    if policy == 0:  # leave the bitset empty for the next step (clearing R keys beats faulting in fresh pages)
        for r in range(R):
            if rowfree[r] > 0:
                _bclear(bits, lo, nlev, rowfree[r] * R + r)
    return o_cand[:n_out].copy(), o_bin[:n_out].copy(), o_start[:n_out].copy(), o_len[:n_out].copy()


_bitsets: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}


def _bitset(seq_len: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The best-fit bitset for this shape, kept across steps (the loop leaves it empty)."""
    got = _bitsets.get((seq_len, rows))
    if got is None:
        _bitsets.clear()  # one shape at a time (a reconfigure changes it)
        lo = _levels((seq_len + 1) * rows)
        got = _bitsets[(seq_len, rows)] = (lo, np.zeros(int(lo[-1]), np.uint64))
    return got


@njit(cache=True)
def _spans(tok, done, S):
    big = tok[0] - done[0]
    pieces = 0
    for i in range(len(tok)):
        rem = tok[i] - done[i]
        if rem > big:
            big = rem
        pieces += (rem + S - 1) // S
    return big, pieces


def former_run(c_tok: np.ndarray, c_done: np.ndarray, off: np.ndarray, probs: np.ndarray, realized: np.ndarray,
               scale: float, delta: float, limit: float, *, unit_samples: bool, truncate: bool, seq_len: int, rows: int,
               policy: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """selectloop.run as it was."""
    probs = np.ascontiguousarray(probs, np.float64)
    inv_p = np.array([1.0 / x if x > 0 else 0.0 for x in probs.tolist()], np.float64)
    total = float(realized.sum())
    cap_out = int(_spans(c_tok, c_done, seq_len)[1]) + 1 if len(c_tok) else 1
    cap_heap = len(probs) + cap_out + len(c_tok) + 1
    if policy == "best_fit":
        lo, bits = _bitset(seq_len, rows)
    else:
        lo = np.zeros(2, np.int64)
        bits = np.zeros(1, np.uint64)
    return _loop(c_tok, c_done, off, probs, inv_p, realized, total, float(delta), float(limit), float(scale),
                 bool(unit_samples), bool(truncate), int(seq_len), int(rows), POLICY[policy], bits, lo, cap_out, cap_heap)

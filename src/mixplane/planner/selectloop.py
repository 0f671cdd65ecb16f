"""StepPlanner.select's pick-and-place loop, compiled (numba): one step's mixing and packing.

The loop is sequential by nature (every pick depends on what the previous pieces did to the
counters and to the rows), ~145k placements a step at 16,384 rows x 1,024 sources (~0.8 s in
CPython; ~23-25 ms here on the bench's captured inputs). Here it is the same loop over flat arrays,
compiled once (cache=True: later processes load the machine code from numba's cache) and without
the GIL (nogil=True: a planning thread runs it beside the server's encoding and sending):

* the mixing rule is `mixing.EDFQueue`'s (itself `DeficitSampler.pick(..., fallback=False)` run
  incrementally): released sources in a heap by deadline, the others in a heap by the approximate
  total at which they are released, the exact release test deciding; the same float operations in
  the same order, so the same picks, ties included (entries compare as the Python tuples did);
* the starved-source bound (a source with nothing left may not fall a sample behind: sources ordered
  by the total at which they would, so the test is O(1) while none is near);
* the packer is OnlinePacker's (best_fit: the fullest row that still has room, the lowest row among
  equals -- rows bucketed by free tokens, see below; next_fit; none);
* sources' ends and rows per step (docs/mixtures.md): a source whose last allowed candidate is finished
  ends there (the rest of the step renormalised over the others, counters reset, the queues rebuilt);
  sources weighted by rows are served first, outside the mixing queue. With neither, the loop is the one
  whose recorded outputs the tests hold it to byte for byte.

Where the time goes (captured inputs of the largest bench row): nearly all of it in the placements;
the end of a step, where ~240k candidates that fit nowhere are each re-tested (one may change which
source is released), costs ~1-2 ms of them, so it is not short-cut.

The whole loop is written plainly in planner/selectspec.py (DeficitSampler.pick, OnlinePacker, the starved-source
bound, sources' ends and rows per step, one piece at a time), and tests/unit/test_selectspec.py holds this loop to
it piece for piece on random inputs (consumption and counters bit for bit). The mixing rule's incremental form
(EDFQueue) is checked against DeficitSampler.pick and the placements against OnlinePacker's
(tests/unit/test_planner_select.py); the loop's outputs on random and adversarial inputs, and whole plans, are held
to outputs recorded while the former Python loop and the former compiled loop still stood beside it, byte for byte
(tests/unit/planner_goldens.py).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from mixplane.numbacache import ensure_cache_dir

ensure_cache_dir(__file__)  # before numba is imported

from numba import njit  # noqa: E402
from numba.cpython.unsafe.numbers import trailing_zeros  # noqa: E402

POLICY = {"best_fit": 0, "next_fit": 1, "none": 2}
_ONE = np.uint64(1)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)


# ---- the ready and waiting heaps: (key, source), compared as the Python tuples were ---------------
# Every active source has exactly one entry in one of them (or sits in `near`): the picked source's
# entry is the ready heap's top, and it is replaced or removed there when the source moves on, so no
# stale entries (and no versions) exist. The former tuples' third field, a version, never decided a
# comparison between two live entries (one per source), so (key, source) orders them the same.

@njit(cache=True, nogil=True, inline="always")
def _less(k1, s1, k2, s2):
    return k1 < k2 or (k1 == k2 and s1 < s2)


@njit(cache=True, nogil=True, inline="always")
def _sift_down(hk, hs, n, j, key, s):
    """(key, s) into the hole at j of a heap of n entries, moving smaller children up. (Sifting the hole to a
    leaf first and the entry up from there measured no faster; neither did a 4-ary heap nor a winner tree.)
    Unsigned indices: numba adds no negative-index fix-up to the loads on this dependency chain."""
    one = np.uint64(1)
    u = np.uint64(j)
    un = np.uint64(n)
    while True:
        c = u + u + one
        if c >= un:
            break
        if c + one < un:  # the smaller child without a branch (which one it is is a coin toss); equal keys are rare
            a = hk[c]
            b = hk[c + one]
            if a == b:
                c += np.uint64(hs[c + one] < hs[c])
            else:
                c += np.uint64(b < a)
        if not _less(hk[c], hs[c], key, s):
            break
        hk[u] = hk[c]
        hs[u] = hs[c]
        u = c
    hk[u] = key
    hs[u] = s


@njit(cache=True, nogil=True, inline="always")
def _sift_up(hk, hs, j, key, s):
    """(key, s) into the hole at j, moving larger parents down."""
    while j > 0:
        p = (j - 1) >> 1
        if not _less(key, s, hk[p], hs[p]):
            break
        hk[j] = hk[p]
        hs[j] = hs[p]
        j = p
    hk[j] = key
    hs[j] = s


@njit(cache=True, nogil=True, inline="always")
def _push(hk, hs, n, key, s):
    _sift_up(hk, hs, n, key, s)
    return n + 1


@njit(cache=True, nogil=True, inline="always")
def _pop(hk, hs, n):
    n -= 1
    if n > 0:
        _sift_down(hk, hs, n, 0, hk[n], hs[n])
    return n


# ---- best fit: rows bucketed by free tokens ---------------------------------------------------------
# The packer places a piece in the fullest row that still has room, the lowest row among equals: the
# smallest (free, row) with free >= piece. Free values (0..S) are kept in a small hierarchical bitset
# of non-empty buckets (a few hundred bytes: in L1, where the former bitset over free * rows + row keys,
# 16 MB at 16,384 rows of 8k, missed the caches on every placement); each bucket's rows in a pairing
# heap (min row first) threaded through two arrays indexed by row. Untouched rows (free = S) are the
# range [fresh, R): a row never gets its space back within a step.

@njit(cache=True, nogil=True, inline="always")
def _ctz(x):
    return np.int64(trailing_zeros(x))  # one tzcnt


@njit(cache=True, nogil=True, inline="always")
def _bset(bits, lo, nlev, key):
    idx = key
    for lv in range(nlev):
        w = idx >> 6
        old = bits[lo[lv] + w]
        bits[lo[lv] + w] = old | (_ONE << np.uint64(idx & 63))
        if old != 0:
            return
        idx = w


@njit(cache=True, nogil=True, inline="always")
def _bclear(bits, lo, nlev, key):
    idx = key
    for lv in range(nlev):
        w = idx >> 6
        nw = bits[lo[lv] + w] & ~(_ONE << np.uint64(idx & 63))
        bits[lo[lv] + w] = nw
        if nw != 0:
            return
        idx = w


@njit(cache=True, nogil=True, inline="always")
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


@njit(cache=True, nogil=True, inline="always")
def _meld(child, sib, a, b):
    """Two pairing-heap roots (rows) into one: the larger row becomes the smaller's first child."""
    if b < a:
        a, b = b, a
    sib[b] = child[a]
    child[a] = b
    return a


@njit(cache=True, nogil=True)
def _pairing_pop(child, sib, r):
    """The heap rooted at row r without r (two-pass pairing of r's children); its new root, or -1."""
    c = child[r]
    if c < 0:
        return -1
    acc = -1  # pass 1: meld the children in pairs, left to right; the results listed last-first via sib
    while c >= 0:
        a = c
        b = sib[a]
        if b < 0:
            m = a
            c = -1
        else:
            c = sib[b]
            m = _meld(child, sib, a, b)
        sib[m] = acc
        acc = m
    res = acc  # pass 2: meld them right to left
    acc = sib[res]
    while acc >= 0:
        nxt = sib[acc]
        res = _meld(child, sib, res, acc)
        acc = nxt
    sib[res] = -1
    return res


# ---- the loop --------------------------------------------------------------------------------

@njit(cache=True, nogil=True, inline="always")
def _released(i, realized, probs, sz, total, limit):
    li = sz[i]
    return realized[i] + li - probs[i] * (total + li) <= limit


@njit(cache=True, nogil=True, inline="always")
def _size(c_tok, c_done, k, unit_samples, S):
    """What candidate k would add to its source's count: 1 / 0 samples (a continuation), or its next piece."""
    d = c_done[k]
    if unit_samples:
        return 1.0 if d == 0 else 0.0
    rem = c_tok[k] - d
    return float(rem if rem < S else S)


@njit(cache=True, nogil=True, inline="always")
def _wait_key(i, realized, inv_p, sz, limit):
    """The total at which source i (next size sz[i]) is released, approximately (the exact test decides)."""
    return (realized[i] + sz[i] - limit) * inv_p[i] - sz[i]


@njit(cache=True, nogil=True, inline="always")
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


@njit(cache=True, nogil=True, inline="always")
def _enqueue(n, ptr, end, probs, active, sz, c_tok, c_done, unit_samples, S, realized, total, limit, delta, inv_p,
             rk, rs, wk, ws, st_at, st_i):
    """The queues built from empty (at the start, and again when a source ends and the shares are renormalised):
    every source with candidates left and a share is active, ready or waiting; a share source without candidates is
    starved. Returns (active count, ready, waiting, starved)."""
    count = 0
    nready = 0
    nwait = 0
    nst = 0
    for i in range(n):
        active[i] = False
        if ptr[i] < end[i] and probs[i] > 0:
            active[i] = True
            count += 1
            sz[i] = _size(c_tok, c_done, ptr[i], unit_samples, S)
            if _released(i, realized, probs, sz, total, limit):
                nready = _push(rk, rs, nready, (realized[i] + delta) * inv_p[i], i)
            else:
                nwait = _push(wk, ws, nwait, _wait_key(i, realized, inv_p, sz, limit), i)
    for i in range(n):
        if probs[i] > 0 and ptr[i] >= end[i]:
            nst = _starve(i, realized, probs, limit, st_at, st_i, nst)
    return count, nready, nwait, nst


class LoopInput(NamedTuple):
    """`_loop`'s inputs, in its parameter order (tests/unit/test_kernel_inputs.py holds the two together): the one
    place that says what the loop reads. `run` builds it and calls ``_loop(*inp)``: the kernel itself stays
    positional, because numba compiles a named tuple of 22 arrays into a slower body (+2-9% measured,
    bench/results/structure_before_after.txt), while the splat costs one Python call's argument tuple. A new column:
    a field here, the parameter at the same place in `_loop`, its value in `run`."""

    c_tok: np.ndarray  # int64 [candidates]: each candidate sample's tokens, grouped by source
    c_done: np.ndarray  # int64 [candidates]: its tokens already placed (updated in place)
    off: np.ndarray  # int64 [sources + 1]: source i's candidates are [off[i], off[i + 1])
    probs: np.ndarray  # float64 [sources]: mixing probabilities (a copy: an end renormalises it)
    inv_p: np.ndarray  # float64 [sources]: 1 / probs, 0 where probs is 0
    realized: np.ndarray  # float64 [sources]: the segment's counters (updated in place)
    total: float  # realized.sum()
    delta: float  # the mixing rule's slack (mixing.slack): a released source's deadline is (realized + delta) / p
    limit: float  # how far ahead of its share a source may be and still be released (delta and rounding room)
    scale: float  # the size unit delta is reckoned in (recomputed from it when a source ends)
    unit_samples: bool  # counters count samples (else tokens)
    truncate: bool  # a sample is done after its first piece (cut at the row), else continued in later rows
    S: int  # seq_len: tokens per row
    R: int  # rows this step
    policy: int  # POLICY's code of the packer: best_fit, next_fit, none
    lo: np.ndarray  # int64: the best-fit bit levels' offsets (_bucket_levels)
    cap_out: int  # room for this many pieces
    ends: np.ndarray  # int64 [sources]: one past source i's last allowed candidate
    final: np.ndarray  # bool [sources]: no later row of the source is allowed
    unfinished: np.ndarray  # int64 [sources]: candidates a final source has not finished (updated in place)
    quota: np.ndarray  # int64 [sources]: rows-weighted sources' documents to begin (updated in place: what is left)
    ended: np.ndarray  # uint8 [sources]: out, the source ended in this step


@njit(cache=True, nogil=True)
def _loop(c_tok, c_done, off, probs, inv_p, realized, total, delta, limit, scale, unit_samples, truncate,
          S, R, policy, lo, cap_out, ends, final, unfinished, quota, ended):
    n = len(probs)
    nlev = len(lo) - 1
    # -- packer
    free = np.full(R if policy != 0 else 0, S, np.int64)  # next_fit / none: each row's free tokens
    current = 0
    cnt = np.zeros(S + 1 if policy == 0 else 0, np.int32)  # best_fit: rows per free value
    bits = np.zeros(lo[-1], np.uint64)  # best_fit: the non-empty free values < S (and S while fresh < R)
    root = np.full(S + 1 if policy == 0 else 0, -1, np.int32)  # per free value < S: its heap's least row
    child = np.full(R if policy == 0 else 0, -1, np.int32)
    sib = np.full(R if policy == 0 else 0, -1, np.int32)
    fresh = 0
    maxfree = 0
    if policy == 0 and R > 0:
        _bset(bits, lo, nlev, S)
        cnt[S] = R
        maxfree = S
    # -- queue
    sz = np.zeros(n, np.float64)
    active = np.zeros(n, np.bool_)
    count = 0
    rk = np.empty(n, np.float64)
    rs = np.empty(n, np.int64)
    wk = np.empty(n, np.float64)
    ws = np.empty(n, np.int64)
    near = np.empty(n, np.int64)
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
    end = ends  # off[1:] unless a source's later candidates are past its last pass (select: epoch caps)
    # sources weighted by rows (mixture.rows), served first, in source order: `quota` documents begin (a document
    # already begun continues first, and the last one begun is finished when it fits); share sources fill the rest
    nq = 0
    qsrc = np.empty(n, np.int64)
    for i in range(n):
        if quota[i] > 0:
            qsrc[nq] = i
            nq += 1
    qcur = 0

    count, nready, nwait, nst = _enqueue(n, ptr, end, probs, active, sz, c_tok, c_done, unit_samples, S, realized,
                                         total, limit, delta, inv_p, rk, rs, wk, ws, st_at, st_i)

    again = -1
    while count > 0 or qcur < nq:
        # packer.largest_gap > 0
        if policy == 0:
            if maxfree <= 0:
                break
        elif current >= R:
            break
        elif policy == 2 or current + 1 >= R:
            if free[current] <= 0:
                break
        forced = False
        if qcur < nq:
            q = qsrc[qcur]
            if ptr[q] < end[q] and (quota[q] > 0 or c_done[ptr[q]] > 0):
                best = q
                forced = True
            else:
                qcur += 1
                continue
        elif again >= 0:
            best = again  # still the ready heap's top
            again = -1
        else:
            # pick()
            if nnear > 0:
                m = nnear
                nnear = 0
                for j in range(m):
                    i = near[j]
                    if _released(i, realized, probs, sz, total, limit):
                        nready = _push(rk, rs, nready, (realized[i] + delta) * inv_p[i], i)
                    else:
                        near[nnear] = i
                        nnear += 1
            if nwait > 0:
                margin = total + 1e-9 * (total + scale + 1.0)
                while nwait > 0 and wk[0] <= margin:
                    i = ws[0]
                    nwait = _pop(wk, ws, nwait)
                    if _released(i, realized, probs, sz, total, limit):
                        nready = _push(rk, rs, nready, (realized[i] + delta) * inv_p[i], i)
                    else:
                        near[nnear] = i
                        nnear += 1
            if nready == 0:
                break
            best = rs[0]
        if nst > 0 and not forced:
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
                    fr = _bsucc(bits, lo, nlev, piece)
                    if fr == S:
                        row = fresh
                        fresh += 1
                        if fresh == R:
                            _bclear(bits, lo, nlev, S)
                    else:
                        row = root[fr]
                        nr = _pairing_pop(child, sib, row)
                        root[fr] = nr
                        if nr < 0:
                            _bclear(bits, lo, nlev, fr)
                    cnt[fr] -= 1
                    left = fr - piece
                    if left > 0:
                        child[row] = -1
                        sib[row] = -1
                        r0 = root[left]
                        if r0 < 0:
                            root[left] = row
                            _bset(bits, lo, nlev, left)
                        else:
                            root[left] = _meld(child, sib, r0, row)
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
        if row < 0 and forced:  # a rows source's piece fits nowhere: it is served no further this step
            qcur += 1
            continue
        if row < 0:
            ptr[best] = k + 1
            if k + 1 >= end[best]:  # exhausted: out of the queue, into the starved list
                nready = _pop(rk, rs, nready)
                active[best] = False
                count -= 1
                nst = _starve(best, realized, probs, limit, st_at, st_i, nst)
            else:
                # still_released(best, size): picked again at once, or re-queued with its new size
                sz[best] = _size(c_tok, c_done, k + 1, unit_samples, S)
                if _released(best, realized, probs, sz, total, limit):
                    again = best
                else:
                    nready = _pop(rk, rs, nready)
                    nwait = _push(wk, ws, nwait, _wait_key(best, realized, inv_p, sz, limit), best)
            continue
        if n_out == cap_out:  # cannot happen (see run's cap_out); should it, stop rather than overrun
            n_out = -1
            break
        o_cand[n_out] = k
        o_bin[n_out] = row
        o_start[n_out] = start
        o_len[n_out] = piece
        n_out += 1
        done = tokens if truncate else start + piece
        c_done[k] = done
        if forced:
            if start == 0:
                quota[best] -= 1
            if done >= tokens:
                ptr[best] = k + 1
                unfinished[best] -= 1
                if final[best] and unfinished[best] == 0:
                    ended[best] = 1
            continue
        if unit_samples:
            if start == 0:
                realized[best] += 1.0
                total += 1.0
        else:
            realized[best] += piece
            total += piece
        if done >= tokens:
            ptr[best] = k + 1
            unfinished[best] -= 1
            if final[best] and unfinished[best] == 0:
                # the source's last row of its last pass: it ends here. The rest of the step is mixed over the
                # sources left, their weights renormalised, with fresh counters (as a new segment would start)
                ended[best] = 1
                probs[best] = 0.0
                psum = 0.0
                npos = 0
                for i in range(n):
                    if probs[i] > 0:
                        psum += probs[i]
                        npos += 1
                if npos == 0:
                    break  # no share source left: the step ends here (the planner then stops: data exhausted)
                for i in range(n):
                    if probs[i] > 0:
                        probs[i] = probs[i] / psum
                        inv_p[i] = 1.0 / probs[i]
                    else:
                        inv_p[i] = 0.0
                    realized[i] = 0.0
                total = 0.0
                delta = (1.0 - 1.0 / (2 * npos - 2) if npos > 1 else 0.5) * scale  # mixing.slack
                limit = delta + 1e-9 * scale
                nnear = 0
                count, nready, nwait, nst = _enqueue(n, ptr, end, probs, active, sz, c_tok, c_done, unit_samples, S,
                                                     realized, total, limit, delta, inv_p, rk, rs, wk, ws, st_at, st_i)
                continue
            if k + 1 >= end[best]:
                nready = _pop(rk, rs, nready)
                active[best] = False
                count -= 1
                nst = _starve(best, realized, probs, limit, st_at, st_i, nst)
                continue
        sz[best] = _size(c_tok, c_done, ptr[best], unit_samples, S)
        if _released(best, realized, probs, sz, total, limit):  # its new entry replaces the top
            _sift_down(rk, rs, nready, 0, (realized[best] + delta) * inv_p[best], best)
        else:
            nready = _pop(rk, rs, nready)
            nwait = _push(wk, ws, nwait, _wait_key(best, realized, inv_p, sz, limit), best)
    if n_out < 0:
        return o_cand[:0], o_bin[:0], o_start[:0], o_len[:0], False
    return o_cand[:n_out].copy(), o_bin[:n_out].copy(), o_start[:n_out].copy(), o_len[:n_out].copy(), True


_lo: dict[int, np.ndarray] = {}


def _bucket_levels(seq_len: int) -> np.ndarray:
    """The best-fit bucket bitset's level offsets for free values 0..seq_len (kept per shape)."""
    got = _lo.get(seq_len)
    if got is None:
        _lo.clear()
        got = _lo[seq_len] = _levels(seq_len + 1)
    return got


@njit(cache=True, nogil=True)
def _spans(tok, done, S):
    big = tok[0] - done[0]
    pieces = 0
    for i in range(len(tok)):
        rem = tok[i] - done[i]
        big = max(big, rem)
        pieces += rem > 0
        if rem > S:  # rare: the division only for samples longer than a row
            pieces += (rem - 1) // S
    return big, pieces


def spans(tok: np.ndarray, done: np.ndarray, seq_len: int) -> tuple[int, int]:
    """(the most tokens any sample has left, how many pieces of at most seq_len all of them make) in one pass
    (numpy made three temporaries of the whole window store for these). Needs at least one sample."""
    big, pieces = _spans(tok, done, int(seq_len))
    return int(big), int(pieces)


def run(c_tok: np.ndarray, c_done: np.ndarray, off: np.ndarray, probs: np.ndarray, realized: np.ndarray,
        scale: float, delta: float, limit: float, *, unit_samples: bool, truncate: bool, seq_len: int, rows: int,
        policy: str, ends: np.ndarray | None = None, final: np.ndarray | None = None, quota: np.ndarray | None = None,
        outcome: dict[str, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One step's picks and placements. Candidates (c_tok, c_done: int64, grouped by source, `off` the
    per-source offsets) in the order each source takes them; `c_done` and `realized` (the segment's
    counters, float64) are updated in place. Returns (candidate, row, start, length) per piece.

    Sources' ends (docs/mixtures.md): `ends[i]` (default off[i + 1]) is one past source i's last candidate in
    its allowed passes; `final[i]` says no later row of the source is allowed (every one it may still deliver is a
    candidate). When a final source finishes its last candidate it ends there: the rest of the step is mixed over
    the other sources, renormalised, counters reset (`realized` then holds the counters since that moment).
    `quota[i]` > 0: source i is weighted by rows: that many of its documents begin in the step, placed before
    the share sources (their probability must be 0). `outcome` (a dict) receives "ended" (uint8 per source: it
    ended in this step) and "short" (int64 per source: documents of its quota that did not begin)."""
    n = len(probs)
    probs = np.array(probs, np.float64)  # a copy: an end renormalises it
    inv_p = np.divide(1.0, probs, out=np.zeros(len(probs)), where=probs > 0)  # the same IEEE division as 1.0 / x
    ends_a = np.ascontiguousarray(off[1:] if ends is None else ends, np.int64)
    final_a = np.zeros(n, np.bool_) if final is None else np.ascontiguousarray(final, np.bool_)
    quota_a = np.zeros(n, np.int64) if quota is None else np.array(quota, np.int64)
    # candidates each source has not finished (the samples a final source must deliver before it ends)
    left = np.zeros(n, np.int64)
    if final_a.any():
        for i in np.flatnonzero(final_a).tolist():
            a, b = int(off[i]), int(ends_a[i])
            left[i] = int(np.count_nonzero(c_done[a:b] < c_tok[a:b]))
    ended = np.zeros(n, np.uint8)
    total = float(realized.sum())
    # at most one piece per candidate is shorter than a row (it finishes its sample, or is truncated), and
    # every piece of a whole row takes an untouched one: no more pieces than candidates + rows
    cap_out = len(c_tok) + int(rows) + 1
    lo = _bucket_levels(seq_len) if policy == "best_fit" else _levels(1)
    inp = LoopInput(c_tok, c_done, off, probs, inv_p, realized, total, float(delta), float(limit), float(scale),
                    bool(unit_samples), bool(truncate), int(seq_len), int(rows), POLICY[policy], lo, cap_out, ends_a,
                    final_a, left, quota_a, ended)
    o_cand, o_bin, o_start, o_len, ok = _loop(*inp)
    if outcome is not None:
        outcome["ended"] = ended
        outcome["short"] = quota_a  # what is left of each quota
    if not ok:
        raise RuntimeError(f"selectloop: more than {cap_out - 1} pieces from {len(c_tok)} candidates and {rows} rows")
    return o_cand, o_bin, o_start, o_len


def warm_once(compile_all: Callable[[], None]) -> Callable[[], float]:
    """A loop module's `warm()`: compile_all() on the first call in a process (numba compiles, or loads from its
    cache, before the first step needs it); the seconds that took, then that figure at once."""
    took: list[float] = []

    @functools.wraps(compile_all)
    def warm() -> float:
        if not took:
            t0 = time.perf_counter()
            compile_all()
            took.append(time.perf_counter() - t0)
        return took[0]

    return warm


@warm_once
def warm() -> None:
    """Compile (or load from numba's cache) every loop here now, not in the first step; the seconds it took."""
    for policy in POLICY:
        run(np.array([5, 3], np.int64), np.zeros(2, np.int64), np.array([0, 1, 2], np.int64), np.array([0.5, 0.5]),
            np.zeros(2), 5.0, 2.5, 2.5, unit_samples=False, truncate=False, seq_len=4, rows=2, policy=policy)
    spans(np.ones(1, np.int64), np.zeros(1, np.int64), 4)
    block = np.zeros((6, 3), np.int64)
    settle(block[:, :2], np.array([0, 2], np.int64), np.zeros(1, np.int64))
    for gone in (None, np.zeros(1, np.bool_)):
        gather(block[:, :1], np.array([0, 1], np.int64), gone, np.zeros((5, 1), np.int64), np.array([[0, 0, 1]]), block[:, 1:])
    _warm_store()


# ---- the planner's window store: compaction ---------------------------------------------------------

@njit(cache=True, nogil=True)
def _settle(block, base, next_pos):
    """windows.WindowStore.compact's pass (it moves nothing: the next gather leaves the consumed samples out):
    which samples are fully consumed (rows of block: pos, key, tokens, patches, done; window w's samples
    at [base[w], base[w + 1]), in stream order); per window the samples left, their unconsumed tokens, the
    low mark (the first one's position, else next_pos), and the consumed positions above it."""
    n = block.shape[1]
    nw = len(next_pos)
    full = np.empty(n, np.bool_)
    held = np.zeros(nw, np.int64)
    unc = np.zeros(nw, np.int64)
    low = next_pos.copy()
    first = np.full(nw, -1, np.int64)  # the first sample left in each window
    m = 0
    for w in range(nw):
        for i in range(base[w], base[w + 1]):
            f = block[4, i] >= block[2, i]
            full[i] = f
            if not f:
                held[w] += 1
                unc[w] += block[2, i] - block[4, i]
                if first[w] < 0:
                    first[w] = i
                    low[w] = block[0, i]
            elif first[w] >= 0:  # positions increase within a window: consumed above the low mark
                m += 1
    a_win = np.empty(m, np.int64)
    a_pos = np.empty(m, np.int64)
    m = 0
    for w in range(nw):
        if first[w] >= 0:
            for i in range(first[w] + 1, base[w + 1]):
                if full[i]:
                    a_win[m] = w
                    a_pos[m] = block[0, i]
                    m += 1
    return full, held, unc, low, a_win, a_pos


@njit(cache=True, nogil=True)
def _gather(old, old_base, gone, src, chunks, new):
    j = 0
    k = 0
    masked = len(gone) > 0
    for w in range(len(old_base) - 1):
        for i in range(old_base[w], old_base[w + 1]):
            if masked and gone[i]:
                continue
            for c in range(5):
                new[c, j] = old[c, i]
            new[5, j] = w
            j += 1
        while k < chunks.shape[0] and chunks[k, 0] == w:
            for i in range(chunks[k, 1], chunks[k, 1] + chunks[k, 2]):
                for c in range(5):
                    new[c, j] = src[c, i]
                new[5, j] = w
                j += 1
            k += 1


def gather(old: np.ndarray, old_base: np.ndarray, gone: np.ndarray | None, src: np.ndarray, chunks: np.ndarray,
           new: np.ndarray) -> None:
    """windows.WindowStore.sync's merge: window by window, its samples in `old` ([old_base[w], old_base[w + 1]),
    rows pos, key, tokens, patches, done) but those `gone` marks (the last compaction's), then what it took
    since: the chunks (rows of `chunks`: window, first column in `src`, length; by window, each window's in
    stream order), into `new` (6 x total, the window index in row 5)."""
    _gather(old, np.ascontiguousarray(old_base, np.int64), np.zeros(0, np.bool_) if gone is None else gone, src,
            np.ascontiguousarray(chunks, np.int64).reshape(-1, 3), new)


def settle(block: np.ndarray, base: np.ndarray, next_pos: np.ndarray) -> tuple[np.ndarray, ...]:
    """(fully consumed mask over the columns, samples left [w], unconsumed tokens [w], low marks [w], windows
    and positions of the consumed samples above their window's low mark, in column order)."""
    return _settle(block, np.ascontiguousarray(base, np.int64), np.ascontiguousarray(next_pos, np.int64))


@njit(cache=True, nogil=True)
def take_meta(pos, key, tokens, patches, next_pos, out):
    """ReplicaWindow.add's checks and copy in one pass over one LOADER_META's arrays (1-D int64, equal
    lengths >= 1): (0, or 1 positions out of order or below next_pos, or 2 a sample without tokens -- the
    order error first, as add reports it; the tokens of all samples but the last; the last's tokens; the
    last position). `out` (5 x n) receives pos, key, tokens, patches and zeros (done)."""
    n = len(pos)
    order = pos[0] < next_pos
    empty = False
    before_last = 0
    for i in range(n):
        if i and pos[i] <= pos[i - 1]:
            order = True
        t = tokens[i]
        if t <= 0:
            empty = True
        if i < n - 1:
            before_last += t
        out[0, i] = pos[i]
        out[1, i] = key[i]
        out[2, i] = t
        out[3, i] = patches[i]
        out[4, i] = 0
    return 1 if order else (2 if empty else 0), before_last, tokens[n - 1], pos[n - 1]


@njit(cache=True, nogil=True)
def _pairs(seg_source, seg_key, seg_start, seg_len, img_source, img_key, img_patches,
           source, key, start, length, patches, seg_piece, img_piece):
    n = len(source)
    seen = np.zeros(n, np.bool_)
    for i in range(len(seg_piece)):
        j = seg_piece[i]
        if j < 0 or j >= n or seen[j]:
            return False
        seen[j] = True
        if seg_source[i] != source[j] or seg_key[i] != key[j] or seg_start[i] != start[j] or seg_len[i] != length[j]:
            return False
    seen[:] = False
    for i in range(len(img_piece)):
        j = img_piece[i]
        if j < 0 or j >= n or seen[j] or patches[j] <= 0:
            return False
        seen[j] = True
        if img_source[i] != source[j] or img_key[i] != key[j] or img_patches[i] != patches[j]:
            return False
    return True


def pairs(seg: tuple[np.ndarray, ...], img: tuple[np.ndarray, ...], pieces: tuple[np.ndarray, ...],
          seg_piece: np.ndarray, img_piece: np.ndarray) -> bool:
    """Whether segment i (source, key, start, length) is piece seg_piece[i] and image j (source, key,
    patches) the image piece img_piece[j], each piece at most once per list (pieces: source, key, start,
    length, patches; the caller checks the counts). One pass, no temporaries."""
    (s0, s1, s2, s3), (i0, i1, i2), (p0, p1, p2, p3, p4) = seg, img, pieces
    return bool(_pairs(s0, s1, s2, s3, i0, i1, i2, p0, p1, p2, p3, p4, seg_piece, img_piece))


# ---- matching two lists of spans (coverage check, routing) -------------------------------------

@njit(cache=True, nogil=True)
def _match(a0, a1, a2, a3, b0, b1, b2, b3):
    """(For every row of a, a distinct row of b with the same 4 fields, -1) -- a bijection -- or (_, the
    first row of a without a partner). Open addressing over b's rows; equal rows are chained in order."""
    n = len(a0)
    m = len(b0)
    if n != m:
        return np.full(n, -1, np.int64), -1
    size = 1
    while size < 2 * m + 2:
        size <<= 1
    mask = size - 1
    table = np.full(size, -1, np.int64)
    nxt = np.full(m, -1, np.int64)  # b rows with equal fields chained behind the first
    tail = np.full(m, -1, np.int64)
    for j in range(m):
        h = (np.uint64(b0[j]) * np.uint64(0x9E3779B97F4A7C15)) ^ (np.uint64(b1[j]) * np.uint64(0xC2B2AE3D27D4EB4F)) \
            ^ (np.uint64(b2[j]) * np.uint64(0x165667B19E3779F9)) ^ (np.uint64(b3[j]) * np.uint64(0x27D4EB2F165667C5))
        h ^= h >> np.uint64(29)
        s = np.int64(h & np.uint64(mask))
        while True:
            t = table[s]
            if t < 0:
                table[s] = j
                tail[j] = j
                break
            if b0[t] == b0[j] and b1[t] == b1[j] and b2[t] == b2[j] and b3[t] == b3[j]:
                nxt[tail[t]] = j
                tail[t] = j
                break
            s = (s + 1) & mask
    avail = np.arange(m)  # per chain head: the next b row of the chain not yet paired (-1: none)
    out = np.empty(n, np.int64)
    for i in range(n):
        h = (np.uint64(a0[i]) * np.uint64(0x9E3779B97F4A7C15)) ^ (np.uint64(a1[i]) * np.uint64(0xC2B2AE3D27D4EB4F)) \
            ^ (np.uint64(a2[i]) * np.uint64(0x165667B19E3779F9)) ^ (np.uint64(a3[i]) * np.uint64(0x27D4EB2F165667C5))
        h ^= h >> np.uint64(29)
        s = np.int64(h & np.uint64(mask))
        head = -1
        while True:
            t = table[s]
            if t < 0:
                break
            if b0[t] == a0[i] and b1[t] == a1[i] and b2[t] == a2[i] and b3[t] == a3[i]:
                head = t
                break
            s = (s + 1) & mask
        if head < 0 or avail[head] < 0:
            return out, i
        t = avail[head]
        out[i] = t
        avail[head] = nxt[t]
    return out, -1


def match(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> tuple[np.ndarray | None, int]:
    """(b's row for every row of a, -1) when a and b hold the same rows (4 integer columns each) as
    multisets, else (None, the first row of a without a partner, or -1 if the lengths differ)."""
    cols = [np.ascontiguousarray(x, np.int64) for x in (*a, *b)]
    out, bad = _match(*cols)
    if bad >= 0 or len(cols[0]) != len(cols[4]):
        return None, int(bad)
    return out, -1


def _warm_store() -> None:
    """The window store's helpers, for the array kinds they get: LOADER_META arrays come off the wire
    read-only."""
    one = np.ones(1, np.int64)
    ro = one.copy()
    ro.flags.writeable = False
    for a in (one, ro):
        take_meta(a, a, a, a, 0, np.zeros((5, 1), np.int64))
    i16, i32 = np.ones(1, np.int16), np.ones(1, np.int32)
    pairs((i16, one, i32, i32), (i16, one, i32), (i16, one, one, one, one), np.zeros(1, np.int64), np.zeros(1, np.int64))

"""Hybrid data x context parallel placement: every sequence of a step goes to a power-of-two group of DP x CP
ranks sized by its length -- long sequences spread over context parallelism, short ones kept whole on one rank --
and groups are chosen so that every rank carries the same cost (Megatron-LM's hybrid data x context
parallelism). Pure numpy, no I/O.

The fixed scheme cuts every packed row over the CP group of its DP replica: a row of many short documents pays
the CP exchange as a row of one long document does, and DP replicas are only as even as their rows. Here the
dp x cp ranks are one pool of consumers (MegaScale-Data's ``distribute('CP')``: "DP x CP GPUs as uniform consumers"):

* a sequence of ``L`` tokens needs ``k = 2^ceil(log2(L / max_tokens))`` ranks, ``max_tokens`` being what one rank
  may hold of one sequence (``seq_len / cp``: the share of a row a CP rank holds in the fixed scheme); ``k = 1``
  keeps it whole on one rank, without any CP exchange;
* the ``k`` ranks of a sequence are an aligned group of consecutive consumers (``dp * cp + cp_rank`` order:
  Megatron's groups of every power of two over the DP x CP domain), each carrying ``cost / k`` (a zig-zag split
  of a causal sequence is even) and ``L / k`` tokens;
* sequences are placed by decreasing cost (LPT) on the group whose busiest rank is least loaded among the groups
  with room for ``L / k`` more tokens on every rank (``capacity``: the tokens a rank holds in the fixed scheme,
  so activation memory does not grow); a sequence no group has room for goes to the least filled group
  (counted in ``overflow``).

Delivery (``DGraph.hybrid_cp(deliver=True)``): the plan carries every piece's group inside its DP replica
(``StepLayout.seg_cp_first`` / ``seg_cp_size``). With cp a power of two no group leaves its replica (a piece is
at most seq_len long, so ``k <= cp``). Rows only carry a replica's pieces to its constructor, but they bound
what a replica can take: :func:`place_in_rows` places as :func:`place` does among the groups whose replica has a
row with room for the piece (best fit there). When some piece finds no row anywhere the rows stay as balanced and
the step is placed inside each replica instead, the better (lighter busiest rank) of :func:`within_replicas`
(each replica's pieces over its own cp ranks by size and cost) and :func:`spread_replicas` (every piece over its
replica's whole CP group: the fixed scheme's balance with the even split, never worse than it).

What it leaves out: the cost of the CP exchange itself (it only shrinks here: fewer tokens go through CP), the
pipeline schedule (ranks are compared by their total cost per step) and the microbatch structure (Megatron runs
a variable number of microbatches per rank, each a group's sub-sample).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class HybridPlacement:
    """Where each sequence goes: its group size and the group's first consumer (``dp * cp + cp_rank``)."""

    group_size: np.ndarray  # per sequence: k, a power of two
    first: np.ndarray  # per sequence: the first consumer of its group (a multiple of k)
    loads: np.ndarray  # per consumer: the cost it carries
    tokens: np.ndarray  # per consumer: the tokens it holds
    overflow: int  # sequences placed past the token capacity (no group had room)

    def consumers(self, i: int) -> np.ndarray:
        """The consumers of sequence `i`, in CP-rank order."""
        return np.arange(int(self.first[i]), int(self.first[i]) + int(self.group_size[i]))

    def cp_token_fraction(self, lengths: np.ndarray) -> float:
        """Share of the step's tokens that go through a CP exchange (sequences on more than one rank)."""
        L = np.asarray(lengths, dtype=np.float64)
        return float(L[self.group_size > 1].sum() / max(L.sum(), 1.0))


def group_sizes(lengths: np.ndarray, max_tokens: int, consumers: int) -> np.ndarray:
    """The power-of-two number of ranks each sequence needs so that no rank holds more than `max_tokens` of it."""
    L = np.asarray(lengths, dtype=np.int64)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    need = np.maximum(1, -(-L // int(max_tokens)))
    k = np.left_shift(1, np.ceil(np.log2(need)).astype(np.int64))
    top = 1 << (int(consumers).bit_length() - 1)  # the largest power of two <= consumers
    if len(k) and int(k.max()) > top:
        i = int(np.argmax(k))
        raise ValueError(f"a sequence of {int(L[i])} tokens needs {int(k[i])} ranks of {max_tokens} tokens; "
                         f"the DP x CP domain has {consumers}")
    return k


def place(lengths: np.ndarray, costs: np.ndarray, consumers: int, max_tokens: int, capacity: float) -> HybridPlacement:
    """Place every sequence (lengths, costs) on `consumers` DP x CP ranks; see the module docstring."""
    L = np.asarray(lengths, dtype=np.int64)
    c = np.asarray(costs, dtype=np.float64)
    if L.shape != c.shape:
        raise ValueError(f"{len(L)} lengths but {len(c)} costs")
    n = int(consumers)
    k = group_sizes(L, max_tokens, n)
    first = np.zeros(len(L), dtype=np.int64)
    loads = np.zeros(n)
    tokens = np.zeros(n)
    overflow = 0
    order = np.lexsort((-k, -c))  # by cost, then group size, descending
    for i in order.tolist():
        kk = int(k[i])
        m = n // kk  # aligned groups that fit in the domain
        share_c, share_t = c[i] / kk, L[i] / kk
        gl = loads[: m * kk].reshape(m, kk).max(axis=1)
        gt = tokens[: m * kk].reshape(m, kk).max(axis=1)
        room = gt + share_t <= capacity * (1 + 1e-12)
        if room.any():
            g = int(np.flatnonzero(room)[np.argmin(gl[room])])
        else:
            g = int(np.argmin(gt))
            overflow += 1
        first[i] = g * kk
        loads[g * kk:(g + 1) * kk] += share_c
        tokens[g * kk:(g + 1) * kk] += share_t
    return HybridPlacement(k, first, loads, tokens, overflow)


def fixed_loads(shard_costs: np.ndarray, dp: int) -> np.ndarray:
    """Per consumer (``dp * cp + cp_rank``) the cost of the fixed scheme: (rows, cp) shard costs of the step's rows,
    rows in DP-replica order (each replica the same number of rows)."""
    sc = np.asarray(shard_costs, dtype=np.float64)
    rows, cp = sc.shape
    return sc.reshape(dp, rows // dp, cp).sum(axis=1).reshape(-1)


def place_in_rows(lengths: np.ndarray, costs: np.ndarray, dp: int, cp: int, max_tokens: int, capacity: float,
                  rows_per_rank: int, seq_len: int) -> tuple[HybridPlacement, np.ndarray] | None:
    """:func:`place` that also gives every piece a row of its group's DP replica (the rows carry a replica's pieces
    to its constructor): a group is a candidate only when its replica has a row with room for the whole piece
    (best fit there). Returns the placement and each piece's global row (``replica * rows_per_rank + r``), or None
    when some piece finds no row in any replica. cp must be a power of two (every group inside one replica)."""
    L = np.asarray(lengths, dtype=np.int64)
    c = np.asarray(costs, dtype=np.float64)
    if L.shape != c.shape:
        raise ValueError(f"{len(L)} lengths but {len(c)} costs")
    n = int(dp) * int(cp)
    k = group_sizes(L, max_tokens, n)
    if len(k) and int(k.max()) > cp:
        raise ValueError(f"a piece needs {int(k.max())} ranks, more than cp = {cp}: its group would leave its replica")
    first = np.zeros(len(L), dtype=np.int64)
    rows = np.zeros(len(L), dtype=np.int64)
    loads = np.zeros(n)
    tokens = np.zeros(n)
    room = np.full((int(dp), int(rows_per_rank)), int(seq_len), dtype=np.int64)
    overflow = 0
    for i in np.lexsort((-k, -c)).tolist():  # by cost, then group size, descending (as place)
        kk, ln = int(k[i]), int(L[i])
        m = n // kk
        gl = loads.reshape(m, kk).max(axis=1)
        gt = tokens.reshape(m, kk).max(axis=1)
        fits_row = room.max(axis=1) >= ln  # per replica
        rep = np.arange(m) * kk // cp
        ok = fits_row[rep]
        if not ok.any():
            return None
        cand = ok & (gt + ln / kk <= capacity * (1 + 1e-12))
        if cand.any():
            g = int(np.flatnonzero(cand)[np.argmin(gl[cand])])
        else:
            g = int(np.flatnonzero(ok)[np.argmin(gt[ok])])
            overflow += 1
        d = g * kk // cp
        r = room[d]
        fits = np.flatnonzero(r >= ln)
        j = int(fits[np.argmin(r[fits])])
        r[j] -= ln
        rows[i] = d * rows_per_rank + j
        first[i] = g * kk
        loads[g * kk:(g + 1) * kk] += c[i] / kk
        tokens[g * kk:(g + 1) * kk] += ln / kk
    return HybridPlacement(k, first, loads, tokens, overflow), rows


def within_replicas(lengths: np.ndarray, costs: np.ndarray, replica: np.ndarray, dp: int, cp: int, max_tokens: int,
                    capacity: float) -> HybridPlacement:
    """:func:`place` inside every DP replica: its pieces (``replica``) over its own cp ranks; consumers numbered
    ``dp * cp + cp_rank`` as in :func:`place`."""
    L = np.asarray(lengths, dtype=np.int64)
    c = np.asarray(costs, dtype=np.float64)
    rep = np.asarray(replica, dtype=np.int64)
    k = np.ones(len(L), dtype=np.int64)
    first = np.zeros(len(L), dtype=np.int64)
    loads = np.zeros(dp * cp)
    tokens = np.zeros(dp * cp)
    overflow = 0
    for d in range(int(dp)):
        sel = np.flatnonzero(rep == d)
        p = place(L[sel], c[sel], cp, max_tokens, capacity)
        k[sel] = p.group_size
        first[sel] = p.first + d * cp
        loads[d * cp:(d + 1) * cp] = p.loads
        tokens[d * cp:(d + 1) * cp] = p.tokens
        overflow += p.overflow
    return HybridPlacement(k, first, loads, tokens, overflow)


def spread_replicas(lengths: np.ndarray, costs: np.ndarray, replica: np.ndarray, dp: int, cp: int) -> HybridPlacement:
    """Every piece over the whole CP group of its replica (k = cp): each rank carries its replica's cost / cp."""
    L = np.asarray(lengths, dtype=np.int64)
    c = np.asarray(costs, dtype=np.float64)
    rep = np.asarray(replica, dtype=np.int64)
    loads = np.repeat(np.bincount(rep, weights=c, minlength=dp) / cp, cp)
    tokens = np.repeat(np.bincount(rep, weights=L, minlength=dp) / cp, cp)
    return HybridPlacement(np.full(len(L), int(cp), dtype=np.int64), rep * cp, loads, tokens, 0)

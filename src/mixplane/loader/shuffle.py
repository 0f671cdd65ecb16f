"""Read orders, simulated on integer ids only (no data): cheap to replay, so ``seek`` is exact.

* ``page``      — random page order over the whole source (YOUMU §5.3), stratified so that
                  every stretch of the read order spreads over the whole stored order, each page
                  optionally split into a few interleaved parts read separately (more pages in the
                  buffer at once, at the price of reading a page once per part), then the aggressive
                  buffer shuffle of Algorithm 2 on the rows of those units.
* ``row``       — full random row order; a Feistel-network permutation gives row(i) in O(1)
                  memory for any i, so even a billion-row source needs no permutation array.
* ``rowgroup``  — random row-group order, rows shuffled within the group (baseline).
* ``sequential``— pages in file order, rows in order (baseline).

Every order is a pure function of (seed, source name, epoch, partition, num_partitions) and the
index. Partitions take every N-th unit of one epoch-wide permutation, so they are disjoint and
together cover the source in every epoch, whatever N is — N may change at an epoch boundary.
"""

from __future__ import annotations

import zlib
from typing import Callable

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def epoch_rng(seed: int, source: str, epoch: int, *salt: int) -> np.random.Generator:
    """Independent, reproducible randomness per (seed, source, epoch, ...)."""
    return np.random.default_rng([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, zlib.crc32(source.encode()), epoch,
                                  *salt])


# ----------------------------------------------------------------------------------------------
# page mode: stratified page order, page splits, YOUMU Algorithm 2


def stratified_permutation(n: int, rng: np.random.Generator) -> np.ndarray:
    """A random permutation of range(n) whose every prefix is spread evenly over range(n).

    Owen-scrambled radical inverse (a randomised van der Corput order): item i sits in slot
    floor(i * 2^L / n) of a binary tree of depth L; the item's place in the permutation is its
    slot's bits read in reverse order, each XORed with a random bit drawn for its tree node. The
    first 2^j items therefore hold one item of each of the 2^j dyadic strata of range(n) (within
    one slot where n is not a power of two), for every j; and each item is equally likely at every
    place, as in a uniform permutation. Used on the pages of a partition in stored order, so that
    the first pages read in an epoch (the shuffle buffer's first fill) are a stratified sample of
    the whole source instead of a clustered one."""
    n = int(n)
    if n <= 1:
        return np.zeros(max(n, 0), np.int64)
    L = (n - 1).bit_length()
    slot = (np.arange(n, dtype=np.int64) << L) // n
    key = np.zeros(n, np.int64)
    for d in range(L):
        bit = (slot >> (L - 1 - d)) & 1
        flips = rng.integers(0, 2, size=1 << d, dtype=np.int64)
        key |= (bit ^ flips[slot >> (L - d)]) << d
    return np.argsort(key, kind="stable")


class PageParts:
    """Page splits: page u's rows are split into ``parts[u]`` interleaved parts (row j of the page
    belongs to part j mod parts[u]), each read on its own (the page is read and decoded once per
    part, and only that part's rows join the buffer). Part k of page u is the virtual unit
    ``u * stride + k``. stride = max parts; ``parts`` all 1 is plain page mode."""

    def __init__(self, starts: np.ndarray, rows: np.ndarray, parts: np.ndarray | None = None):
        self.starts = np.asarray(starts, np.int64)  # indexed by page
        self.rows = np.asarray(rows, np.int64)  # indexed by page
        self.parts = np.ones(len(self.rows), np.int64) if parts is None else np.asarray(parts, np.int64)
        self.stride = int(self.parts.max()) if len(self.parts) else 1

    def units_of(self, pages: np.ndarray) -> np.ndarray:
        """Virtual units of the given pages, in stored order (page by page, part by part)."""
        pages = np.asarray(pages, np.int64)
        m = self.parts[pages]
        first = np.repeat(np.cumsum(m) - m, m)
        return np.repeat(pages, m) * self.stride + (np.arange(int(m.sum()), dtype=np.int64) - first)

    def page(self, v) -> np.ndarray | int:
        return v // self.stride

    def size(self, v) -> np.ndarray | int:
        """Rows of virtual unit(s) v."""
        u, k = v // self.stride, v % self.stride
        m = self.parts[u]
        return np.maximum((self.rows[u] - k + m - 1) // m, 0)

    def rows_of(self, v: int) -> np.ndarray:
        """Source row ids of virtual unit v (ascending)."""
        u, k = divmod(int(v), self.stride)
        m = int(self.parts[u])
        return self.starts[u] + np.arange(k, int(self.rows[u]), m, dtype=np.int64)

    def unit_and_local(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(virtual unit, index within the unit's rows) of source rows."""
        rows = np.asarray(rows, np.int64)
        u = np.searchsorted(self.starts, rows, side="right") - 1
        j = rows - self.starts[u]
        m = self.parts[u]
        return u * self.stride + j % m, j // m


class BufferShuffle:
    """Aggressive buffer shuffle (YOUMU Alg. 2) on row ids.

    ``units`` are the (virtual) units in read order: pages, or parts of pages (:class:`PageParts`).
    The buffer is first filled to ``buffer_rows``; then, whenever a unit's worth of rows
    (``rows_per_page``) has left, the next unit is read in. Every block emits ``rows_per_page``
    rows drawn uniformly at random from the whole buffer (a shuffle after each arrival followed by
    a pop has the same distribution). When the units run out the buffer drains, still random.

    ``next_block()`` returns (row ids, units whose last buffered row left in this block).
    """

    def __init__(self, units: np.ndarray, starts: np.ndarray, rows: np.ndarray, *, buffer_rows: int,
                 rows_per_page: int, rng: np.random.Generator, parts: np.ndarray | None = None):
        self.units = np.asarray(units, np.int64)
        self.layout = PageParts(starts, rows, parts)
        self.B = max(1, int(buffer_rows))
        self.K = max(1, int(rows_per_page))
        self.rng = rng
        max_rows = int(np.max(self.layout.size(self.units))) if len(self.units) else 0
        self.buf = np.empty(self.B + max_rows + self.K, np.int64)  # row ids
        self.owner = np.empty_like(self.buf)  # unit of each buffered row
        self.size = 0
        self.next = 0
        self.left: dict[int, int] = {}
        while self.size < self.B and self.next < len(self.units):
            self._load()

    def _load(self) -> None:
        u = int(self.units[self.next])
        self.next += 1
        ids = self.layout.rows_of(u)
        n = len(ids)
        if n == 0:
            return
        s = self.size
        self.buf[s : s + n] = ids
        self.owner[s : s + n] = u
        self.size = s + n
        self.left[u] = n

    def next_block(self) -> tuple[np.ndarray, list[int]] | None:
        while self.next < len(self.units) and (self.size + self.K <= self.B or self.size == 0):
            self._load()
        if self.size == 0:
            return None
        k = min(self.K, self.size)
        pick = self.rng.choice(self.size, size=k, replace=False)
        out = self.buf[pick].copy()
        own = self.owner[pick]
        # O(k) removal: fill the picked holes below the new end with unpicked rows from the tail
        new = self.size - k
        holes = pick[pick < new]
        tail = np.arange(new, self.size)
        survivors = tail[~np.isin(tail, pick)]
        self.buf[holes] = self.buf[survivors]
        self.owner[holes] = self.owner[survivors]
        self.size = new
        done = []
        uu, cnt = np.unique(own, return_counts=True)
        for u, c in zip(uu.tolist(), cnt.tolist()):
            r = self.left[u] - c
            if r:
                self.left[u] = r
            else:
                del self.left[u]
                done.append(u)
        return out, done


# ----------------------------------------------------------------------------------------------
# row mode: O(1)-memory random permutation


def _mix(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class FeistelPermutation:
    """A keyed pseudo-random bijection of range(n), evaluated for any index array.

    Balanced Feistel network (4 rounds, splitmix64 round function) over the smallest even bit
    width covering n, with cycle walking for indices that land at or above n."""

    def __init__(self, n: int, key: int):
        self.n = int(n)
        bits = max(2, (max(self.n, 2) - 1).bit_length())
        bits += bits & 1
        self.half = np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        k = _mix(np.array([key & 0xFFFFFFFFFFFFFFFF], np.uint64) + np.arange(1, 5, dtype=np.uint64) * _M2)
        self.keys = [np.uint64(v) for v in k]

    def _round(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, idx) -> np.ndarray:
        i = np.asarray(idx, dtype=np.int64)
        if self.n <= 1:
            return np.zeros_like(i)
        if len(i) and (i.min() < 0 or i.max() >= self.n):
            raise IndexError("permutation index out of range")
        with np.errstate(over="ignore"):
            x = self._round(i.astype(np.uint64))
            bad = x >= np.uint64(self.n)
            while bad.any():
                x[bad] = self._round(x[bad])
                bad = x >= np.uint64(self.n)
        return x.astype(np.int64)


def key_of(seed: int, source: str, epoch: int, *salt: int) -> int:
    return int(epoch_rng(seed, source, epoch, *salt).integers(0, 2**63 - 1))


# ----------------------------------------------------------------------------------------------
# epoch plans: a sequence of blocks of row ids for one partition


class EpochPlan:
    """Blocks of row ids for one (epoch, partition). ``rows`` = slots in the epoch."""

    rows: int

    def next_block(self) -> tuple[np.ndarray, list[int]] | None:  # pragma: no cover - interface
        raise NotImplementedError


class PagePlan(EpochPlan):
    """``order``: this partition's units (pages, or page parts when ``parts`` is given) in read order."""

    def __init__(self, order: np.ndarray, starts: np.ndarray, rows: np.ndarray, rng: np.random.Generator, *,
                 buffer_rows: int, rows_per_page: int, parts: np.ndarray | None = None):
        order = np.asarray(order, np.int64)
        self.order = order
        self.sim = BufferShuffle(order, starts, rows, buffer_rows=buffer_rows, rows_per_page=rows_per_page, rng=rng,
                                 parts=parts)
        self.layout = self.sim.layout
        self.rows = int(np.sum(self.layout.size(order)))

    def next_block(self):
        return self.sim.next_block()

    @property
    def frontier(self) -> int:
        """Units of ``order`` that entered the shuffle buffer so far (any of their rows may be drawn next)."""
        return self.sim.next


class SequentialPlan(EpochPlan):
    """Units in the given order, rows in order; one block per unit."""

    def __init__(self, order: np.ndarray, starts: np.ndarray, rows: np.ndarray,
                 within: Callable[[int, int], np.ndarray] | None = None):
        self.order = np.asarray(order, np.int64)
        self.starts, self.urows = starts, rows
        self.rows = int(rows[self.order].sum())
        self.i = 0
        self.within = within

    def next_block(self):
        while self.i < len(self.order):
            u = int(self.order[self.i])
            self.i += 1
            n = int(self.urows[u])
            if n == 0:
                continue
            ids = self.starts[u] + (self.within(u, n) if self.within is not None else np.arange(n, dtype=np.int64))
            return ids, [u]
        return None

    @property
    def frontier(self) -> int:
        """Units of ``order`` reached so far (the last of them is being read)."""
        return self.i


class RowPlan(EpochPlan):
    """Full shuffle of rows [row_lo, row_lo + n): position j of partition p is permutation[p + N*j]."""

    def __init__(self, row_lo: int, n: int, key: int, partition: int, num_partitions: int, block: int):
        self.perm = FeistelPermutation(n, key)
        self.row_lo, self.n = row_lo, n
        self.p, self.N = partition, num_partitions
        self.rows = max(0, (n - partition + num_partitions - 1) // num_partitions)
        self.block = max(1, block)
        self.j = 0

    def next_block(self):
        if self.j >= self.rows:
            return None
        j1 = min(self.rows, self.j + self.block)
        pos = self.p + self.N * np.arange(self.j, j1, dtype=np.int64)
        self.j = j1
        return self.row_lo + self.perm(pos), []

    def peek(self, blocks: int) -> np.ndarray:
        """Row ids of the next ``blocks`` blocks, without moving on."""
        j1 = min(self.rows, self.j + max(0, blocks) * self.block)
        return self.row_lo + self.perm(self.p + self.N * np.arange(self.j, j1, dtype=np.int64))

    def skip_blocks(self, k: int) -> None:
        self.j = min(self.rows, self.j + k * self.block)


class RangePlan(EpochPlan):
    """Slots [lo, hi) of another epoch plan (a piece of a re-partitioned source, :mod:`mixplane.repartition`),
    its blocks cut at both ends; reading starts at slot ``start`` (lo <= start <= hi). The slots before
    ``start`` are replayed on integer ids only (``skip_to`` skips whole blocks where the mode can), so a
    piece reads the same rows in the same order as the plan it is cut from."""

    def __init__(self, inner: EpochPlan, lo: int, hi: int, start: int, skip_to: Callable[[EpochPlan, int], int]):
        if not 0 <= lo <= start <= hi:
            raise ValueError(f"range plan: need 0 <= lo {lo} <= start {start} <= hi {hi}")
        self.inner, self.lo, self.hi = inner, int(lo), int(hi)
        self.rows = self.hi - self.lo
        at = skip_to(inner, start) if start > 0 else 0
        self._pending: tuple[np.ndarray, list[int]] | None = None
        while at < start:
            nb = inner.next_block()
            if nb is None:
                break
            ids, done = nb
            if at + len(ids) > start:
                self._pending = (ids[start - at :], done)
                at = start
                break
            at += len(ids)
        self._at = at  # plan slot of the next block's first row

    def next_block(self):
        if self._at >= self.hi:
            return None
        if self._pending is not None:
            (ids, done), self._pending = self._pending, None
        else:
            nb = self.inner.next_block()
            if nb is None:
                return None
            ids, done = nb
        if self._at + len(ids) > self.hi:
            ids = ids[: self.hi - self._at]
        self._at += len(ids)
        return ids, done

    # read-ahead hints of the plan it is cut from
    @property
    def order(self):
        return getattr(self.inner, "order", None)

    @property
    def frontier(self) -> int:
        return int(getattr(self.inner, "frontier", 0))

    def peek(self, blocks: int) -> np.ndarray:
        peek = getattr(self.inner, "peek", None)
        return peek(blocks) if peek is not None else np.zeros(0, np.int64)

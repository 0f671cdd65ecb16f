"""Packing documents into fixed-length rows (pure logic, used by the planner's step layout).

Best fit puts each piece in the fullest row that still has room (seed 004: near 100% use of the
context window); next fit only ever fills the current row and moves on (about 15% waste);
`none` gives every document its own row (padding), the unpacked baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sortedcontainers import SortedList


class OnlinePacker:
    """Places pieces one at a time into `rows` rows of `seq_len` tokens."""

    def __init__(self, rows: int, seq_len: int, policy: str = "best_fit"):
        if policy not in ("best_fit", "next_fit", "none"):
            raise ValueError(f"unknown packing policy {policy!r}")
        self.rows = rows
        self.seq_len = seq_len
        self.policy = policy
        self.free = np.full(rows, seq_len, dtype=np.int64)
        self._by_free = SortedList((seq_len, r) for r in range(rows)) if policy == "best_fit" else None
        self._current = 0  # next_fit / none: the open row

    @property
    def free_tokens(self) -> int:
        return int(self.free.sum())

    @property
    def largest_gap(self) -> int:
        if self.policy == "best_fit":
            return self._by_free[-1][0] if self._by_free else 0
        if self._current >= self.rows:
            return 0
        return int(self.free[self._current:].max()) if self.policy == "next_fit" else int(self.free[self._current])

    def fits(self, length: int) -> bool:
        return 0 < length <= self.largest_gap

    def place(self, length: int) -> int:
        """Row the piece went to, or -1 if it fits nowhere (nothing changes then)."""
        if length <= 0 or length > self.seq_len:
            return -1
        if self.policy == "best_fit":
            i = self._by_free.bisect_left((length, -1))
            if i >= len(self._by_free):
                return -1
            free, row = self._by_free.pop(i)
            if free - length > 0:
                self._by_free.add((free - length, row))
            self.free[row] = free - length
            return row
        if self.policy == "next_fit":
            while self._current < self.rows and self.free[self._current] < length:
                self._current += 1
            if self._current >= self.rows:
                return -1
            row = self._current
            self.free[row] -= length
            return row
        # none: one document per row
        if self._current >= self.rows:
            return -1
        row = self._current
        self.free[row] -= length
        self._current += 1
        return row


@dataclass
class PackingStats:
    rows: int
    seq_len: int
    tokens: int

    @property
    def efficiency(self) -> float:
        return self.tokens / float(self.rows * self.seq_len) if self.rows else 0.0


def pack_lengths(lengths: np.ndarray, seq_len: int, policy: str = "best_fit", *, sort_decreasing: bool = True) -> tuple[np.ndarray, int]:
    """Offline packing of whole pieces (each <= seq_len): row of each piece and the number of rows used.

    With sort_decreasing this is best-fit-decreasing (BFD) for `best_fit`.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if np.any(lengths > seq_len) or np.any(lengths <= 0):
        raise ValueError("pieces must be in 1..seq_len")
    order = np.argsort(-lengths, kind="stable") if sort_decreasing and policy == "best_fit" else np.arange(len(lengths))
    packer = OnlinePacker(len(lengths), seq_len, policy)
    rows = np.empty(len(lengths), dtype=np.int64)
    for i in order:
        rows[i] = packer.place(int(lengths[i]))
    used = int((packer.free < seq_len).sum())
    if policy == "best_fit":
        # renumber used rows densely in order of first use
        uniq, dense = np.unique(rows, return_inverse=True)
        rows = dense.astype(np.int64)
        used = len(uniq)
    return rows, used


def split_overlong(lengths: np.ndarray, seq_len: int, policy: str = "split") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces of at most seq_len: (document index, start offset, length) per piece."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if policy == "truncate":
        lens = np.minimum(lengths, seq_len)
        return np.arange(len(lengths)), np.zeros(len(lengths), dtype=np.int64), lens
    npieces = np.maximum(1, -(-lengths // seq_len))
    doc = np.repeat(np.arange(len(lengths)), npieces)
    first = np.concatenate([[0], np.cumsum(npieces)[:-1]])
    k = np.arange(len(doc)) - np.repeat(first, npieces)
    start = k * seq_len
    length = np.minimum(seq_len, lengths[doc] - start)
    return doc, start, length

"""Packing documents into fixed-length rows: a planner decision (pure logic: no sockets, no processes).

Two ways in:

* :class:`OnlinePacker` places pieces one at a time into a fixed number of rows; the planner uses it
  to fill one step's rows from the loaders' read-ahead windows.
* :func:`pack_documents` packs a whole list of documents offline (best-fit-decreasing, next-fit or
  one-per-row), applying an over-long policy first, and returns a :class:`PackPlan` with every
  piece's row and offset plus a :class:`PackingReport` (efficiency, padding, splits, drops).

Policies (poolside's Model Factory): best fit puts each piece in the fullest row that still has room and, on pieces
sorted by decreasing length (BFD), comes close to 100% use of the context window; next fit only ever
fills the current row and opens a new one when a piece does not fit (about 15% waste); `none` gives
every piece its own row, the unpacked baseline.

Over-long documents (longer than ``seq_len``): ``split`` cuts them into ``seq_len`` chunks plus a
remainder that is packed like any other piece; ``truncate`` keeps the first ``seq_len`` tokens;
``drop`` skips the document. Every policy reports the tokens it did not deliver.

``align`` rounds each piece's footprint in its row up to a multiple (e.g. ``2 * cp`` for the
per-document context-parallel layout of :mod:`mixplane.parallelism`); the rounding is padding.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from sortedcontainers import SortedList

from mixplane.layout import segment_offsets
from mixplane.spec import OVERLONG_POLICIES, PACKING_POLICIES  # the one list of each (spec fields use them)


def _check_policy(policy: str) -> None:
    if policy not in PACKING_POLICIES:
        raise ValueError(f"unknown packing policy {policy!r} (expected one of {', '.join(PACKING_POLICIES)})")


class OnlinePacker:
    """Places pieces one at a time into `rows` rows of `seq_len` tokens."""

    def __init__(self, rows: int, seq_len: int, policy: str = "best_fit"):
        _check_policy(policy)
        if rows < 0 or seq_len <= 0:
            raise ValueError(f"rows={rows} and seq_len={seq_len} must be >= 0 and > 0")
        self.rows = rows
        self.seq_len = seq_len
        self.policy = policy
        self.free = np.full(rows, seq_len, dtype=np.int64)
        # (free, row) of every row with room: best fit only (empty for the other policies)
        self._by_free = SortedList((seq_len, r) for r in range(rows)) if policy == "best_fit" else SortedList()
        self._current = 0  # next_fit / none: the open row

    @property
    def free_tokens(self) -> int:
        return int(self.free.sum())

    @property
    def used_rows(self) -> int:
        return int((self.free < self.seq_len).sum())

    @property
    def largest_gap(self) -> int:
        if self.policy == "best_fit":
            return self._by_free[-1][0] if self._by_free else 0
        if self._current >= self.rows:
            return 0
        if self.policy == "next_fit" and self._current + 1 < self.rows:
            return self.seq_len  # rows after the open one are still empty
        return int(self.free[self._current])

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
class PackingReport:
    """How well a set of documents filled its rows."""

    policy: str
    overlong: str
    seq_len: int
    documents: int
    pieces: int
    rows: int
    tokens: int  # tokens delivered (inside rows)
    capacity: int  # rows * seq_len
    padding_tokens: int  # capacity - tokens (includes alignment padding)
    split_documents: int  # documents cut into more than one piece
    dropped_tokens: int  # tokens not delivered (truncated or dropped documents)
    dropped_documents: int

    @property
    def efficiency(self) -> float:
        """Fraction of the rows' tokens that carry document tokens (1.0 = no padding)."""
        return self.tokens / self.capacity if self.capacity else 0.0

    @property
    def waste(self) -> float:
        return 1.0 - self.efficiency if self.capacity else 0.0

    @property
    def docs_per_row(self) -> float:
        return self.pieces / self.rows if self.rows else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(efficiency=round(self.efficiency, 6), waste=round(self.waste, 6), docs_per_row=round(self.docs_per_row, 3))
        return d


@dataclass
class PackPlan:
    """Every piece of every document, with the row it landed in and its offset there.

    Pieces are listed row by row, in their order inside the row, so ``row`` is non-decreasing and
    ``offset`` grows inside a row. ``doc``/``start``/``length`` say which tokens the piece holds.
    """

    doc: np.ndarray  # int64, document index per piece
    start: np.ndarray  # int64, first token of the piece inside its document
    length: np.ndarray  # int64, tokens of the piece
    row: np.ndarray  # int64, row of the piece
    offset: np.ndarray  # int64, first position of the piece inside its row
    rows: int
    seq_len: int
    report: PackingReport

    def __len__(self) -> int:
        return len(self.doc)

    def row_fill(self) -> np.ndarray:
        return np.bincount(self.row, weights=self.length, minlength=self.rows).astype(np.int64)

    def cu_seqlens(self, row: int) -> np.ndarray:
        """FlashAttention varlen boundaries of one row (int32, starts with 0, last piece end, then seq_len if padded)."""
        sel = self.row == row
        ends = self.offset[sel] + self.length[sel]
        cu = np.concatenate([[0], ends]).astype(np.int32)
        return cu if (len(ends) and ends[-1] == self.seq_len) else np.concatenate([cu, [self.seq_len]]).astype(np.int32)


def split_overlong(lengths: np.ndarray, seq_len: int, policy: str = "split") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces of at most seq_len: (document index, start offset, length) per piece.

    ``split``: chunks of seq_len plus the remainder; ``truncate``: the first seq_len tokens;
    ``drop``: documents longer than seq_len yield no piece. Empty documents yield no piece.
    """
    if policy not in OVERLONG_POLICIES:
        raise ValueError(f"unknown over-long policy {policy!r} (expected one of {', '.join(OVERLONG_POLICIES)})")
    if seq_len <= 0:
        raise ValueError(f"seq_len must be > 0, got {seq_len}")
    lengths = np.asarray(lengths, dtype=np.int64)
    if np.any(lengths < 0):
        raise ValueError("document lengths must be >= 0")
    if policy in ("truncate", "drop"):
        keep = lengths > 0 if policy == "truncate" else (lengths > 0) & (lengths <= seq_len)
        doc = np.flatnonzero(keep)
        return doc, np.zeros(len(doc), dtype=np.int64), np.minimum(lengths[doc], seq_len)
    npieces = -(-lengths // seq_len)  # 0 for empty documents
    doc = np.repeat(np.arange(len(lengths)), npieces)
    first = np.cumsum(npieces) - npieces
    k = np.arange(len(doc), dtype=np.int64) - np.repeat(first, npieces)
    start = k * seq_len
    length = np.minimum(seq_len, lengths[doc] - start)
    return doc, start, length


def _aligned(lengths: np.ndarray, align: int) -> np.ndarray:
    return lengths if align <= 1 else -(-lengths // align) * align


def assign_rows(lengths: np.ndarray, seq_len: int, policy: str = "best_fit", *, decreasing: bool = True) -> np.ndarray:
    """Offline row of each piece (each 1..seq_len), rows numbered densely in order of first use.

    best_fit with ``decreasing`` is best-fit-decreasing (ties keep input order, so it is deterministic);
    next_fit and none keep the input order.
    """
    _check_policy(policy)
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    if n and (lengths.min() <= 0 or lengths.max() > seq_len):
        raise ValueError(f"pieces must be in 1..seq_len={seq_len}")
    rows = np.empty(n, dtype=np.int64)
    if policy == "none":
        rows[:] = np.arange(n)
        return rows
    if policy == "next_fit":
        # open a new row whenever the running fill would exceed seq_len
        row, fill = 0, 0
        for i, ln in enumerate(lengths.tolist()):
            if fill + ln > seq_len:
                row, fill = row + 1, 0
            rows[i] = row
            fill += ln
        return rows
    order = np.argsort(-lengths, kind="stable") if decreasing else np.arange(n)
    by_free: SortedList = SortedList()  # (free, row) of open rows with free > 0
    nrows = 0
    for i in order.tolist():
        ln = int(lengths[i])
        j = by_free.bisect_left((ln, -1))
        if j < len(by_free):
            free, row = by_free.pop(j)
        else:
            free, row = seq_len, nrows
            nrows += 1
        rows[i] = row
        if free - ln > 0:
            by_free.add((free - ln, row))
    return rows


def pack_lengths(lengths: np.ndarray, seq_len: int, policy: str = "best_fit", *, sort_decreasing: bool = True) -> tuple[np.ndarray, int]:
    """Offline packing of whole pieces (each <= seq_len): row of each piece and the number of rows used.

    With sort_decreasing this is best-fit-decreasing (BFD) for `best_fit`.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if np.any(lengths > seq_len) or np.any(lengths <= 0):
        raise ValueError("pieces must be in 1..seq_len")
    rows = assign_rows(lengths, seq_len, policy, decreasing=sort_decreasing)
    return rows, (int(rows.max()) + 1 if len(rows) else 0)


def pack_documents(lengths: np.ndarray, seq_len: int, policy: str = "best_fit", overlong: str = "split", *,
                   decreasing: bool = True, align: int = 1) -> PackPlan:
    """Pack whole documents into rows of seq_len tokens: the plan and its report.

    Inside a row, pieces sit in the order they were placed (BFD: longest first), each starting
    where the previous one's aligned footprint ends.
    """
    _check_policy(policy)
    if align < 1 or seq_len % align:
        raise ValueError(f"align={align} must be >= 1 and divide seq_len={seq_len}")
    lengths = np.asarray(lengths, dtype=np.int64)
    doc, start, length = split_overlong(lengths, seq_len, overlong)
    foot = _aligned(length, align)
    rows = assign_rows(foot, seq_len, policy, decreasing=decreasing)
    nrows = int(rows.max()) + 1 if len(rows) else 0
    # placement order inside each row: the order assign_rows placed them
    place_order = np.argsort(-foot, kind="stable") if (policy == "best_fit" and decreasing) else np.arange(len(foot))
    rank_in_order = np.empty(len(foot), dtype=np.int64)
    rank_in_order[place_order] = np.arange(len(foot))
    order = np.lexsort((rank_in_order, rows))
    doc, start, length, foot, rows = doc[order], start[order], length[order], foot[order], rows[order]
    # offsets: running sum of footprints within each row
    offset = segment_offsets(rows, foot)
    delivered = int(length.sum())
    npieces = np.bincount(doc, minlength=len(lengths)) if len(doc) else np.zeros(len(lengths), np.int64)
    report = PackingReport(
        policy=policy, overlong=overlong, seq_len=seq_len, documents=int(len(lengths)), pieces=int(len(doc)),
        rows=nrows, tokens=delivered, capacity=nrows * seq_len, padding_tokens=nrows * seq_len - delivered,
        split_documents=int((npieces > 1).sum()), dropped_tokens=int(lengths.sum()) - delivered,
        dropped_documents=int(((npieces == 0) & (lengths > 0)).sum()),
    )
    return PackPlan(doc, start, length, rows, offset.astype(np.int64), nrows, seq_len, report)


def packing_report_chunks(lengths: np.ndarray, seq_len: int, policy: str = "best_fit", overlong: str = "split", *,
                          chunk: int = 4096, decreasing: bool = True) -> PackingReport:
    """Pack consecutive chunks of `chunk` documents independently (poolside's sub-plans, or one step's
    window) and sum the reports: what a streaming packer with that much look-ahead achieves."""
    lengths = np.asarray(lengths, dtype=np.int64)
    parts = [pack_documents(lengths[i:i + chunk], seq_len, policy, overlong, decreasing=decreasing).report
             for i in range(0, max(len(lengths), 1), chunk)]
    tot = PackingReport(policy, overlong, seq_len, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    for p in parts:
        for f in ("documents", "pieces", "rows", "tokens", "capacity", "padding_tokens", "split_documents",
                  "dropped_tokens", "dropped_documents"):
            setattr(tot, f, getattr(tot, f) + getattr(p, f))
    return tot

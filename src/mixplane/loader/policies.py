"""Shuffle policies: what each read order (``SourceSpec.shuffle``) decides for a SourceStream.

One object per mode answers the four questions the stream asks, so the stream never switches on
the mode:

* ``plan``       — the epoch's :class:`shuffle.EpochPlan` (blocks of row ids) for this partition;
* ``epoch_rows`` — how many slots that epoch has, without building the plan (``seek`` counts on it);
* ``layout``     — how source rows map to the units the stream reads and caches (pages, page parts
  or row-group chunks), as a :class:`shuffle.PageParts`;
* ``load``       — read one unit's rows, and which pages are lost when it cannot be read.

Plus the per-mode details: the pages of a segment split into parts (page mode), skipping whole
blocks on seek (row mode), and which cache holds the units (:mod:`unitcache`). Orders are pure
functions of the :class:`OrderKey`, the epoch and the index (see :mod:`shuffle`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import pyarrow as pa

from mixplane.loader.shuffle import (
    EpochPlan, PageParts, PagePlan, RowPlan, SequentialPlan, epoch_rng, key_of, stratified_permutation,
)
from mixplane.loader.unitcache import ArenaCache, LRUCache, PlainCache, UnitCache

if TYPE_CHECKING:
    from mixplane.loader.pageindex import SourceIndex
    from mixplane.loader.sourcereader import SourceReader

READ_BUDGET = 1.0  # page mode: compressed bytes read per decoded byte delivered, when page_reads is automatic
MAX_PAGE_READS = 4  # page mode: parts a page may be split into (reads of one page per epoch)
MIN_PART_ROWS = 4  # a page is split only into parts of at least this many rows


@dataclass(frozen=True)
class OrderKey:
    """What every order is a function of, besides the epoch and the index."""

    seed: int
    source: str
    partition: int = 0
    num_partitions: int = 1


@dataclass
class Segment:
    """A run of files read as one epoch-like unit (all files for a finite source; one discovery
    batch for a live source): its ranges of units (pages), chunks and rows in the index."""

    unit_lo: int
    unit_hi: int
    chunk_lo: int
    chunk_hi: int
    row_lo: int
    row_hi: int
    paths: list[str]
    page_reads: int = 1  # page mode: parts per page (at most)
    rows_per_unit: int = 1  # page mode: mean rows of a part (YOUMU's #rowPage)


class ShufflePolicy:
    """The base: units are pages of the primary column, read whole."""

    mode: ClassVar[str]
    needs_units_per_partition: ClassVar[bool] = True  # each partition needs a page (row mode splits rows)

    def __init__(self, key: OrderKey, *, page_reads: int | None = None, row_block: int = 512):
        self.key = key
        self.page_reads = page_reads
        self.row_block = int(row_block)

    # -- segments --
    def reads_per_page(self, idx: "SourceIndex", seg: Segment) -> int:
        """Parts each page of a new segment may be split into (1: pages are read whole)."""
        return 1

    # -- epochs --
    def plan(self, idx: "SourceIndex", seg: Segment, epoch: int, parts: np.ndarray, buffer_rows: int) -> EpochPlan:
        raise NotImplementedError

    def epoch_rows(self, idx: "SourceIndex", seg: Segment, epoch: int, parts: np.ndarray) -> int:
        raise NotImplementedError

    def layout(self, idx: "SourceIndex", plan: EpochPlan | None) -> PageParts:
        return PageParts(idx.unit_row_start, idx.unit_rows)

    def skip_to(self, plan: EpochPlan, offset: int) -> int:
        """Skip whole blocks of ``plan`` towards slot ``offset`` of its epoch without reading them;
        the slots skipped (the stream then walks the remaining blocks)."""
        return 0

    # -- reading --
    def load(self, reader: "SourceReader", idx: "SourceIndex", layout: PageParts, u: int) -> dict[str, pa.Array]:
        """Rows of unit ``u`` (raises ParquetError)."""
        p = int(layout.page(u))
        r0 = int(idx.unit_row_start[p])
        n = int(idx.unit_rows[p])
        c = int(idx.chunk_of_units([p])[0])
        m = int(layout.parts[p])
        # one part of a split page: decode only its rows
        select = np.arange(u % layout.stride, n, m, dtype=np.int64) if m > 1 else None
        return reader.read_rows(c, r0, r0 + n, (p, p + 1), select)

    def pages_of(self, idx: "SourceIndex", primary: int) -> tuple[int, int]:
        """Pages of the first column lost when primary unit ``primary`` cannot be read."""
        return primary, primary + 1

    def bad_units_of_chunk(self, chunk: int, u0: int, u1: int) -> list[int]:
        """Primary units lost with an unreadable column chunk whose pages are [u0, u1)."""
        return list(range(u0, u1))

    def make_cache(self, slab_bytes: int, row_cache_bytes: int) -> UnitCache:
        return PlainCache()


class PagePolicy(ShufflePolicy):
    """Random, stratified page order, pages split into parts, YOUMU's buffer shuffle (default)."""

    mode = "page"

    def reads_per_page(self, idx, seg):
        if self.page_reads is not None:
            return self.page_reads
        p = idx.primary
        comp = float(p["unit_len"][seg.unit_lo : seg.unit_hi].sum() + p["chunk_dict_len"][seg.chunk_lo : seg.chunk_hi].sum())
        raw = float(p["chunk_raw_len"][seg.chunk_lo : seg.chunk_hi].sum())
        ratio = comp / raw if raw > 0 else 1.0
        return int(min(MAX_PAGE_READS, max(1, np.floor(READ_BUDGET / max(ratio, 1e-6)))))

    def _units(self, idx, seg: Segment, epoch: int, parts: np.ndarray) -> np.ndarray:
        """This partition's units (page parts) of the segment, in stored order. The partitions take
        every N-th unit of one uniform permutation of the segment's units."""
        k = self.key
        units = PageParts(idx.unit_row_start, idx.unit_rows, parts).units_of(
            np.arange(seg.unit_lo, seg.unit_hi, dtype=np.int64))
        if k.num_partitions == 1:
            return units
        perm = epoch_rng(k.seed, k.source, epoch, 1).permutation(len(units))
        return np.sort(units[perm[k.partition :: k.num_partitions]])

    def plan(self, idx, seg, epoch, parts, buffer_rows):
        k = self.key
        mine = self._units(idx, seg, epoch, parts)
        order = mine[stratified_permutation(len(mine), epoch_rng(k.seed, k.source, epoch, 5, k.partition, k.num_partitions))]
        return PagePlan(order, idx.unit_row_start, idx.unit_rows,
                        epoch_rng(k.seed, k.source, epoch, 2, k.partition, k.num_partitions),
                        buffer_rows=buffer_rows, rows_per_page=seg.rows_per_unit, parts=parts)

    def epoch_rows(self, idx, seg, epoch, parts):
        if self.key.num_partitions == 1:
            return seg.row_hi - seg.row_lo
        lay = PageParts(idx.unit_row_start, idx.unit_rows, parts)
        return int(lay.size(self._units(idx, seg, epoch, parts)).sum())

    def layout(self, idx, plan):
        if isinstance(plan, PagePlan):
            return plan.layout
        return super().layout(idx, plan)

    def make_cache(self, slab_bytes, row_cache_bytes):
        return ArenaCache(slab_bytes)


class RowPolicy(ShufflePolicy):
    """Full shuffle: a keyed permutation of the segment's rows; partitions take every N-th slot."""

    mode = "row"
    needs_units_per_partition = False

    def plan(self, idx, seg, epoch, parts, buffer_rows):
        k = self.key
        return RowPlan(seg.row_lo, seg.row_hi - seg.row_lo, key_of(k.seed, k.source, epoch, 7), k.partition,
                       k.num_partitions, self.row_block)

    def epoch_rows(self, idx, seg, epoch, parts):
        n, p, N = seg.row_hi - seg.row_lo, self.key.partition, self.key.num_partitions
        return max(0, (n - p + N - 1) // N)

    def skip_to(self, plan, offset):
        assert isinstance(plan, RowPlan)
        blocks = offset // plan.block
        plan.skip_blocks(blocks)
        return blocks * plan.block

    def make_cache(self, slab_bytes, row_cache_bytes):
        return LRUCache(row_cache_bytes)


class RowGroupPolicy(ShufflePolicy):
    """Baseline: random row-group order, rows shuffled within each group. Units are column chunks."""

    mode = "rowgroup"

    def _order(self, seg: Segment, epoch: int) -> np.ndarray:
        k = self.key
        chunks = np.arange(seg.chunk_lo, seg.chunk_hi, dtype=np.int64)
        return chunks[epoch_rng(k.seed, k.source, epoch, 3).permutation(len(chunks))][k.partition :: k.num_partitions]

    def plan(self, idx, seg, epoch, parts, buffer_rows):
        seed, name = self.key.seed, self.key.source

        def within(c: int, n: int) -> np.ndarray:
            return epoch_rng(seed, name, epoch, 4, c).permutation(n).astype(np.int64)

        return SequentialPlan(self._order(seg, epoch), idx.chunk_row_start, idx.chunk_rows, within)

    def epoch_rows(self, idx, seg, epoch, parts):
        if self.key.num_partitions == 1:
            return seg.row_hi - seg.row_lo
        return int(idx.chunk_rows[self._order(seg, epoch)].sum())

    def layout(self, idx, plan):
        return PageParts(idx.chunk_row_start, idx.chunk_rows)

    def load(self, reader, idx, layout, u):
        c = int(layout.page(u))
        r0 = int(idx.chunk_row_start[c])
        return reader.read_rows(c, r0, r0 + int(idx.chunk_rows[c]), self.pages_of(idx, c))

    def pages_of(self, idx, primary):
        a = idx.primary["chunk_first_unit"]
        return int(a[primary]), int(a[primary + 1])

    def bad_units_of_chunk(self, chunk, u0, u1):
        return [chunk]


class SequentialPolicy(ShufflePolicy):
    """Baseline: pages in file order, rows in order; partitions take every N-th page."""

    mode = "sequential"

    def plan(self, idx, seg, epoch, parts, buffer_rows):
        k = self.key
        units = np.arange(seg.unit_lo, seg.unit_hi, dtype=np.int64)
        return SequentialPlan(units[k.partition :: k.num_partitions], idx.unit_row_start, idx.unit_rows)

    def epoch_rows(self, idx, seg, epoch, parts):
        k = self.key
        if k.num_partitions == 1:
            return seg.row_hi - seg.row_lo
        nu = seg.unit_hi - seg.unit_lo
        return int(idx.unit_rows[seg.unit_lo + np.arange(k.partition, nu, k.num_partitions)].sum())


POLICIES: dict[str, type[ShufflePolicy]] = {c.mode: c for c in (PagePolicy, RowPolicy, RowGroupPolicy, SequentialPolicy)}


def policy_for(mode: str, key: OrderKey, *, page_reads: int | None = None, row_block: int = 512) -> ShufflePolicy:
    """The policy of a shuffle mode; unknown modes are refused by name."""
    cls = POLICIES.get(mode)
    if cls is None:
        raise ValueError(f"source {key.source!r}: unknown shuffle mode {mode!r} (one of {sorted(POLICIES)})")
    return cls(key, page_reads=page_reads, row_block=row_block)

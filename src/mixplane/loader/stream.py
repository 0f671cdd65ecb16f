"""A source partition as a deterministic, infinite, seekable stream of rows (`SourceStream`).

Epoch e's order is a pure function of (seed, source name, e, partition, num_partitions) and the
source's files; ``seek(p)`` makes the next ``take`` return exactly what an unbroken stream would have
returned at slot p; every row carries ``make_key(epoch, row)``; quarantined units leave their slots
empty. Each shuffle mode is a policy object (:mod:`policies`), decoded units sit in a cache beside the
arena (:mod:`unitcache`); this class is orchestration plus state: files and segments, epochs and
positions, seek, take, resume. The full contract, live sources, page mode and its memory bound:
docs/loader.md.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from mixplane.errors import MixplaneError
from mixplane.loader.bounds import bound_texts
from mixplane.loader.files import SourceFiles, SourceFilesError, list_source
from mixplane.loader.indexscan import build_source_index
from mixplane.loader.listing import source_listing
from mixplane.loader.pageindex import SourceIndex
from mixplane.loader.sourcereader import SourceReader
from mixplane.loader.parquet import IOStats, ParquetError, int64_array
from mixplane.loader.policies import (
    MAX_PAGE_READS, MIN_PART_ROWS, READ_BUDGET, OrderKey, Segment, ShufflePolicy, policy_for,
)
from mixplane.loader.quarantine import QuarantineLog
from mixplane.loader.shuffle import EpochPlan, PageParts, RangePlan, epoch_rng
from mixplane.loader.unitcache import SLAB_LIVE_RATIO
from mixplane.loader.workers import resolve_workers
from mixplane.repartition import Layout, Piece, RepartitionError
from mixplane.samples import key_row, make_key
from mixplane.spec import SourceSpec

log = logging.getLogger(__name__)
STATE_VERSION = 3  # 2: stratified page order and page splits; 3: "order" (pages, or blocks of a large source)
OLD_STATE_VERSIONS = (2,)  # states of a stream in page order whose meaning did not change
DEFAULT_BUFFER_ROWS = 10_000
MIN_BUFFER_ROWS = 64

__all__ = ["RawSamples", "SourceStream", "open_stream", "epoch_rng", "DEFAULT_BUFFER_ROWS", "MAX_PAGE_READS",
           "MIN_PART_ROWS", "READ_BUDGET", "SLAB_LIVE_RATIO"]


@dataclass
class RawSamples:
    """Rows taken from a stream: keys, stream positions and the projected columns."""

    keys: np.ndarray  # int64
    positions: np.ndarray  # int64
    columns: dict[str, pa.Array] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.keys)


class StreamError(MixplaneError, ValueError):
    """A stream that cannot be opened or continued; the message names the source."""


class SourceStream:
    def __init__(self, source: SourceSpec, *, seed: int, partition: int = 0, num_partitions: int = 1,
                 files: SourceFiles | None = None, buffer_rows: int = DEFAULT_BUFFER_ROWS, buffer_bytes: int | None = None,
                 quarantine: QuarantineLog | None = None, stats: IOStats | None = None, cache_dir: str | None = "default",
                 verify_crc: bool = True, row_block: int = 512, row_cache_bytes: int = 64 << 20,
                 poll_s: float = 2.0, status_every_s: float = 30.0, page_reads: int | None = None,
                 slab_bytes: int = 4 << 20, workers: int = 1, index_options: dict | None = None):
        if not 0 <= partition < num_partitions:
            raise ValueError(f"partition {partition} not in [0, {num_partitions})")
        self.source = source
        self.name = source.name
        self.mode = source.shuffle
        self.live = bool(source.live)
        self.seed = int(seed)
        self.partition, self.num_partitions = int(partition), int(num_partitions)
        self.columns = list(source.columns)
        self.buffer_rows = int(buffer_rows)
        if page_reads is not None and not 1 <= int(page_reads) <= 64:
            raise ValueError(f"page_reads must be in [1, 64], not {page_reads}")
        self.page_reads = None if page_reads is None else int(page_reads)
        self._parts = np.zeros(0, np.int8)  # page mode: parts of each page (unit)
        self.row_block = int(row_block)
        self.policy = policy_for(self.mode, OrderKey(self.seed, self.name, self.partition, self.num_partitions),
                                 page_reads=self.page_reads, row_block=self.row_block)
        self.poll_s, self.status_every_s = poll_s, status_every_s
        self.quarantine = quarantine if quarantine is not None else QuarantineLog(source.name)
        self.stats = stats if stats is not None else IOStats()
        self._cache_dir = cache_dir
        self._index_options = dict(index_options or {})  # build_source_index's pack options (a block of a large source)
        # live sources list their storage at most once per poll_s (monotonic clock)
        self.next_rescan_at = time.monotonic() + self.poll_s if files is None else 0.0
        # a static source's files: its kept listing while young enough (loader.listing), else listed and kept
        self.files = files or (list_source(source) if self.live else source_listing(source, cache_dir=_listing_cache(cache_dir)))
        self.index = SourceIndex(self.columns, source.kind)
        self._known: dict[str, tuple[int, int]] = {}  # path -> (size, mtime) already tried
        self._indexed: set[str] = set()  # the paths of self.index.files (a rescan looks a path up, not the list)
        self.segments: list[Segment] = []
        self._bad_units: set[int] = set()  # primary units (page / row-group chunk) that failed
        self._add_files(list(self.files.paths), list(self.files.sizes), list(self.files.mtimes_ns))
        if buffer_bytes is not None and self.index.num_rows:
            # a memory budget, not only a row count: a buffer of long documents stays bounded
            per_row = max(1.0, self.index.decoded_bytes_per_row())
            self.buffer_rows = max(MIN_BUFFER_ROWS, min(self.buffer_rows, int(buffer_bytes / per_row)))
        if not self.live:
            if self.index.num_rows == 0:
                why = "; ".join(str(e) for e in self.index.bad_files.values()) or "no Parquet files"
                raise StreamError(f"source {self.name!r}: no readable rows in {source.uri} ({why})")
            if self.index.num_units < self.num_partitions and self.policy.needs_units_per_partition:
                raise StreamError(f"source {self.name!r}: {self.index.num_units} pages cannot be split into "
                                  f"{self.num_partitions} partitions")
        self.reader = self._new_reader(verify_crc)
        # sources[].workers: the pages of a take's new units decompressed and decoded on threads (local files; a
        # remote source's bytes come from the read-ahead's own threads), used in the take's own order
        self.workers = max(1, int(workers))
        self._decoders: ThreadPoolExecutor | None = None
        self.cache = self.policy.make_cache(slab_bytes, row_cache_bytes)  # decoded units with rows to come
        # text columns a transform tokenizes (kind text: the text; image_text: the caption), bounded on load
        text_cols = {"text": self.columns[:1], "image_text": self.columns[1:2]}.get(source.kind, [])
        if source.kind == "text" and source.overlong_doc == "split":  # every piece of the text is delivered
            text_cols = []
        self._text_columns = [c for c in text_cols if c in self.columns]
        self._text_cap = int(source.max_doc_bytes) + 4  # > max_doc_bytes once cut back to a character boundary
        self._layout = PageParts(np.zeros(0, np.int64), np.zeros(0, np.int64))
        self._base_epoch, self._base_pos = 0, 0
        # a re-partitioned source (mixplane.repartition): pieces of older plans read before the own epochs
        self._prefix: tuple[Piece, ...] = ()
        self._piece = -1  # index of the piece being read; -1: an own epoch
        self._skip_pos: np.ndarray | None = None  # positions of the piece's consumed slots
        self._policies: dict[tuple[int, int], ShufflePolicy] = {(self.partition, self.num_partitions): self.policy}
        self.dry = False
        self._dry_since: float | None = None
        self._last_status = 0.0
        self._set_epoch(0, 0)

    def _new_reader(self, verify_crc: bool) -> SourceReader:
        cache_dir = self.source.read_cache_dir
        disk = None if not cache_dir else (os.path.expanduser(cache_dir), int(self.source.read_cache_gb * (1 << 30)))
        return SourceReader(self.index, filesystem=self.files.filesystem, stats=self.stats, verify_crc=verify_crc,
                            disk_cache=disk)

    # ------------------------------------------------------------------------------------------
    # files and segments

    def _add_files(self, paths: list[str], sizes: list[int], mtimes: list[int]) -> bool:
        """Index new files (in path order) and append them as a segment; True if rows were added."""
        new = [(p, s, m) for p, s, m in zip(paths, sizes, mtimes) if self._known.get(p) != (s, m)]
        new = [t for t in new if t[0] not in self._indexed]  # (a rewritten file is not indexed twice)
        if not new:
            return False
        for p, s, m in new:
            self._known[p] = (s, m)
        u0, c0, r0 = self.index.num_units, self.index.num_chunks, self.index.num_rows
        before = len(self.index.files)

        def on_bad(err: ParquetError) -> None:
            self.quarantine.add(err, pages=getattr(err, "pages_lost", 1), whole_file=True)

        bad_chunks: list[ParquetError] = []
        try:
            build_source_index([t[0] for t in new], self.columns, sizes=[t[1] for t in new],
                               mtimes=[t[2] for t in new], filesystem=self.files.filesystem, stats=self.stats,
                               cache_dir=self._cache_dir, on_bad=on_bad, on_bad_chunk=bad_chunks.append,
                               index=self.index, beside=self.source.index_beside_data,
                               **self._index_options)
        finally:
            self._indexed.update(f.path for f in self.index.files[before:])
        for err in bad_chunks:
            self._quarantine_chunk(err)
        if self.live:
            # a file that failed may still be being written: try it again when it changes
            for p in list(self.index.bad_files):
                self.index.bad_files.pop(p)
        if len(self.index.files) == before or self.index.num_rows == r0:
            return False
        seg = Segment(u0, self.index.num_units, c0, self.index.num_chunks, r0, self.index.num_rows,
                       [f.path for f in self.index.files[before:]])
        self._split_pages(seg)
        self.segments.append(seg)
        return True

    def _quarantine_chunk(self, err: ParquetError) -> None:
        """A column chunk found unreadable while indexing: its row group's primary units (pages, or
        the chunk in rowgroup mode) are marked bad before any read, and counted once, as the pages of
        the first column they hold."""
        idx = self.index
        fi = next(i for i, f in enumerate(idx.files) if f.path == err.file)
        p = idx.primary
        assert p is not None  # a chunk was indexed
        c = int(np.flatnonzero((p["chunk_file"] == fi) & (p["chunk_rg"] == err.row_group))[0])
        u0, u1 = int(p["chunk_first_unit"][c]), int(p["chunk_first_unit"][c + 1])
        self._bad_units.update(self.policy.bad_units_of_chunk(c, u0, u1))
        self.quarantine.add(err, pages=int(p["unit_pages"][u0:u1].sum()))

    def _split_pages(self, seg: Segment) -> None:
        """Parts per page of a new segment (page mode splits pages), from the segment's own files
        only (so a replay that knows more files plans this segment the same way)."""
        idx = self.index
        rows = idx.unit_rows[seg.unit_lo : seg.unit_hi].astype(np.int64)
        reads = self.policy.reads_per_page(idx, seg)
        parts = np.clip(rows // MIN_PART_ROWS, 1, reads)
        seg.page_reads = reads
        units = int(parts.sum())
        seg.rows_per_unit = max(1, int(round(float(rows.sum()) / max(units, 1))))
        self._parts = np.concatenate([self._parts[: seg.unit_lo], parts.astype(np.int8)])

    def seconds_to_rescan(self) -> float:
        """Seconds until the next listing of the source's storage is due (0: due now)."""
        return max(0.0, self.next_rescan_at - time.monotonic())

    def _rescan(self, *, force: bool = False) -> bool:
        """List the storage and add new files as a segment; True if rows were added. At most once per
        ``poll_s`` unless forced (a dry live source would otherwise list on every ``take``)."""
        now = time.monotonic()
        if not force and now < self.next_rescan_at:
            return False
        self.next_rescan_at = now + self.poll_s
        try:
            f = list_source(self.source)
        except SourceFilesError as e:
            log.warning("source %r: cannot list %s: %s", self.name, self.source.uri, e)
            return False
        return self._add_files(list(f.paths), list(f.sizes), list(f.mtimes_ns))

    def _segment(self, epoch: int) -> Segment | None:
        if not self.live:
            return self.segments[0] if self.segments else None
        return self.segments[epoch] if epoch < len(self.segments) else None

    # ------------------------------------------------------------------------------------------
    # epochs

    def _plan(self, epoch: int) -> EpochPlan | None:
        seg = self._segment(epoch)
        if seg is None:
            return None
        return self.policy.plan(self.index, seg, epoch, self._parts, self.buffer_rows)

    def _epoch_rows(self, epoch: int) -> int:
        seg = self._segment(epoch)
        if seg is None:
            return 0
        return self.policy.epoch_rows(self.index, seg, epoch, self._parts)

    def _policy_of(self, partition: int, num_partitions: int) -> ShufflePolicy:
        key = (int(partition), int(num_partitions))
        pol = self._policies.get(key)
        if pol is None:
            pol = self._policies[key] = policy_for(self.mode, OrderKey(self.seed, self.name, *key),
                                                   page_reads=self.page_reads, row_block=self.row_block)
        return pol

    def epoch_rows(self, epoch: int, partition: int, num_partitions: int) -> int:
        """Slots of epoch ``epoch`` of partition ``partition`` of ``num_partitions`` of this source (no data
        read): what :func:`mixplane.repartition.repartition` needs to cut the old partitions' remainders."""
        seg = self._segment(epoch)
        if seg is None:
            return 0
        return self._policy_of(partition, num_partitions).epoch_rows(self.index, seg, epoch, self._parts)

    def _set_piece(self, t: int, start: int, offset: int = 0) -> None:
        """Read prefix piece ``t`` (its first slot at position ``start``) from its slot ``offset`` on."""
        pc = self._prefix[t]
        pol = self._policy_of(pc.partition, pc.num_partitions)
        seg = self._segment(pc.epoch)
        if seg is None:
            raise StreamError(f"source {self.name!r}: piece {pc.to_json()} names an epoch this source does not have")
        inner = pol.plan(self.index, seg, pc.epoch, self._parts, self.buffer_rows)
        if pc.hi > inner.rows:
            raise StreamError(f"source {self.name!r}: piece {pc.to_json()} ends past its plan's {inner.rows} slots "
                              "(the files changed since the re-partition?)")
        self._piece = t
        self._epoch = pc.epoch
        self._epoch_start = start
        self._plan_obj: EpochPlan | None = RangePlan(inner, pc.lo, pc.hi, pc.lo + offset, pol.skip_to)
        self._epoch_len = len(pc)
        self._layout = pol.layout(self.index, inner)
        self._plan_read_ahead()
        self._block = np.zeros(0, np.int64)
        self._block_done: list[int] = []
        self._block_start = start + offset
        self._off = 0
        self._epoch_delivered = 0
        self._skip_pos = (np.asarray(pc.skip, np.int64) - pc.lo + start) if pc.skip else None
        self.cache.new_epoch()

    def _set_epoch(self, epoch: int, start: int) -> None:
        self._piece = -1
        self._skip_pos = None
        self._epoch = epoch
        self._epoch_start = start
        self._plan_obj = self._plan(epoch)
        self._epoch_len = self._plan_obj.rows if self._plan_obj is not None else 0
        self._layout = self.policy.layout(self.index, self._plan_obj)
        self._plan_read_ahead()
        self._block = np.zeros(0, np.int64)
        self._block_done = []
        self._block_start = start
        self._off = 0
        self._epoch_delivered = 0
        self.cache.new_epoch()

    def _plan_read_ahead(self) -> None:
        """Remote sources: hand the reader the epoch's read order (page mode: the pages of its units in
        the order they enter the shuffle buffer; sequential: pages; rowgroup: chunks); row mode plans
        block by block (:meth:`_read_ahead`)."""
        self._ahead_at = -1
        order = getattr(self._plan_obj, "order", None)
        if self.reader.ahead is None or order is None:
            return
        if self.mode == "page":
            self.reader.plan_ahead(np.asarray(self._layout.page(order)))
        elif self.mode in ("sequential", "rowgroup"):
            self.reader.plan_ahead(order, chunks=self.mode == "rowgroup")

    def _read_ahead(self) -> None:
        """Remote sources, once per block: fetch ahead what the next reads need (called from take,
        not from seek, so skipped blocks are never fetched)."""
        plan = self._plan_obj
        if self.reader.ahead is None or plan is None or self._ahead_at == self._block_start:
            return
        self._ahead_at = self._block_start
        if self.mode != "row":
            self.reader.read_ahead(getattr(plan, "frontier", 0))
            return
        # row mode: the pages of this block's rows not yet taken and of the next block's, first need first
        rows = np.concatenate([self._block[self._off :], plan.peek(1)])  # type: ignore[attr-defined]
        pages = np.searchsorted(self.index.unit_row_start, rows, side="right") - 1
        _, first = np.unique(pages, return_index=True)
        cached = getattr(self.cache, "items", {})
        pages = np.array([p for p in pages[np.sort(first)].tolist() if p not in cached], np.int64)
        self.reader.plan_ahead(pages)
        self.reader.read_ahead(0)

    def prefetch(self) -> None:
        """Remote sources: start fetching what the first take needs before it is asked for (a block of a large
        source indexed ahead fetches its first pages while the block before it is read)."""
        self._read_ahead()

    def _next_block(self) -> bool:
        """Advance to the next non-empty block of the current epoch; False at the epoch's end."""
        self.cache.free(self._block_done)
        self._block_start += len(self._block)
        self._off = 0
        nb = self._plan_obj.next_block() if self._plan_obj is not None else None
        if nb is None:
            self._block, self._block_done = np.zeros(0, np.int64), []
            return False
        self._block, self._block_done = nb
        return True

    @property
    def position(self) -> int:
        return self._block_start + self._off

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def epoch_len(self) -> int:
        """Slots of the epoch (or re-partition prefix piece) being read: its positions run from its start to the
        start plus this (a block of a block-read source: its rows)."""
        return self._epoch_len

    def seek(self, position: int) -> None:
        """Continue at slot ``position``, exactly as an unbroken stream would (no data is read)."""
        position = int(position)
        first = self._base_pos - sum(len(p) for p in self._prefix)
        if position < first:
            raise ValueError(f"position {position} is before this stream's start ({first})")
        if position < self._base_pos:  # in the prefix of a re-partitioned source
            start = first
            for t, pc in enumerate(self._prefix):
                if position < start + len(pc):
                    self._set_piece(t, start, position - start)
                    return
                start += len(pc)
        e, start = self._base_epoch, self._base_pos
        while True:
            n = self._epoch_rows(e)
            if self.live and self._segment(e) is None:
                if position > start:
                    raise StreamError(f"source {self.name!r}: position {position} lies beyond the {start} rows "
                                      "known so far (restore the stream's state_dict first)")
                break
            if n == 0:
                if self.live:
                    e += 1
                    continue
                raise StreamError(f"source {self.name!r}: partition {self.partition} of {self.num_partitions} is empty")
            if position < start + n:
                break
            if self.num_partitions == 1 and not self.live:
                k = (position - start) // n
                e, start = e + k, start + k * n
                continue
            e, start = e + 1, start + n
        self._set_epoch(e, start)
        if self._plan_obj is not None:
            self._block_start = start + self.policy.skip_to(self._plan_obj, position - start)
        while self.position + (len(self._block) - self._off) <= position:
            if not self._next_block():
                break
        self._off = position - self._block_start

    # ------------------------------------------------------------------------------------------
    # reading

    def _primary(self, u: int) -> int:
        """The page (row-group chunk in rowgroup mode) a unit belongs to."""
        return u // self._layout.stride

    def _load(self, u: int, ahead: Future | None = None) -> dict[str, pa.Array] | None:
        try:
            d = ahead.result() if ahead is not None else self.policy.load(self.reader, self.index, self._layout, u)
        except ParquetError as e:
            p = self._primary(u)
            # pages of the first column lost: the page (run), or every page of the row-group chunk
            u0, u1 = self.policy.pages_of(self.index, p)
            primary = self.index.primary
            assert primary is not None  # a unit was read
            self.quarantine.add(e, pages=int(primary["unit_pages"][u0:u1].sum()))
            self._bad_units.add(p)
            return None
        for c in self._text_columns:
            # a giant text value is cut here, right after its page is decoded: past this point (cache,
            # arena, take, transform) it costs its bound, not its size. The transform still sees it
            # over max_doc_bytes (a few bytes are kept past it) and cuts or drops and counts it.
            d[c] = bound_texts(d[c], self._text_cap, "prefix")[0]
        return d

    def _get(self, u: int, ahead: Future | None = None) -> dict[str, pa.Array] | None:
        if self._primary(u) in self._bad_units:
            return None
        if ahead is None:
            return self.cache.get(u, self._load)
        return self.cache.get(u, lambda v: self._load(v, ahead))

    def _decode_ahead(self, uniq: np.ndarray) -> dict[int, Future]:
        """With workers: start decoding the units of this gather that are not cached yet on the decode threads
        (pure: a unit's rows depend on the files only); each is then taken in the gather's order, its error
        (a corrupt page) quarantined there, as on one thread. Remote sources and single units: nothing."""
        if self.workers < 2 or self.reader.ahead is not None or len(uniq) < 2:
            return {}
        todo = [u for u in uniq.tolist() if not self.cache.has(u) and self._primary(u) not in self._bad_units]
        if len(todo) < 2:
            return {}
        if self._decoders is None:
            self._decoders = ThreadPoolExecutor(self.workers, thread_name_prefix=f"mixplane-{self.name}-decode")
        load, reader, index, layout = self.policy.load, self.reader, self.index, self._layout
        return {u: self._decoders.submit(load, reader, index, layout, u) for u in todo}

    def _arrival_order(self, uniq: np.ndarray) -> list[int]:
        """Order to load the units of one gather in: remote units whose bytes have arrived first."""
        if self.reader.ahead is None or len(uniq) < 2 or self.mode == "rowgroup":
            return list(range(len(uniq)))
        todo = [i for i, u in enumerate(uniq.tolist()) if not self.cache.has(u)]
        if len(todo) < 2:
            return list(range(len(uniq)))
        pages = np.asarray(self._layout.page(uniq[todo])).tolist()
        first = [todo[j] for j in self.reader.arrival_order(pages)]
        pending = set(todo)
        return first + [i for i in range(len(uniq)) if i not in pending]

    def _gather(self, rows: np.ndarray) -> tuple[np.ndarray, dict[str, list[pa.Array]]]:
        """Data of the given source rows: (mask of rows delivered, per column the pieces that hold
        the delivered rows in order; concatenating them gives the column)."""
        units, local = self._layout.unit_and_local(rows)
        uniq, inv = np.unique(units, return_inverse=True)
        datas: list[dict[str, pa.Array] | None] = [None] * len(uniq)
        ahead = self._decode_ahead(uniq)
        # remote sources: decode the units whose bytes are here first (the order of the rows is kept)
        for i in self._arrival_order(uniq):
            datas[i] = self._get(int(uniq[i]), ahead.get(int(uniq[i])))
        ok_u = np.array([d is not None for d in datas], bool)
        good = ok_u[inv]
        if not good.any():
            return good, {c: [] for c in self.columns}
        self.cache.remap(uniq, inv, local)  # rows of compacted units moved
        gi, gl = inv[good], local[good]
        if len(uniq) == 1:  # a whole block from one unit (sequential, rowgroup): one take
            d = datas[0]
            assert d is not None  # its rows are good
            sel = int64_array(gl)
            return good, {c: [d[c].take(sel)] for c in self.columns}
        # rows from many units (page, row): zero-copy one-row slices, concatenated once per take().
        # Measured on pyarrow 26 (64 rows from 64 units of 5000 strings / 500 token lists): slices
        # 0.04-0.05 ms; a ChunkedArray.take over the units 0.8-2.9 ms (it concatenates every unit);
        # one take per unit plus a reordering take 0.4-0.55 ms. The slice list is the cheapest gather.
        gl = gl.tolist()
        return good, {c: [datas[j][c].slice(r, 1) for j, r in zip(gi.tolist(), gl)] for c in self.columns}

    def take(self, n: int, *, timeout: float | None = None, until: int | None = None) -> RawSamples:
        """The next ``n`` rows (fewer only if a live source stays dry past ``timeout`` seconds, or when the stream
        reaches position ``until``: a block of a large source ends there, quarantined slots included)."""
        n = int(n)
        # between takes no piece of a cached unit is alive, so slabs emptied here are reused at once
        self.cache.before_take(getattr(self._plan_obj, "inner", self._plan_obj), self._layout,
                               self._block[self._off :])
        keys: list[np.ndarray] = []
        poss: list[np.ndarray] = []
        parts: dict[str, list[pa.Array]] = {c: [] for c in self.columns}
        got = 0
        deadline = None if timeout is None else time.monotonic() + timeout
        while got < n and (until is None or self.position < until):
            if self._off >= len(self._block):
                if not self._next_block():
                    if not self._advance_epoch(deadline):
                        break
                    continue
            self._read_ahead()
            want = min(n - got, len(self._block) - self._off)
            if until is not None:
                want = min(want, until - self.position)
            rows = self._block[self._off : self._off + want]
            pos = self.position + np.arange(want, dtype=np.int64)
            keep = None if self._skip_pos is None else ~np.isin(pos, self._skip_pos)
            if keep is None or keep.all():
                good, cols = self._gather(rows)
            else:  # slots consumed before a re-partition stay empty
                kept, cols = self._gather(rows[keep])
                good = np.zeros(want, bool)
                good[np.flatnonzero(keep)[kept]] = True
            self._off += want
            k = int(good.sum())
            if k:
                keys.append(np.asarray(make_key(0 if self.live else self._epoch, rows[good])))
                poss.append(pos[good])
                for c in self.columns:
                    parts[c].extend(cols[c])
                got += k
                self._epoch_delivered += k
        if not keys:
            return RawSamples(np.zeros(0, np.int64), np.zeros(0, np.int64),
                              {c: pa.nulls(0, self._col_type(c)) for c in self.columns})
        # always a copy: the pieces may be views of cached units (slab memory)
        out = RawSamples(np.concatenate(keys), np.concatenate(poss), {c: pa.concat_arrays(v) for c, v in parts.items()})
        del parts, cols
        self.cache.after_take()  # slabs emptied during this take() once its pieces are gone
        return out

    def where_key(self, key: int) -> tuple[str, int] | None:
        """(file path, row within that file) of the row a sample key names (quarantine records name files)."""
        row = int(key_row(key))
        starts = self.index.file_row_start
        if key < 0 or not len(starts) or not 0 <= row < int(starts[-1]):
            return None
        f = int(np.searchsorted(starts, row, side="right")) - 1
        return self.index.files[f].path, row - int(starts[f])

    def _col_type(self, c: str) -> pa.DataType:
        if self.index.col_info is None:
            return pa.null()
        return self.index.col_info[self.columns.index(c)].arrow_type

    def _advance_epoch(self, deadline: float | None) -> bool:
        """Move to the next epoch (segment); for a dry live source wait for new files."""
        if self._piece >= 0:  # the next piece of the prefix, or the first own epoch after it
            nxt_start = self._epoch_start + self._epoch_len
            if self._piece + 1 < len(self._prefix):
                self._set_piece(self._piece + 1, nxt_start)
            else:
                self._set_epoch(self._base_epoch, nxt_start)
            return True
        if self._epoch_len and self._epoch_delivered == 0 and not self.live:
            raise StreamError(f"source {self.name!r}: every page of partition {self.partition} in epoch "
                              f"{self._epoch} is quarantined ({self.quarantine.counts()})")
        nxt = self._epoch + 1 if self._plan_obj is not None else self._epoch
        if not self.live:
            self._set_epoch(nxt, self._epoch_start + self._epoch_len)
            return True
        while self._segment(nxt) is None:
            if self._rescan():  # lists only when due
                break
            now = time.monotonic()
            if not self.dry:
                self.dry, self._dry_since, self._last_status = True, now, 0.0
            if now - self._last_status >= self.status_every_s:
                self._last_status = now
                log.warning("%s", self.status_line())
            if deadline is not None and self.next_rescan_at >= deadline:
                return False  # nothing can change before the deadline: give control back now
            time.sleep(max(0.0, self.next_rescan_at - now))
        self.dry, self._dry_since = False, None
        self._set_epoch(nxt, self._epoch_start + self._epoch_len)
        return True

    # ------------------------------------------------------------------------------------------
    # status, state

    def status(self) -> dict:
        return {"source": self.name, "mode": self.mode, "partition": self.partition,
                "num_partitions": self.num_partitions, "position": self.position, "epoch": self._epoch,
                "prefix_pieces": len(self._prefix), "files": len(self.index.files), "rows": self.index.num_rows, "pages": self.index.num_pages,
                "index_bytes": self.index.nbytes, "index_bytes_per_page": self.index.bytes_per_page,
                "bytes_read": self.stats.bytes_read, "reads": self.stats.reads, "live": self.live, "dry": self.dry,
                "dry_seconds": (time.monotonic() - self._dry_since) if self._dry_since is not None else 0.0,
                "quarantined": self.quarantine.counts(), "buffered_pages": len(self.cache),
                "slab_bytes": self.cache.resident_bytes}

    def status_line(self) -> str:
        s = self.status()
        if s["dry"]:
            return (f"source {self.name!r} is dry: {s['position']} rows delivered from {s['files']} files; waiting "
                    f"{s['dry_seconds']:.0f}s for new files under {self.source.uri}")
        return (f"source {self.name!r}: position {s['position']} epoch {s['epoch']}, {s['files']} files, "
                f"{s['pages']} pages, {s['quarantined']['pages']} quarantined")

    def state_dict(self) -> dict:
        st = {"version": STATE_VERSION, "source": self.name, "mode": self.mode, "seed": self.seed,
              "partition": self.partition, "num_partitions": self.num_partitions, "position": self.position,
              "epoch": self._epoch, "epoch_start": self._epoch_start, "base_epoch": self._base_epoch,
              "base_position": self._base_pos, "fingerprint": self.index.fingerprint(),
              "buffer_rows": self.buffer_rows, "page_reads": self.page_reads, "order": "pages"}
        if self._prefix:
            st["prefix"] = [p.to_json() for p in self._prefix]
        if self.live:
            st["segments"] = [list(s.paths) for s in self.segments]
        return st

    def load_state_dict(self, st: dict) -> None:
        """Resume exactly where ``st`` was taken. A state from another (partition, num_partitions)
        is accepted at an epoch boundary: this partition then starts that epoch at that position."""
        if st.get("version") not in (STATE_VERSION, *OLD_STATE_VERSIONS):
            raise ValueError(f"stream state version {st.get('version')} is not {STATE_VERSION}")
        if st.get("order", "pages") != "pages":
            raise ValueError(f"stream state of source {self.name!r} is in the order of {st.get('order')!r} (a source "
                             "indexed block by block); this stream reads the whole source's page order: "
                             "sources[].lazy_index_files decides which")
        for k, mine in (("source", self.name), ("mode", self.mode), ("seed", self.seed), ("buffer_rows", self.buffer_rows),
                        ("page_reads", self.page_reads)):
            if st.get(k) != mine:
                raise ValueError(f"stream state is for {k}={st.get(k)!r}, this stream has {mine!r}")
        if self.live and "segments" in st:
            self._restore_segments(st["segments"])
        if st.get("fingerprint") != self.index.fingerprint():
            log.warning("source %r: files changed since the state was saved; the order will differ", self.name)
        same = (st["partition"], st["num_partitions"]) == (self.partition, self.num_partitions)
        if same:
            try:
                self._prefix = tuple(Piece.parse(p) for p in st.get("prefix", []))
            except RepartitionError as e:
                raise ValueError(f"stream state: {e}") from None
            self._base_epoch, self._base_pos = int(st["base_epoch"]), int(st["base_position"])
            self.seek(int(st["position"]))
            return
        if st["position"] != st["epoch_start"]:
            raise ValueError("the number of partitions can only change at an epoch boundary "
                             f"(state is {st['position'] - st['epoch_start']} rows into epoch {st['epoch']})")
        self.start_epoch(int(st["epoch"]), int(st["position"]))

    def start_epoch(self, epoch: int, position: int = 0) -> None:
        """Make slot ``position`` the start of ``epoch`` (used when replicas change at an epoch boundary)."""
        self._prefix = ()
        self._base_epoch, self._base_pos = int(epoch), int(position)
        self.seek(int(position))

    def set_layout(self, layout: Layout) -> None:
        """Read ``layout`` (a partition of a re-partitioned source, :mod:`mixplane.repartition`): its prefix
        pieces from position 0, then own epochs from ``layout.epoch``; the stream is at position 0."""
        if (layout.partition, layout.num_partitions) != (self.partition, self.num_partitions):
            raise ValueError(f"source {self.name!r}: layout of partition {layout.partition} of "
                             f"{layout.num_partitions} given to partition {self.partition} of {self.num_partitions}")
        if self.live and layout.prefix:
            raise StreamError(f"source {self.name!r}: a live source cannot be re-partitioned")
        self._prefix = tuple(layout.prefix)
        self._base_epoch, self._base_pos = int(layout.epoch), layout.prefix_rows
        self.seek(0)

    def layout(self) -> Layout:
        """What this stream reads, as a :class:`mixplane.repartition.Layout` (a stream moved to another
        epoch by ``start_epoch`` counts its positions from there; the layout is from position 0)."""
        return Layout(self.partition, self.num_partitions, self._prefix, self._base_epoch)

    @property
    def order(self) -> str:
        """The read order positions count in: ``pages`` (the whole source's page order) or the shuffle mode's name
        (a :class:`~mixplane.loader.blockstream.BlockStream` says ``blocks:<block_files>``)."""
        return "pages" if self.mode == "page" else str(self.mode)

    def listing(self) -> list[list[str]] | None:
        """A live source's file listing as positions count over it: its segments in order (None: static)."""
        return [list(s.paths) for s in self.segments] if self.live else None

    def restore_listing(self, segs: "Sequence[Sequence[str]]") -> None:
        """Count positions over a recorded listing (a planner cursor's): nothing to do when it is a prefix of
        this stream's own; otherwise the index is rebuilt in the recorded segment order and files that
        joined since become the next segment. StreamError when a recorded file is gone."""
        if not self.live:
            return
        want = [list(seg) for seg in segs]
        have = [list(s.paths) for s in self.segments]
        if have[: len(want)] == want:
            return
        log.warning("source %r: the listing changed since the cursor was taken (%d -> %d segments): positions "
                    "follow the recorded listing", self.name, len(want), len(have))
        self._restore_segments(want)

    def _restore_segments(self, segs: list[list[str]]) -> None:
        have = [s.paths for s in self.segments]
        if have == segs[: len(have)] and len(have) <= len(segs):
            if have == segs:
                return
        # rebuild the index in the recorded segment order
        self.index = SourceIndex(self.columns, self.source.kind)
        self._indexed = set()
        self.segments = []
        self._bad_units = set()
        self._known = {}
        self.cache.clear()  # units are numbered by the index being rebuilt
        sizes = dict(zip(self.files.paths, self.files.sizes))
        mt = dict(zip(self.files.paths, self.files.mtimes_ns))
        cur = list_source(self.source)
        sizes.update(zip(cur.paths, cur.sizes))
        mt.update(zip(cur.paths, cur.mtimes_ns))
        for paths in segs:
            missing = [p for p in paths if p not in sizes]
            if missing:
                raise StreamError(f"source {self.name!r}: files of the saved state are gone: {missing[:3]}")
            self._add_files(paths, [sizes[p] for p in paths], [mt[p] for p in paths])
        self._rescan(force=True)
        self.reader.close()
        self.reader = self._new_reader(self.reader.verify_crc)

    def close(self) -> None:
        if self._decoders is not None:
            self._decoders.shutdown(wait=True, cancel_futures=True)  # before the reader's files are closed
            self._decoders = None
        self.reader.close()
        self.cache.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _listing_cache(cache_dir: str | None) -> str | None:
    """The listing cache of a stream's page-index `cache_dir` ("default": the default one; None: none)."""
    return None if cache_dir == "default" else (cache_dir or "")


def open_stream(source: SourceSpec, *, seed: int, partition: int = 0, num_partitions: int = 1, **options):
    """The stream for a source's configured shuffle mode (see :class:`SourceStream` for options): a static page-mode
    source of at least ``sources[].lazy_index_files`` files is read block by block (:mod:`blockstream`)."""
    options.setdefault("buffer_rows", source.shuffle_buffer)
    options.setdefault("workers", resolve_workers(source.workers))
    if source.shuffle_buffer_mb is not None:
        options.setdefault("buffer_bytes", int(source.shuffle_buffer_mb * (1 << 20)))
    if source.shuffle == "page" and not source.live and source.lazy_index_files:
        from mixplane.loader.blocks import lazy_indexing
        from mixplane.loader.blockstream import BlockStream  # (it builds on this module)

        files = options.pop("files", None) or source_listing(source, cache_dir=_listing_cache(options.get("cache_dir", "default")))
        if lazy_indexing(source, len(files.paths)):
            return BlockStream(source, seed=seed, partition=partition, num_partitions=num_partitions, files=files,
                               **options)
        options["files"] = files
    return SourceStream(source, seed=seed, partition=partition, num_partitions=num_partitions, **options)

"""Reading rows of an indexed source by page: positional reads of just the pages that hold them, a
chunk's dictionary page decoded once and kept in a byte-bounded LRU."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import pyarrow as pa

from mixplane.loader import parquet as pr
from mixplane.loader import remote
from mixplane.loader.pageindex import SourceIndex
from mixplane.loader.parquet import (ColumnInfo, CorruptFileError, CorruptPageError, Dictionary, IOStats, ParquetError,
                                     RangeReader)
from mixplane.loader.diskcache import DiskCache
from mixplane.loader.readahead import ReadAhead
from mixplane.loader.remote import RemoteIO
from mixplane.loader.unitcache import ByteLRU
from mixplane.loader.parquet.thrift import ThriftError


DICT_CACHE_MIN = 8 << 20  # decoded-dictionary cache of a reader, at least (bytes)
DICT_CACHE_MAX = 512 << 20  # and at most: a source of huge dictionaries re-reads some instead
DICT_EXPANSION = 4  # decoded bytes per byte of a dictionary page, assumed when sizing the cache


def dict_cache_budget(index: SourceIndex) -> int:
    """Bytes to keep every chunk's decoded dictionary of the source (page mode visits chunks in random
    order, so anything less re-reads dictionary pages), within [DICT_CACHE_MIN, DICT_CACHE_MAX]."""
    pages = sum(int(np.sum(a["chunk_dict_len"], dtype=np.int64)) for a in index.cols.values())
    return int(min(DICT_CACHE_MAX, max(DICT_CACHE_MIN, DICT_EXPANSION * pages)))


class SourceReader:
    """Reads rows of an indexed source by page: positional reads of just the pages that hold them
    (plus a chunk's dictionary page when a dictionary-encoded page of it is read: decoded once and
    kept in an LRU by bytes, by default large enough for every dictionary of the source —
    :func:`dict_cache_budget`, re-sized as a live source grows). ``dict_reads`` counts dictionary
    pages read."""

    def __init__(self, index: SourceIndex, *, filesystem: Any = None, stats: IOStats | None = None, verify_crc: bool = True,
                 dict_cache_bytes: int | None = None, max_open_files: int = 64, io: RemoteIO | None = None,
                 disk_cache: tuple[str, int] | None = None) -> None:
        self.index = index
        self.fs = filesystem
        self.io = io or remote.DEFAULTS
        # remote sources: pages of the read order fetched ahead (plan_ahead), coalesced, cached in memory
        # and, with disk_cache = (directory, max bytes), on local disk
        self.disk = DiskCache(disk_cache[0], disk_cache[1], self._object_id) \
            if disk_cache is not None and remote.is_remote(filesystem) else None
        self.ahead = ReadAhead(self.io, stats if stats is not None else IOStats(), self._reader, self.disk) \
            if remote.is_remote(filesystem) else None
        self._order: np.ndarray | None = None  # read-ahead plan: primary units in the order wanted
        self._chunks = False
        self._scheduled_upto = 0
        self.ahead_misses = 0  # remote reads not served by the read-ahead
        self._pending: dict[int, int] = {}  # page -> planned reads not done (page mode)
        self.split_hits = 0  # parts of split pages taken from a page decoded for an earlier part
        self._split: ByteLRU[int, dict[str, pa.Array]] = ByteLRU(self.io.split_cache_bytes)  # decoded split pages with planned parts to come
        self.stats = stats if stats is not None else IOStats()
        if self.ahead is not None:
            self.ahead.stats = self.stats
        self.verify_crc = verify_crc
        self._auto_dict_budget = dict_cache_bytes is None
        self._dicts: ByteLRU[tuple[str, int], Dictionary] = ByteLRU(dict_cache_budget(index) if dict_cache_bytes is None else int(dict_cache_bytes))
        self.dict_reads = 0
        self._budget_chunks = len(index.primary["chunk_rg"]) if index.primary is not None else 0
        self._readers: OrderedDict[int, RangeReader] = OrderedDict()
        self._max_open = max_open_files
        self._open_lock = threading.Lock()
        self._file_locks: dict[int, threading.Lock] = {}
        # a stream's decode threads (sources[].workers) read local pages and dictionaries concurrently: a local read
        # holds _read_lock (an open file is never closed by the LRU while another thread reads it), the dictionary
        # LRU _dict_lock (a dictionary two threads need at once may be decoded twice, never lost)
        self._read_lock = threading.Lock()
        self._dict_lock = threading.Lock()

    def _object_id(self, file_i: int) -> str:
        f = self.index.files[file_i]
        return f"{remote.object_name(self.fs, f.path)}|{f.size}|{f.mtime_ns}"

    def _reader(self, file_i: int) -> RangeReader:
        """The open reader of file ``file_i`` (read-ahead threads open files too: one open per file,
        others wait for it; an open of another file does not wait)."""
        with self._open_lock:
            r = self._readers.get(file_i)
            if r is not None:
                self._readers.move_to_end(file_i)
                return r
            lock = self._file_locks.setdefault(file_i, threading.Lock())
        with lock:
            with self._open_lock:
                r = self._readers.get(file_i)
            if r is not None:
                return r
            f = self.index.files[file_i]
            r = RangeReader(f.path, self.fs, self.stats, self.io)
            if r.size != f.size:
                r.close()
                raise CorruptFileError(f"file changed since it was indexed ({f.size} -> {r.size} bytes)", file=f.path)
            with self._open_lock:
                self._readers[file_i] = r
                while len(self._readers) > self._max_open:
                    # dropped, not closed: a read-ahead thread may be reading from it right now (close() empties
                    # its held tail and its file under that read: the read returned None, and a page-mode source
                    # of more files than max_open failed at its first take through fsspec). The last reference
                    # going closes it (RangeReader.__del__; CPython frees it when that read returns).
                    self._readers.popitem(last=False)
            return r

    def _dictionary(self, col: ColumnInfo, chunk: int) -> Dictionary | None:
        a = self.index.cols[col.name]
        key = (col.name, chunk)
        with self._dict_lock:
            hit = self._dicts.get(key)
        if hit is not None:
            return hit[0]
        dlen = int(a["chunk_dict_len"][chunk])
        if dlen == 0:
            return None
        buf = self._fetch(int(a["chunk_file"][chunk]), int(a["chunk_dict_off"][chunk]), dlen)
        if self.ahead is not None:  # decoded once and kept: planned reads of its page are void
            self.ahead.release(int(a["chunk_file"][chunk]), int(a["chunk_dict_off"][chunk]), dlen)
        d = pr.read_dictionary(self.index.file_column(int(a["chunk_file"][chunk]), col.name), buf,
                               int(a["chunk_codec"][chunk]), verify_crc=self.verify_crc)
        with self._dict_lock:
            self.dict_reads += 1
            if self._auto_dict_budget and self._budget_chunks != len(a["chunk_rg"]):  # a live source grew
                self._budget_chunks = len(a["chunk_rg"])
                self._dicts.budget = max(self._dicts.budget, dict_cache_budget(self.index))
            self._dicts.put(key, d, d.nbytes)
        return d

    # -- read-ahead (remote sources) --
    def plan_ahead(self, units: np.ndarray, *, chunks: bool = False) -> None:
        """The primary units this reader will be asked for, in the order they become wanted (pages; or
        row-group chunks with ``chunks``), repeats allowed; :meth:`read_ahead` then fetches them ahead.
        Replaces the previous plan (its planned reads are forgotten, what was fetched stays cached)."""
        if self.ahead is None:
            return
        self._order = np.asarray(units, np.int64)
        self._chunks = chunks
        self._scheduled_upto = 0
        self._pending.clear()
        self._split.clear()
        self.ahead.unpin_all()

    def read_ahead(self, frontier: int) -> None:
        """Units [0, frontier) of the plan may be read now (they are in the shuffle buffer, or the
        order has reached them): fetch those not fetched yet and the next ``prefetch_pages`` pages
        (``prefetch_chunks`` chunks), as far as the read-ahead cache has room."""
        if self.ahead is None or self._order is None:
            return
        ahead = self.io.prefetch_chunks if self._chunks else self.io.prefetch_pages
        if ahead <= 0:
            return
        hi = min(len(self._order), int(frontier) + ahead)
        lo = self._scheduled_upto
        if lo >= hi:
            return
        ranges = self._chunk_ranges if self._chunks else self._page_ranges
        units = [ranges(int(u)) for u in self._order[lo:hi]]
        self._scheduled_upto = lo + self.ahead.schedule(units)
        if not self._chunks:  # planned reads per page (the parts of a split page)
            for u in self._order[lo : self._scheduled_upto].tolist():
                self._pending[u] = self._pending.get(u, 0) + 1

    def arrival_order(self, pages: list[int]) -> list[int]:
        """Indices of ``pages`` (primary pages about to be read) in the order their bytes arrive: those
        fetched already first, then by the request they wait for — decoding what is here while the rest
        is still on the wire. Identity order for local sources."""
        if self.ahead is None or len(pages) < 2:
            return list(range(len(pages)))
        rank = [self.ahead.arrival(self._page_ranges(p)) for p in pages]
        return sorted(range(len(pages)), key=rank.__getitem__)

    def _unit_ranges(self, chunk: int, p0: int, p1: int) -> list[tuple[int, int, int]]:
        """(file, offset, size) of every projected column's pages holding the rows of primary pages
        [p0, p1) of ``chunk`` (and of the chunk's dictionary pages not decoded yet): what
        :meth:`read_rows` will read for them."""
        idx = self.index
        p = idx.primary_arrays()
        row0 = int(p["unit_row_start"][p0])
        row1 = int(p["unit_row_start"][p1 - 1]) + int(p["unit_rows"][p1 - 1])
        out = []
        for ci, col in enumerate(idx.col_info or []):
            a = idx.cols[col.name]
            f = int(a["chunk_file"][chunk])
            if ci == 0:
                u0, u1 = p0, p1
            else:
                c0, c1 = int(a["chunk_first_unit"][chunk]), int(a["chunk_first_unit"][chunk + 1])
                starts = a["unit_row_start"][c0:c1]
                u0 = c0 + int(np.searchsorted(starts, row0, side="right")) - 1
                u1 = c0 + int(np.searchsorted(starts, row1, side="left"))
            if u1 <= u0 or not a["unit_len"][u0:u1].all():
                continue
            off = int(a["unit_off"][u0])
            out.append((f, off, int(a["unit_off"][u1 - 1]) + int(a["unit_len"][u1 - 1]) - off))
            dlen = int(a["chunk_dict_len"][chunk])
            if dlen and self._dicts.get((col.name, chunk)) is None:
                out.append((f, int(a["chunk_dict_off"][chunk]), dlen))
        return out

    def _page_ranges(self, page: int) -> list[tuple[int, int, int]]:
        return self._unit_ranges(int(self.index.chunk_of_units([page])[0]), page, page + 1)

    def _chunk_ranges(self, chunk: int) -> list[tuple[int, int, int]]:
        fu = self.index.primary_arrays()["chunk_first_unit"]
        p0, p1 = int(fu[chunk]), int(fu[chunk + 1])
        return self._unit_ranges(chunk, p0, p1) if p1 > p0 else []

    def _fetch(self, file_i: int, offset: int, size: int) -> bytes:
        if self.ahead is not None:
            got = self.ahead.get(file_i, offset, size, timeout=self.io.request_timeout_s * self.io.attempts)
            if got is not None:
                return got
            self.ahead_misses += 1  # read now, waiting a round trip
            data = self._reader(file_i).read_at(offset, size)
            self.ahead.put(file_i, offset, size, data)
            return data
        with self._read_lock:
            return self._reader(file_i).read_at(offset, size)

    def read_units(self, col: ColumnInfo, chunk: int, u0: int, u1: int, select: np.ndarray | None = None) -> pa.Array:
        """Decode units [u0, u1) (global unit numbers of column ``col``, all in ``chunk``); only
        the rows at ``select`` (ascending indices within the units) when given."""
        a = self.index.cols[col.name]
        col = self.index.file_column(int(a["chunk_file"][chunk]), col.name)
        if not a["unit_len"][u0:u1].all():
            raise CorruptPageError("column chunk was quarantined when indexed (corrupt page header)",
                                   **self.index.where(col.name, chunk, u0))
        off = int(a["unit_off"][u0])
        end = int(a["unit_off"][u1 - 1]) + int(a["unit_len"][u1 - 1])
        rows = int(a["unit_rows"][u0:u1].sum())
        codec = int(a["chunk_codec"][chunk])
        try:
            buf = self._fetch(int(a["chunk_file"][chunk]), off, end - off)
            dictionary = (lambda: self._dictionary(col, chunk)) if int(a["chunk_dict_len"][chunk]) else None
            arrs = pr.decode_page_run(col, buf, codec, dictionary, verify_crc=self.verify_crc, expect_rows=rows,
                                      select=select)
            out = arrs[0] if len(arrs) == 1 else pa.concat_arrays(arrs)
            if pa.types.is_string(out.type) or pa.types.is_large_string(out.type):
                out.validate(full=True)  # invalid UTF-8 means corrupt bytes slipped past the checks
            return out
        except ParquetError as e:
            w = self.index.where(col.name, chunk, u0)
            if e.row_group is None or e.page is None:  # add the unit's whereabouts
                raise type(e)(e.detail, **w) from None
            raise
        except (ValueError, ThriftError, pa.ArrowException, IndexError, OverflowError) as e:
            w = self.index.where(col.name, chunk, u0)
            raise CorruptPageError(f"cannot decode ({type(e).__name__}: {e})", **w) from None

    def read_rows(self, chunk: int, row0: int, row1: int, units: tuple[int, int] | None = None,
                  select: np.ndarray | None = None) -> dict[str, pa.Array]:
        """Rows [row0, row1) (source row numbers, all inside ``chunk``) of every projected column;
        with ``select`` (ascending indices into that range) only those rows.

        ``units`` gives the primary column's unit range when the caller knows it (it is decoded
        selecting the rows as it goes); other columns read the pages that cover the row range,
        slice them and take the selected rows.

        Remote page mode: a part of a split page whose other parts the read-ahead plan holds (they
        are in the shuffle buffer or about to be) decodes the whole page once and keeps it until its
        last planned part is read (byte-bounded), instead of decompressing it once per part."""
        if select is not None and units is not None and self._pending and self.io.split_cache_bytes > 0:
            p = units[0]
            left = self._pending.get(p, 0) - 1
            if left >= 0:
                if left:
                    self._pending[p] = left
                else:
                    del self._pending[p]
                hit = self._split.get(p)
                full = hit[0] if hit is not None else None
                self.split_hits += hit is not None
                if full is None and left > 0:
                    full = self._read_rows(chunk, row0, row1, units, None)
                    self._split.put(p, full, sum(a.nbytes for a in full.values()))
                if left == 0 and hit is not None:
                    self._split.pop(p)
                if full is not None:
                    sel = pr.int64_array(select)
                    return {c: a.take(sel) for c, a in full.items()}
        return self._read_rows(chunk, row0, row1, units, select)

    def _read_rows(self, chunk: int, row0: int, row1: int, units: tuple[int, int] | None = None,
                   select: np.ndarray | None = None) -> dict[str, pa.Array]:
        out: dict[str, pa.Array] = {}
        if self.index.col_info is None:
            raise RuntimeError("rows read from a source index that holds no file")
        for ci, col in enumerate(self.index.col_info):
            a = self.index.cols[col.name]
            if ci == 0 and units is not None:
                u0, u1 = units
                lo = int(a["unit_row_start"][u0])
            else:
                c0, c1 = int(a["chunk_first_unit"][chunk]), int(a["chunk_first_unit"][chunk + 1])
                starts = a["unit_row_start"][c0:c1]
                u0 = c0 + int(np.searchsorted(starts, row0, side="right")) - 1
                u1 = c0 + int(np.searchsorted(starts, row1, side="left"))
                lo = int(a["unit_row_start"][u0])
            if ci == 0 and units is not None and select is not None:
                out[col.name] = self.read_units(col, chunk, u0, u1, select)
                continue
            arr = self.read_units(col, chunk, u0, u1)
            arr = arr.slice(row0 - lo, row1 - row0) if (row0 != lo or len(arr) != row1 - row0) else arr
            out[col.name] = arr if select is None else arr.take(pr.int64_array(select))
        return out

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()
        for r in self._readers.values():
            r.close()
        self._readers.clear()
        self._dicts.clear()
        self._split.clear()

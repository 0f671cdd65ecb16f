"""Building a source's page index: each file's footer, then its OffsetIndexes when the writer stored
them, else one scan of the page headers (a small positional read per page); a file's index comes from
its sidecar (:mod:`mixplane.loader.sidecar`) when one matches the file's identity."""

from __future__ import annotations

import io
import logging
import os
import posixpath
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import pyarrow.fs as pafs

from mixplane.loader import parquet as pr
from mixplane.loader import remote, sidecar
from mixplane.loader.pageindex import ColumnPages, FileIndex, SourceIndex
from mixplane.loader.parquet import (
    ColumnInfo, CorruptFileError, CorruptPageError, IOStats, ParquetError, RangeReader,
)
from mixplane.loader.sidecar import (beside_path, default_cache_dir, index_prefix, index_stamp, load_sidecar, save_sidecar,
                                    sidecar_bytes, sidecar_path, stale_indexes)
from mixplane.loader.parquet.thrift import ThriftError, read_struct

log = logging.getLogger(__name__)
_HEADER_PROBE = 256
REMOTE_INDEX_THREADS = 32  # files indexed at once on object storage (index_workers)
LOCAL_INDEX_THREADS = 4  # and on a local filesystem
LOCAL_TAIL_BYTES = 64 << 10  # a local file's last bytes read at once when it is indexed

# a column chunk's unit table: (dictionary page offset, its length (0, 0: none), then lists over the chunk's units:
# byte offset, length, rows, pages)
_Units = tuple[int, int, list[int], list[int], list[int], list[int]]


def _offset_index(reader: RangeReader, chunk: pr.ChunkMeta) -> tuple[list[int], list[int], list[int]] | None:
    """(offsets, compressed sizes incl. header, first row index) of a chunk's data pages, if written: Python lists
    (a few pages per chunk: numpy's per-call cost on arrays of five was a fifth of indexing a file)."""
    if not chunk.offset_index_offset or not chunk.offset_index_length:
        return None
    oi, _ = read_struct(reader.read_at(chunk.offset_index_offset, chunk.offset_index_length))
    locs = oi.get(1, [])
    off, size, first = [p[1] for p in locs], [p[2] for p in locs], [p[3] for p in locs]
    if not all(type(v) is int for v in (*off, *size, *first)):
        raise TypeError("a PageLocation field is not an integer")
    return off, size, first


def _scan_chunk(reader: RangeReader, col: ColumnInfo, chunk: pr.ChunkMeta, rg: int, rg_rows: int) -> _Units:
    """Unit table of one column chunk: OffsetIndex when present, else a header scan. (dictionary offset, its
    length, then lists over the chunk's units: offset, length, rows, pages)."""
    path = reader.path
    start, end = chunk.start, chunk.start + chunk.total_compressed_size
    if start < 4 or end > reader.size - 8:
        raise CorruptFileError(f"column chunk [{start}, {end}) lies outside the file", file=path, row_group=rg, column=col.name)
    dict_off = dict_len = 0
    oi = None
    try:
        oi = _offset_index(reader, chunk)
    except (ThriftError, KeyError, TypeError, IndexError, AttributeError) as e:  # (a PageLocation of another type)
        log.warning("%s: row group %d, column %r: unreadable OffsetIndex (%s); scanning page headers", path, rg, col.name, e)
        oi = None
    if oi is not None and len(oi[0]):
        off, size, first = oi
        n = len(off)
        if (any(off[i + 1] <= off[i] for i in range(n - 1)) or off[0] < start or off[-1] + size[-1] > end
                or any(v <= 0 for v in size) or first[0] != 0 or any(first[i + 1] < first[i] for i in range(n - 1))
                or first[-1] >= max(rg_rows, 1)):
            raise CorruptFileError("OffsetIndex does not match the column chunk", file=path, row_group=rg, column=col.name)
        rows = [first[i + 1] - first[i] for i in range(n - 1)] + [rg_rows - first[-1]]
        if off[0] > start:
            dict_off, dict_len = start, off[0] - start
        return dict_off, dict_len, off, size, rows, [1] * n
    # scan headers: one small positional read per page (plus the level bytes of v1 list pages)
    offs: list[int] = []
    lens: list[int] = []
    rows = []  # (list[int], as in the OffsetIndex branch above)
    pages: list[int] = []
    pos, k = start, 0
    while pos < end:
        probe = min(_HEADER_PROBE, end - pos)
        while True:
            buf = reader.read_at(pos, probe)
            try:
                h = pr.parse_page_header(buf, 0)
                break
            except ThriftError as e:
                if probe >= end - pos or probe >= 1 << 20:
                    err = CorruptPageError(f"corrupt page header at byte {pos}: {e}", file=path, row_group=rg,
                                           column=col.name, page=k)
                    err.scanned_bytes = pos - start  # lets the caller estimate the chunk's pages
                    raise err from None
                probe = min(probe * 8, end - pos)
        total = h.header_len + h.compressed_size
        if pos + total > end:
            raise CorruptPageError(f"page at byte {pos} runs past its column chunk", file=path, row_group=rg, column=col.name, page=k)
        if h.type == pr.DICTIONARY_PAGE:
            if offs:
                raise CorruptPageError("dictionary page after data pages", file=path, row_group=rg, column=col.name, page=k)
            dict_off, dict_len = pos, total
        elif h.type in (pr.DATA_PAGE, pr.DATA_PAGE_V2):
            nrows = h.num_values
            cont = False
            if col.max_rep and (h.type == pr.DATA_PAGE or h.num_rows is None):
                body = reader.read_at(pos + h.header_len, h.compressed_size)
                try:
                    nrows = pr.count_rows_v1(col, h, body, chunk.codec)
                    cont = pr.first_rep_level(col, h, body, chunk.codec) != 0
                except (ValueError, ParquetError) as e:
                    raise CorruptPageError(f"cannot count rows: {e}", file=path, row_group=rg, column=col.name, page=k) from None
            elif h.type == pr.DATA_PAGE_V2:
                if h.num_rows is None:  # (the header parser sets it on every v2 page: a required field)
                    raise CorruptPageError("data page v2 header without num_rows", file=path, row_group=rg,
                                           column=col.name, page=k)
                nrows = h.num_rows
            if cont and offs:  # this page continues the previous row: merge into the previous unit
                lens[-1] += total
                rows[-1] += nrows
                pages[-1] += 1
            else:
                offs.append(pos)
                lens.append(total)
                rows.append(nrows)
                pages.append(1)
            k += 1
        pos += total
    return dict_off, dict_len, offs, lens, rows, pages


def _placeholder(chunk: pr.ChunkMeta, rg_rows: int, err: CorruptPageError) -> _Units:
    """Unit table of a column chunk that could not be scanned: one unit of all its rows and no bytes
    (unit_len 0 marks it; reading it raises). Its pages: those scanned before the bad header plus the
    bad one, or the chunk's bytes over their mean size when larger (an estimate: the rest is unknown)."""
    seen = int(err.page or 0) + 1
    pages = max(seen, int(round(chunk.total_compressed_size / max(getattr(err, "scanned_bytes", 0) / seen, 1)))
                if getattr(err, "scanned_bytes", 0) else seen)
    return 0, 0, [chunk.start], [0], [rg_rows], [min(pages, np.iinfo(np.int16).max)]


def _hold_offset_indexes(reader: RangeReader, meta: pr.FileMeta, cols: list[ColumnInfo], limit: int = 16 << 20) -> None:
    """The OffsetIndexes of the projected columns (written side by side before the footer) in one request (or
    one pread) instead of one per column chunk, when the tail read before does not hold them already."""
    spans = [(ch.offset_index_offset, ch.offset_index_offset + ch.offset_index_length) for rg in meta.row_groups
             for ch in (rg.columns[c.leaf] for c in cols) if ch.offset_index_offset and ch.offset_index_length]
    if spans:
        lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
        if 0 <= lo < hi <= reader.size and hi - lo <= limit:
            reader.hold(lo, hi - lo)


# columns resolved from a schema, by (the footer's schema list bytes, its ARROW:schema value, the projection): the
# files of one corpus share them, so the compiled path resolves a schema once (with the Python path) and then
# reuses it. Values: (leaves in the schema, the ColumnInfos, their leaf numbers, their physical types).
_SchemaKey = tuple[bytes, bytes | None, tuple[str, ...]]
_RESOLVED: dict[_SchemaKey, tuple[int, list[ColumnInfo], np.ndarray, np.ndarray]] = {}
_RESOLVED_MAX = 256


COMPILED_MIN_FILES = 20_000  # files to index for which the compiled parse is compiled if it must be (~12 s, once)
COMPILED_CACHED_MIN_FILES = 10_000  # and for which it is used when numba's cache holds it (~1 s to load)


def use_compiled(files: int) -> bool:
    """Whether indexing `files` files goes through the compiled footer parse (~0.06 instead of ~0.45 CPU ms a
    file): it is compiled once per machine or image (numba's cache; in a pod, its /tmp), which costs more than
    parsing a few thousand footers in Python, and numba in a loader costs 75-105 MB of RSS for its life
    (bench/startup.py), which 5,000 files' ~2 CPU s saved do not buy."""
    if files >= COMPILED_MIN_FILES:
        return True
    if files < COMPILED_CACHED_MIN_FILES:
        return False
    from mixplane.loader import footerloop

    return footerloop.cached()


def _index_compiled(reader: RangeReader, columns: list[str], size: int | None,
                    mtime_ns: int) -> tuple[FileIndex | None, _SchemaKey | None]:
    """The file's index through the compiled footer and OffsetIndex parse (:mod:`footerloop`) when its schema was
    resolved before and every projected chunk is the common case (an OffsetIndex that checks out); else (None,
    the schema's key to remember once the Python path resolved it, or None) and the Python path decides."""
    from mixplane.loader import footerloop as fl  # (numba: imported by a loader that indexes, not by a warm one)

    raw = pr.footer_bytes(reader)
    at = reader.size - 8 - len(raw)
    base, data = reader.held(at, len(raw)) or (at, raw)
    buf = np.frombuffer(data, np.uint8)
    ok, rows = fl.walk(buf, np.array([at - base], np.int64), np.array([at - base + len(raw)], np.int64), fl.FILE)
    if not ok:
        return None, None
    arrow = None
    for kv in rows[rows[:, fl.KIND] == fl.KEY_VALUE]:  # the last ARROW:schema with a value, as _file_meta reads it
        if kv[fl.VALUE_HI] > kv[fl.VALUE_LO] and data[kv[fl.KEY_LO]: kv[fl.KEY_HI]] == b"ARROW:schema":
            arrow = data[kv[fl.VALUE_LO]: kv[fl.VALUE_HI]]
    key: _SchemaKey = (data[rows[0, fl.SCHEMA_LO]: rows[0, fl.SCHEMA_HI]], arrow, tuple(columns))
    got = _RESOLVED.get(key)
    if got is None:
        return None, key
    leaves, cols, leaf_i, phys = got
    res = fl.chunks(rows, leaves, leaf_i, phys, reader.size, buf, base)
    if res[0] == fl.NEED:  # the OffsetIndexes lie before the tail read: read them in one go
        lo, hi = res[1], res[2]
        reader.hold(lo, hi - lo)
        res = fl.chunks(rows, leaves, leaf_i, phys, reader.size, np.frombuffer(reader.read_at(lo, hi - lo), np.uint8), lo)
    ch, units = res[3], res[4]
    if res[0] != fl.OK or ch is None or units is None:
        return None, None
    rg_rows = rows[rows[:, fl.KIND] == fl.ROW_GROUP, fl.RG_ROWS]
    nz = len(ch) // len(cols)
    pages: dict[str, ColumnPages] = {}
    u0 = 0
    for ci, col in enumerate(cols):
        c = ch[ci * nz: (ci + 1) * nz]
        first = np.zeros(nz + 1, np.int64)
        np.cumsum(c[:, fl.C_UNITS], out=first[1:])
        u = units[u0: u0 + int(first[-1])]
        u0 += len(u)
        pages[col.name] = ColumnPages(
            chunk_rg=c[:, fl.C_RG].astype(np.int32), chunk_codec=c[:, fl.C_CODEC].astype(np.int8),
            chunk_dict_off=c[:, fl.C_DICT_OFF].copy(), chunk_dict_len=c[:, fl.C_DICT_LEN].astype(np.int32),
            chunk_first_unit=first, chunk_raw_len=c[:, fl.C_RAW].copy(),
            unit_off=u[:, 0].copy(), unit_len=u[:, 1].astype(np.int32),
            unit_rows=u[:, 2].astype(np.int32), unit_pages=np.ones(len(u), np.int16))
    return FileIndex(path=reader.path, size=reader.size if size is None else size, mtime_ns=mtime_ns,
                     num_rows=int(rows[0, fl.NUM_ROWS]), rg_rows=rg_rows, columns=list(cols), pages=pages), None


def index_file(path: str, columns: list[str], *, filesystem: Any = None, stats: IOStats | None = None,
               size: int | None = None, mtime_ns: int = 0, compiled: bool = False) -> FileIndex:
    """Build the index of one file (raises ParquetError naming what is wrong). `compiled`: through the compiled
    footer parse where it applies (the same index, faster; see :func:`use_compiled`); else the Python path alone,
    the specification."""
    reader = RangeReader(path, filesystem, stats)
    meta = None
    try:
        if not reader.remote:
            # one read of the file's tail (its footer and, mostly, its OffsetIndexes; a small file whole) instead of
            # one per structure: 7 reads a file were 3.5 of 7 CPU seconds indexing 5,000 files from a cold page cache
            tail = min(reader.size, LOCAL_TAIL_BYTES)
            reader.hold(reader.size - tail, tail)
        key = None
        if compiled:
            fi, key = _index_compiled(reader, columns, size, mtime_ns)
            if fi is not None:
                return fi
        meta = pr.read_file_meta(reader)
        if meta.num_rows == 0 or not meta.row_groups:
            raise pr.EmptyFileError("file has no rows", file=path)
        cols = pr.resolve_columns(meta, columns)
        if key is not None:
            if len(_RESOLVED) >= _RESOLVED_MAX:
                _RESOLVED.clear()
            _RESOLVED[key] = (len(meta.leaves), list(cols), np.array([c.leaf for c in cols], np.int64),
                              np.array([c.physical_type for c in cols], np.int64))
        _hold_offset_indexes(reader, meta, cols)
        rg_rows = np.array([rg.num_rows for rg in meta.row_groups], np.int64)
        if rg_rows.sum() != meta.num_rows or np.any(rg_rows < 0):
            raise CorruptFileError(f"row groups hold {int(rg_rows.sum())} rows, footer says {meta.num_rows}", file=path)
        pages: dict[str, ColumnPages] = {}
        bad_chunks: list[ParquetError] = []
        for col in cols:
            rgs, codecs, doffs, dlens, firsts, raws = [], [], [], [], [0], []
            uo, ul, ur, up = [], [], [], []
            for ri, rg in enumerate(meta.row_groups):
                if rg.num_rows == 0:
                    continue
                chunk = rg.columns[col.leaf]
                if chunk.physical_type != col.physical_type:
                    raise CorruptFileError("column chunk type differs from the schema", file=path, row_group=ri, column=col.name)
                if chunk.codec not in (pr.UNCOMPRESSED, pr.SNAPPY, pr.GZIP, pr.BROTLI, pr.ZSTD, pr.LZ4_RAW):
                    raise pr.UnsupportedError(f"codec {pr.CODEC_NAMES[chunk.codec] if 0 <= chunk.codec < 8 else chunk.codec}"
                                              " is not supported", file=path, row_group=ri, column=col.name)
                try:
                    doff, dlen, off, ln, rows, npg = _scan_chunk(reader, col, chunk, ri, rg.num_rows)
                except CorruptPageError as e:  # lose this row group's chunk, not the file
                    bad_chunks.append(e)
                    doff, dlen, off, ln, rows, npg = _placeholder(chunk, rg.num_rows, e)
                if sum(rows) != rg.num_rows:
                    raise CorruptFileError(f"pages hold {sum(rows)} rows, the row group {rg.num_rows}",
                                           file=path, row_group=ri, column=col.name)
                rgs.append(ri)
                codecs.append(chunk.codec)
                doffs.append(doff)
                dlens.append(dlen)
                raws.append(chunk.total_uncompressed_size)
                firsts.append(firsts[-1] + len(off))
                uo += off
                ul += ln
                ur += rows
                up += npg
            cat = lambda xs, dt: np.array(xs, np.int64).astype(dt)  # noqa: E731  (int64 first: wraps as astype did)
            pages[col.name] = ColumnPages(
                chunk_rg=np.array(rgs, np.int32), chunk_codec=np.array(codecs, np.int8),
                chunk_dict_off=np.array(doffs, np.int64), chunk_dict_len=np.array(dlens, np.int32),
                chunk_first_unit=np.array(firsts, np.int64), chunk_raw_len=np.array(raws, np.int64),
                unit_off=cat(uo, np.int64), unit_len=cat(ul, np.int32),
                unit_rows=cat(ur, np.int32), unit_pages=cat(up, np.int16))
        if bad_chunks and {e.row_group for e in bad_chunks} >= {i for i, rg in enumerate(meta.row_groups) if rg.num_rows}:
            raise bad_chunks[0]  # nothing readable left: the file as a whole is bad
        return FileIndex(path=path, size=reader.size if size is None else size, mtime_ns=mtime_ns,
                         num_rows=int(meta.num_rows), rg_rows=rg_rows, columns=cols, pages=pages, bad_chunks=bad_chunks)
    except ParquetError as e:
        if meta is not None and not hasattr(e, "pages_lost"):
            # pages of a whole file lost: the footer does not count pages; each non-empty row group holds at least one
            e.pages_lost = max(1, sum(1 for rg in meta.row_groups if rg.num_rows))
        raise
    finally:
        reader.close()


def load_or_index_file(path: str, columns: list[str], *, size: int, mtime_ns: int, filesystem: Any = None,
                       stats: IOStats | None = None, cache_dir: str | None = None, beside: bool = False,
                       kept: list[tuple[str, bool]] | None = None, write_sidecar: bool = True,
                       compiled: bool = False) -> FileIndex:
    """The file's page index: from the local cache, else (`beside`) from beside the file in its store, else
    scanned from its footer and OffsetIndexes, and then kept where it was missing. `kept` collects what was
    written: (index path, whether it is in the store beside the data). `write_sidecar` False: no sidecar in the
    local cache (the listing's pack will hold the index)."""
    side = sidecar_path(cache_dir, path, size, mtime_ns, columns) if cache_dir else None
    if side and os.path.exists(side):
        fi = load_sidecar(side, path, size, mtime_ns, columns)
        if fi is not None:
            return fi
    near = beside_path(path, size, mtime_ns, columns) if beside else None
    fi = _read_beside(near, path, size, mtime_ns, columns, filesystem) if near else None
    scanned = fi is None
    if fi is None:
        fi = index_file(path, columns, filesystem=filesystem, stats=stats, size=size, mtime_ns=mtime_ns, compiled=compiled)
    if fi.bad_chunks:  # a file with bad chunks is rescanned, so they are reported again
        return fi
    if side and write_sidecar:
        try:
            save_sidecar(fi, side)
            if kept is not None:
                kept.append((side, False))
        except OSError as e:
            log.debug("cannot write page-index sidecar %s: %s", side, e)
    if near and scanned and _write_beside(near, fi, filesystem) and kept is not None:
        kept.append((near, True))
    return fi


def _read_beside(near: str, path: str, size: int, mtime_ns: int, columns: list[str],
                 filesystem: Any) -> FileIndex | None:
    """The index kept beside the data, or None (not there yet, unreadable, another file's): never an error."""
    try:
        if filesystem is None:
            with open(near, "rb") as f:
                data = f.read()
        else:
            with filesystem.open_input_stream(near) as f:  # a HEAD (pyarrow sizes the object), one GET
                data = f.read()
    except (OSError, ValueError, NotImplementedError):
        return None
    return load_sidecar(io.BytesIO(bytes(data)), path, size, mtime_ns, columns)


def _put(filesystem: Any, path: str, data: bytes) -> None:
    with filesystem.open_output_stream(path) as f:
        f.write(data)


def _write_beside(near: str, fi: FileIndex, filesystem: Any) -> bool:
    """Best effort: a store this loader may not write to (read-only credentials, or one that takes no writes at
    all: fsspec's HTTP filesystem raises NotImplementedError) only loses the cache. Whether it was written."""
    try:
        if filesystem is None:
            save_sidecar(fi, near)  # as the local cache: a temporary file renamed over it, removed on failure
        else:
            data = sidecar_bytes(fi)
            try:
                _put(filesystem, near, data)
            except OSError:  # a filesystem with real directories (local) needs the parent first
                filesystem.create_dir(os.path.dirname(near), recursive=True)
                _put(filesystem, near, data)
    except (OSError, ValueError, NotImplementedError) as e:
        log.info("page index of %s not kept beside it (%s): only this loader's local cache has it", fi.path, e)
        return False
    return True


def prune_stale_indexes(kept: list[tuple[str, bool]], current: dict[str, str], filesystem: Any = None) -> int:
    """Remove the indexes of older versions of this source's files (rewritten since) from the directories an index
    was just written to -- the local cache and the `_mixplane_index/` beside the data: without it every rewrite of a
    file left one more .npz behind. One listing per directory, only when something was written; best effort (an
    index that cannot be removed is only disk). How many were removed."""
    removed = 0
    for d, in_store in sorted({(os.path.dirname(p), b) for p, b in kept}):
        remote = in_store and filesystem is not None
        try:
            if remote:
                names = [posixpath.basename(i.path) for i in filesystem.get_file_info(pafs.FileSelector(d))]
            else:
                names = os.listdir(d)
            for name in stale_indexes(names, current):
                if remote:
                    filesystem.delete_file(posixpath.join(d, name))
                else:
                    os.unlink(os.path.join(d, name))
                removed += 1
        except (OSError, ValueError, NotImplementedError) as e:
            log.info("stale page indexes in %s not removed (%s)", d, e)
    if removed:
        log.info("removed %d page index(es) of files rewritten since they were indexed", removed)
    return removed


def index_workers(filesystem: Any, files: int, threads: int | None = None) -> int:
    """Threads that index a source's files at once: the footers, OffsetIndexes and sidecars of many files are read
    concurrently (on object storage each is a request of one round trip; one after another, 100,000 files at 20 ms
    take over half an hour). `threads` (a caller's own, e.g. the profile's one-thread measurement), else
    MIXPLANE_INDEX_THREADS, overrides; a local filesystem gets fewer (the work is mostly parsing, which holds the
    interpreter lock)."""
    env = os.environ.get("MIXPLANE_INDEX_THREADS")
    if threads is not None:
        if int(threads) < 1:
            raise ValueError(f"index threads must be >= 1, not {threads}")
        n = int(threads)
    elif env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"MIXPLANE_INDEX_THREADS must be an integer, not {env!r}") from None
        if n < 1:
            raise ValueError(f"MIXPLANE_INDEX_THREADS must be >= 1, not {n}")
    else:
        n = REMOTE_INDEX_THREADS if remote.is_remote(filesystem) else LOCAL_INDEX_THREADS
    return max(1, min(n, files))


T = TypeVar("T")
R = TypeVar("R")


def _in_order(fn: Callable[[T], R], items: list[T], workers: int) -> Iterator[R]:
    """fn(item) for every item, yielded in the items' order, with at most `workers` calls running and at most
    4 x workers results waiting (the caller consumes them as they come)."""
    if workers <= 1 or len(items) <= 1:
        for it in items:
            yield fn(it)
        return
    ahead = 4 * workers
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mixplane-index") as pool:
        pending: deque[Future[R]] = deque()
        rest = iter(items)
        try:
            for x in rest:
                pending.append(pool.submit(fn, x))
                if len(pending) >= ahead:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:  # an error (or a consumer that stopped): start nothing more
                f.cancel()


def build_source_index(paths: list[str], columns: list[str], *, sizes: Sequence[int] | None = None,
                       mtimes: Sequence[int] | None = None, filesystem: Any = None,
                       stats: IOStats | None = None, cache_dir: str | None = "default",
                       on_bad: Callable[[ParquetError], object] | None = None,
                       on_bad_chunk: Callable[[ParquetError], object] | None = None, index: SourceIndex | None = None,
                       beside: bool = False, use_pack: bool | None = None, use_recent: bool = True,
                       threads: int | None = None) -> SourceIndex:
    """Index files in the given order (append to ``index`` if given). A file that cannot be
    indexed is recorded in ``index.bad_files`` and reported to ``on_bad(error)``; it holds no rows
    (``error.pages_lost``: its pages, where known). A column chunk of an indexed file whose pages
    could not be scanned is reported to ``on_bad_chunk(error)`` (its row group holds a placeholder).
    ``use_pack``: keep the indexes in one pack (None: when the listing has ``PACK_MIN_FILES`` files or more);
    ``use_recent``: record the pack in the listing's recent-list (a block of a large source is not a listing:
    its pack is found by its files alone, and the recent-list keeps only the last few packs).
    ``threads``: how many files are indexed at once (None: `index_workers` decides)."""
    if cache_dir == "default":
        cache_dir = default_cache_dir()
    idx = index if index is not None else SourceIndex(columns)

    def bad(path: str, e: ParquetError) -> None:
        idx.bad_files[path] = e
        if on_bad is not None:
            on_bad(e)

    readable: list[FileIndex] = []
    kept: list[tuple[str, bool]] = []  # indexes written now (list.append: safe from the pool's threads)
    ids: list[tuple[str, int, int]] = []
    for i, path in enumerate(paths):
        size = int(sizes[i]) if sizes is not None else os.path.getsize(path)
        mtime = int(mtimes[i]) if mtimes is not None else os.stat(path).st_mtime_ns
        ids.append((path, size, mtime))

    # a listing of many files keeps its indexes in one pack, not one sidecar per file: writing 50,000 sidecars
    # took longer than parsing the footers (bench/startup.py)
    packing = bool(cache_dir) and (len(ids) >= sidecar.PACK_MIN_FILES if use_pack is None else use_pack and bool(ids))
    pack = recent = None
    if cache_dir and packing:
        pack = sidecar.pack_path(cache_dir, columns, ids)
        recent = sidecar.recent_path(cache_dir, columns, paths) if use_recent else None
    packed = sidecar.load_pack(pack, columns, ids) if pack and os.path.exists(pack) else None
    reused: dict[tuple[str, int, int], FileIndex] = {}
    read_packs: set[str] = set()
    if cache_dir and recent and packed is None:
        # a listing that changed (a file added, removed, rewritten or bad): the unchanged files from the last packs
        for name in sidecar.recent_packs(recent):
            in_pack = sidecar.load_pack_files(os.path.join(cache_dir, name), columns)
            if in_pack:
                read_packs.add(name)
            for k, fi in in_pack.items():
                reused.setdefault(k, fi)
            if all(t in reused for t in ids):
                break

    def one(t: tuple[str, int, int]) -> FileIndex | ParquetError:
        fi = reused.get(t)
        if fi is not None:
            return fi
        try:
            return load_or_index_file(t[0], columns, size=t[1], mtime_ns=t[2], filesystem=filesystem, stats=stats,
                                      cache_dir=cache_dir, beside=beside, kept=kept, write_sidecar=not packing,
                                      compiled=compiled)
        except ParquetError as e:
            return e

    # else every file's index in path order, whatever order the pool finishes them in: the same as one by one
    todo = sum(1 for t in ids if t not in reused) if reused else len(ids)
    compiled = packed is None and use_compiled(todo)
    results: Iterator[FileIndex | ParquetError] = iter(packed) if packed is not None else _in_order(one, ids, index_workers(filesystem, todo, threads))
    for (path, _, _), got in zip(ids, results):
        if isinstance(got, ParquetError):
            bad(path, got)
            continue
        try:
            idx.check_kind(got)
            readable.append(got)
        except ParquetError as e:
            e.pages_lost = got.num_pages()
            bad(path, e)
    idx.choose_schema(readable)  # the majority's types, not whichever file sorts first
    added: list[FileIndex] = []
    for fi in readable:
        try:
            idx.add(fi)
        except ParquetError as e:
            e.pages_lost = fi.num_pages()
            bad(fi.path, e)
            continue
        if not fi.bad_chunks:
            added.append(fi)
        for chunk_err in fi.bad_chunks:
            if on_bad_chunk is not None:
                on_bad_chunk(chunk_err)
    idx.finish()
    if cache_dir and pack and not recent and packed is None and added and len(added) == len(ids):
        try:  # a block's pack: every file of it, or none (a bad file is read and reported again on every start)
            sidecar.save_pack(added, pack)
        except OSError as e:
            log.debug("cannot write the page-index pack %s: %s", pack, e)
    elif cache_dir and pack and recent and packed is None and added:
        # the pack of the good files (a bad file, or one with bad chunks, is read and reported again on every
        # start): under the listing's name when that is every file, else under its own, found through `recent`
        keep = pack if len(added) == len(ids) else sidecar.pack_path(
            cache_dir, columns, [(f.path, f.size, f.mtime_ns) for f in added])
        try:
            if os.path.basename(keep) not in read_packs:
                sidecar.save_pack(added, keep)
            sidecar.remember_pack(recent, keep)
        except OSError as e:
            log.debug("cannot write the page-index pack %s: %s", keep, e)
    elif recent and pack and packed is not None:
        try:
            sidecar.remember_pack(recent, pack)
        except OSError as e:
            log.debug("cannot write %s: %s", recent, e)
    idx.release_pages()  # (after the pack is written: it is made of the files' own arrays)
    if kept:
        current = {index_prefix(p): index_stamp(s, m) for p, s, m in ids}  # every file's version as it is now
        prune_stale_indexes(kept, current, filesystem)
    return idx

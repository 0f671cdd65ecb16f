"""Global page index of a source (YOUMU §5.3) and the reader of indexed units.

For the projected columns of every file: column chunk -> data page byte ranges and row counts,
taken from the file's OffsetIndex when the writer stored one, else from one scan of the page
headers. Each file's index is cached in a small sidecar keyed by file identity (path, size,
mtime), so a restart or a new replica does not rescan.

The unit of shuffling is a *page of the first projected column* (a run of pages when a list row
straddles pages in files without an OffsetIndex). Global unit number -> (file, chunk, page) is one
binary search over the source's chunk-level unit offsets (:meth:`SourceIndex.chunk_of_units`, what
the reader and the stream use): chunks are stored file by file, so the chunk gives the file.
YOUMU's layered search (Algorithm 1: file-level offsets, then the file's chunk offsets) reaches the
same chunk in two steps; :meth:`SourceIndex.locate` returns all three coordinates.
Rows are numbered across the source: files in order (sorted by path), rows in file order.

Memory: the index holds a few numpy arrays, about 24 bytes per page of each projected column
plus ~40 bytes per column chunk (:attr:`SourceIndex.bytes_per_page`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from mixplane.loader import pagereader as pr
from mixplane.loader.pagereader import (
    ColumnInfo, CorruptFileError, CorruptPageError, IOStats, ParquetError, RangeReader, SchemaMismatchError,
)
from mixplane.loader.thrift import ThriftError

log = logging.getLogger(__name__)
INDEX_VERSION = 3
_HEADER_PROBE = 256


def default_cache_dir() -> str | None:
    d = os.environ.get("MIXPLANE_INDEX_CACHE")
    if d is not None:
        return d or None  # empty string disables the sidecar cache
    return os.path.join(os.path.expanduser("~"), ".cache", "mixplane", "pageindex")


# ----------------------------------------------------------------------------------------------
# one file


@dataclass
class ColumnPages:
    """Pages of one column in one file (arrays over chunks and over units)."""

    chunk_rg: np.ndarray  # int32 row group of each chunk
    chunk_codec: np.ndarray  # int8
    chunk_dict_off: np.ndarray  # int64 (0 = none)
    chunk_dict_len: np.ndarray  # int32
    chunk_first_unit: np.ndarray  # int64, len = chunks + 1
    chunk_raw_len: np.ndarray  # int64 bytes of the chunk's pages uncompressed (footer's total_uncompressed_size)
    unit_off: np.ndarray  # int64 byte offset of the unit's first page header
    unit_len: np.ndarray  # int32 bytes of the unit (headers included)
    unit_rows: np.ndarray  # int32 rows in the unit
    unit_pages: np.ndarray  # int16 pages in the unit (1 unless a row straddles pages)

    FIELDS = ("chunk_rg", "chunk_codec", "chunk_dict_off", "chunk_dict_len", "chunk_first_unit", "chunk_raw_len",
              "unit_off", "unit_len", "unit_rows", "unit_pages")


@dataclass
class FileIndex:
    path: str
    size: int
    mtime_ns: int
    num_rows: int
    rg_rows: np.ndarray  # int64
    columns: list[ColumnInfo]
    pages: dict[str, ColumnPages]
    # column chunks whose page headers could not be scanned: each holds one placeholder unit (unit_len 0)
    # covering its row group, so the file's other row groups stay readable (never saved in a sidecar)
    bad_chunks: list[ParquetError] = field(default_factory=list)

    def num_pages(self) -> int:
        """Data pages of the first projected column (what a lost file costs the quarantine count)."""
        return int(self.pages[self.columns[0].name].unit_pages.sum()) if self.columns else 0


def _scan_chunk(reader: RangeReader, col: ColumnInfo, chunk: pr.ChunkMeta, rg: int, rg_rows: int):
    """Unit table of one column chunk: OffsetIndex when present, else a header scan."""
    path = reader.path
    start, end = chunk.start, chunk.start + chunk.total_compressed_size
    if start < 4 or end > reader.size - 8:
        raise CorruptFileError(f"column chunk [{start}, {end}) lies outside the file", file=path, row_group=rg, column=col.name)
    dict_off = dict_len = 0
    oi = None
    try:
        oi = pr.read_offset_index(reader, chunk)
    except (ThriftError, KeyError, TypeError) as e:
        log.warning("%s: row group %d, column %r: unreadable OffsetIndex (%s); scanning page headers", path, rg, col.name, e)
        oi = None
    if oi is not None and len(oi[0]):
        off, size, first = oi
        if (np.any(np.diff(off) <= 0) or off[0] < start or off[-1] + size[-1] > end or np.any(size <= 0)
                or first[0] != 0 or np.any(np.diff(first) < 0) or first[-1] >= max(rg_rows, 1)):
            raise CorruptFileError("OffsetIndex does not match the column chunk", file=path, row_group=rg, column=col.name)
        rows = np.diff(np.append(first, rg_rows))
        if off[0] > start:
            dict_off, dict_len = start, int(off[0] - start)
        return dict_off, dict_len, off.astype(np.int64), size.astype(np.int64), rows.astype(np.int64), np.ones(len(off), np.int64)
    # scan headers: one small positional read per page (plus the level bytes of v1 list pages)
    offs, lens, rows, pages = [], [], [], []
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
    return (dict_off, dict_len, np.array(offs, np.int64), np.array(lens, np.int64), np.array(rows, np.int64),
            np.array(pages, np.int64))


def _placeholder(chunk: pr.ChunkMeta, rg_rows: int, err: CorruptPageError):
    """Unit table of a column chunk that could not be scanned: one unit of all its rows and no bytes
    (unit_len 0 marks it; reading it raises). Its pages: those scanned before the bad header plus the
    bad one, or the chunk's bytes over their mean size when larger (an estimate: the rest is unknown)."""
    seen = int(err.page or 0) + 1
    pages = max(seen, int(round(chunk.total_compressed_size / max(getattr(err, "scanned_bytes", 0) / seen, 1)))
                if getattr(err, "scanned_bytes", 0) else seen)
    one = lambda v: np.array([v], np.int64)  # noqa: E731
    return 0, 0, one(chunk.start), one(0), one(rg_rows), one(min(pages, np.iinfo(np.int16).max))


def index_file(path: str, columns: list[str], *, filesystem=None, stats: IOStats | None = None,
               size: int | None = None, mtime_ns: int = 0) -> FileIndex:
    """Build the index of one file (raises ParquetError naming what is wrong)."""
    reader = RangeReader(path, filesystem, stats)
    meta = None
    try:
        meta = pr.read_file_meta(reader)
        if meta.num_rows == 0 or not meta.row_groups:
            raise pr.EmptyFileError("file has no rows", file=path)
        cols = pr.resolve_columns(meta, columns)
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
                if rows.sum() != rg.num_rows:
                    raise CorruptFileError(f"pages hold {int(rows.sum())} rows, the row group {rg.num_rows}",
                                           file=path, row_group=ri, column=col.name)
                rgs.append(ri)
                codecs.append(chunk.codec)
                doffs.append(doff)
                dlens.append(dlen)
                raws.append(chunk.total_uncompressed_size)
                firsts.append(firsts[-1] + len(off))
                uo.append(off), ul.append(ln), ur.append(rows), up.append(npg)
            cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
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


# ---- sidecar cache ----

def _sidecar_path(cache_dir: str, path: str, size: int, mtime_ns: int, columns: list[str]) -> str:
    key = f"v{INDEX_VERSION}|{path}|{size}|{mtime_ns}|{','.join(columns)}"
    h = hashlib.sha256(key.encode()).hexdigest()[:32]
    return os.path.join(cache_dir, f"{os.path.basename(path)[:60]}.{h}.npz")


def _save_sidecar(fi: FileIndex, file: str) -> None:
    arrays: dict[str, np.ndarray] = {"rg_rows": fi.rg_rows}
    meta = {"version": INDEX_VERSION, "path": fi.path, "size": fi.size, "mtime_ns": fi.mtime_ns, "num_rows": fi.num_rows,
            "columns": [{"name": c.name, "leaf": c.leaf, "physical_type": c.physical_type, "type_length": c.type_length,
                         "max_def": c.max_def, "max_rep": c.max_rep, "list_def": c.list_def, "item_def": c.item_def,
                         "leaf_schema": c.leaf_schema.hex(), "struct_depth": c.struct_depth}
                        for c in fi.columns]}
    schema = pa.schema([pa.field(f"v{i}", c.value_type) for i, c in enumerate(fi.columns)]
                       + [pa.field(f"a{i}", c.arrow_type) for i, c in enumerate(fi.columns)])
    arrays["schema"] = np.frombuffer(schema.serialize().to_pybytes(), np.uint8)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    for i, c in enumerate(fi.columns):
        cp = fi.pages[c.name]
        for f in ColumnPages.FIELDS:
            arrays[f"{i}.{f}"] = getattr(cp, f)
    os.makedirs(os.path.dirname(file), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(file), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, file)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _load_sidecar(file: str, path: str, size: int, mtime_ns: int, columns: list[str]) -> FileIndex | None:
    try:
        with np.load(file, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            if (meta["version"] != INDEX_VERSION or meta["path"] != path or meta["size"] != size
                    or meta["mtime_ns"] != mtime_ns or [c["name"] for c in meta["columns"]] != list(columns)):
                return None
            schema = pa.ipc.read_schema(pa.py_buffer(bytes(z["schema"])))
            cols, pages = [], {}
            for i, c in enumerate(meta["columns"]):
                c = dict(c, leaf_schema=bytes.fromhex(c["leaf_schema"]))
                cols.append(ColumnInfo(value_type=schema.field(f"v{i}").type, arrow_type=schema.field(f"a{i}").type, **c))
                pages[c["name"]] = ColumnPages(**{f: z[f"{i}.{f}"] for f in ColumnPages.FIELDS})
            return FileIndex(path=path, size=size, mtime_ns=mtime_ns, num_rows=meta["num_rows"], rg_rows=z["rg_rows"],
                             columns=cols, pages=pages)
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError, pa.ArrowException, zlib.error):
        return None
    except Exception:  # a damaged sidecar is never fatal: rebuild it
        return None


def load_or_index_file(path: str, columns: list[str], *, size: int, mtime_ns: int, filesystem=None,
                       stats: IOStats | None = None, cache_dir: str | None = None) -> FileIndex:
    side = _sidecar_path(cache_dir, path, size, mtime_ns, columns) if cache_dir else None
    if side and os.path.exists(side):
        fi = _load_sidecar(side, path, size, mtime_ns, columns)
        if fi is not None:
            return fi
    fi = index_file(path, columns, filesystem=filesystem, stats=stats, size=size, mtime_ns=mtime_ns)
    if side and not fi.bad_chunks:  # a file with bad chunks is rescanned, so they are reported again
        try:
            _save_sidecar(fi, side)
        except OSError as e:
            log.debug("cannot write page-index sidecar %s: %s", side, e)
    return fi


def _signature(cols: list[ColumnInfo]) -> list[str]:
    """What a file delivers, for the majority vote on the source's types."""
    return [str(c.arrow_type) for c in cols]


def reference_signature(sigs: list) -> object:
    """The most common signature; ties go to the earliest."""
    counts: dict = {}
    for sg in sigs:
        counts[repr(sg)] = counts.get(repr(sg), 0) + 1
    best = max(counts.values())
    return next(sg for sg in sigs if counts[repr(sg)] == best)


_STRINGS = (pa.types.is_string, pa.types.is_large_string)
_BINARIES = (pa.types.is_binary, pa.types.is_large_binary)
_LISTS = (pa.types.is_list, pa.types.is_large_list)


def unifiable(have: pa.DataType, want: pa.DataType) -> bool:
    """Whether a file's column of type ``have`` can be delivered as the source's ``want``: the same
    values in another physical width or offset size (string / large_string, binary / large_binary,
    int32 / int64, list / large_list of such; list field names and nullability aside), as different
    writers store one dataset."""
    if have == want:
        return True
    for family in (_STRINGS, _BINARIES, _LISTS):
        if any(f(have) for f in family) and any(f(want) for f in family):
            return family is not _LISTS or unifiable(have.value_type, want.value_type)
    if pa.types.is_integer(have) and pa.types.is_integer(want):
        return pa.types.is_signed_integer(have) == pa.types.is_signed_integer(want)
    if pa.types.is_floating(have) and pa.types.is_floating(want):
        return have.bit_width <= want.bit_width
    if pa.types.is_struct(have) and pa.types.is_struct(want):
        return [f.name for f in have] == [f.name for f in want] and all(
            unifiable(a.type, b.type) for a, b in zip(have, want))
    return False


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)


def kind_accepts(kind: str, position: int, t: pa.DataType) -> str | None:
    """None if a source of ``kind`` can read type ``t`` at projected column ``position``, else what it reads.
    text: string/binary; tokens: list<integer> or binary; image_text: [binary image (or a struct with
    a ``bytes`` field), text caption]. Extra projected columns may have any type."""
    if kind == "text" and position == 0 and not _is_text(t):
        return "string, large_string or binary"
    if kind == "tokens" and position == 0:
        binary = pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t)
        ints = (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)
        if not (binary or ints):
            return "list<integer> or binary token ids"
    if kind == "image_text" and position == 0:
        struct_bytes = pa.types.is_struct(t) and t.get_field_index("bytes") >= 0
        if not (pa.types.is_binary(t) or pa.types.is_large_binary(t) or struct_bytes):
            return "binary image bytes (or a struct with a 'bytes' field)"
    if kind == "image_text" and position == 1 and not _is_text(t):
        return "string, large_string or binary captions"
    return None


# ----------------------------------------------------------------------------------------------
# the source


class SourceIndex:
    """Concatenated file indexes of a source with the global numbering of rows and units.

    Units are pages (runs) of the first column; ``unit_row_start[u]`` is the source row of unit
    u's first row. Files listed here are the readable ones; files that failed are in ``bad_files``
    (they hold no rows)."""

    def __init__(self, columns: list[str], kind: str | None = None):
        self.columns = list(columns)
        self.kind = kind  # the source kind whose transform reads these columns (None: any type)
        self.files: list[FileIndex] = []
        self.bad_files: dict[str, ParquetError] = {}
        self.col_info: list[ColumnInfo] | None = None
        self._file_cols: dict[tuple[int, str], ColumnInfo] = {}
        self._rebuild()

    # -- building --
    def check_kind(self, fi: FileIndex) -> None:
        """Raise SchemaMismatchError if the source's kind cannot read a projected column of ``fi``."""
        if self.kind is None:
            return
        for c in fi.columns:
            want = kind_accepts(self.kind, self.columns.index(c.name), c.arrow_type)
            if want is not None:
                raise SchemaMismatchError(f"column {c.name!r} is {c.arrow_type}; kind {self.kind} reads {want}", file=fi.path)

    def choose_schema(self, candidates: list[FileIndex]) -> None:
        """Set the source's column types, if not yet set, to the most common among ``candidates``
        (ties: the first in path order), so one odd file cannot make every other file a mismatch."""
        if self.col_info is None and candidates:
            sigs = [_signature(fi.columns) for fi in candidates]
            ref = reference_signature(sigs)
            self.col_info = candidates[sigs.index(ref)].columns

    def add(self, fi: FileIndex) -> None:
        """Append one file (rows and units continue after the existing ones); the first file sets the
        column types unless :meth:`choose_schema` did."""
        self.check_kind(fi)
        if self.col_info is None:
            self.col_info = fi.columns
        elif not all(unifiable(h.arrow_type, w.arrow_type) for h, w in zip(fi.columns, self.col_info)):
            want = ", ".join(f"{c.name}: {c.arrow_type}" for c in self.col_info)
            have = ", ".join(f"{c.name}: {c.arrow_type}" for c in fi.columns)
            raise SchemaMismatchError(f"column types ({have}) differ from the source's ({want})", file=fi.path)
        self.files.append(fi)

    def file_column(self, file_i: int, name: str) -> ColumnInfo:
        """How to decode column ``name`` of file ``file_i``: the file's own layout (physical type,
        levels), delivered as the source's type (a file of large_string or int64 token ids among
        files of string / int32 is cast on read, not refused)."""
        key = (file_i, name)
        c = self._file_cols.get(key)
        if c is None:
            own = next(x for x in self.files[file_i].columns if x.name == name)
            want = self.col_info[self.columns.index(name)].arrow_type if self.col_info else own.arrow_type
            c = own if own.arrow_type == want else dataclasses.replace(own, arrow_type=want)
            self._file_cols[key] = c
        return c

    def finish(self) -> None:
        self._rebuild()

    def decoded_bytes_per_row(self) -> float:
        """Mean uncompressed bytes of a row's projected columns (from the footers, nothing read)."""
        if not self.num_rows:
            return 0.0
        total = sum(int(np.sum(self.cols[c]["chunk_raw_len"])) for c in self.columns if c in self.cols)
        return total / self.num_rows

    def _rebuild(self) -> None:
        F = len(self.files)
        self.file_row_start = np.zeros(F + 1, np.int64)
        for i, f in enumerate(self.files):
            self.file_row_start[i + 1] = self.file_row_start[i] + f.num_rows
        self.num_rows = int(self.file_row_start[-1])
        self.cols: dict[str, dict[str, np.ndarray]] = {}
        for c in self.columns:
            parts: dict[str, list] = {k: [] for k in ("chunk_file", "chunk_rg", "chunk_codec", "chunk_dict_off",
                                                      "chunk_dict_len", "chunk_raw_len", "chunk_row_start", "chunk_rows", "unit_off",
                                                      "unit_len", "unit_rows", "unit_pages", "chunk_nunits")}
            file_units = [0]
            for fi_i, f in enumerate(self.files):
                cp = f.pages[c]
                rg_start = np.concatenate([[0], np.cumsum(f.rg_rows)])[:-1]
                parts["chunk_file"].append(np.full(len(cp.chunk_rg), fi_i, np.int32))
                parts["chunk_rg"].append(cp.chunk_rg)
                parts["chunk_codec"].append(cp.chunk_codec)
                parts["chunk_dict_off"].append(cp.chunk_dict_off)
                parts["chunk_dict_len"].append(cp.chunk_dict_len)
                parts["chunk_raw_len"].append(cp.chunk_raw_len)
                parts["chunk_row_start"].append(self.file_row_start[fi_i] + rg_start[cp.chunk_rg])
                parts["chunk_rows"].append(f.rg_rows[cp.chunk_rg])
                parts["chunk_nunits"].append(np.diff(cp.chunk_first_unit))
                for k in ("unit_off", "unit_len", "unit_rows", "unit_pages"):
                    parts[k].append(getattr(cp, k))
                file_units.append(file_units[-1] + len(cp.unit_off))
            dts = {"chunk_file": np.int32, "chunk_rg": np.int32, "chunk_codec": np.int8, "chunk_dict_off": np.int64,
                   "chunk_dict_len": np.int32, "chunk_raw_len": np.int64, "chunk_row_start": np.int64, "chunk_rows": np.int64, "unit_off": np.int64,
                   "unit_len": np.int32, "unit_rows": np.int32, "unit_pages": np.int16, "chunk_nunits": np.int64}
            a = {k: (np.concatenate(v).astype(dts[k]) if v else np.zeros(0, dts[k])) for k, v in parts.items()}
            a["chunk_first_unit"] = np.concatenate([[0], np.cumsum(a.pop("chunk_nunits"))]).astype(np.int64)
            a["file_first_unit"] = np.array(file_units, np.int64)
            nun = len(a["unit_off"])
            # the source row of each unit's first row: chunk row start + rows of earlier units in the chunk
            chunk_of_unit = np.repeat(np.arange(len(a["chunk_rg"])), np.diff(a["chunk_first_unit"]))
            cum = np.concatenate([[0], np.cumsum(a["unit_rows"].astype(np.int64))])
            a["unit_row_start"] = (a["chunk_row_start"][chunk_of_unit] + cum[:-1]
                                   - cum[a["chunk_first_unit"][chunk_of_unit]]) if nun else np.zeros(0, np.int64)
            self.cols[c] = a
        p = self.cols[self.columns[0]] if self.columns else None
        self.primary = p
        self.num_units = len(p["unit_off"]) if p is not None else 0

    # -- views of the primary column --
    @property
    def unit_rows(self) -> np.ndarray:
        return self.primary["unit_rows"]

    @property
    def unit_row_start(self) -> np.ndarray:
        return self.primary["unit_row_start"]

    @property
    def num_chunks(self) -> int:
        return len(self.primary["chunk_rg"])

    @property
    def chunk_row_start(self) -> np.ndarray:
        return self.primary["chunk_row_start"]

    @property
    def chunk_rows(self) -> np.ndarray:
        return self.primary["chunk_rows"]

    def locate(self, units) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Global unit -> (file, chunk, unit within chunk), vectorised over ``units``: the chunk by
        :meth:`chunk_of_units` (what the reader uses), the file from the chunk table."""
        u = np.asarray(units, dtype=np.int64)
        if len(u) and (u.min() < 0 or u.max() >= self.num_units):
            raise IndexError(f"unit out of range [0, {self.num_units})")
        p = self.primary
        c = self.chunk_of_units(u)
        return p["chunk_file"][c].astype(np.int64), c, u - p["chunk_first_unit"][c]

    def unit_of_rows(self, rows) -> np.ndarray:
        return np.searchsorted(self.unit_row_start, np.asarray(rows, np.int64), side="right") - 1

    def chunk_of_units(self, units) -> np.ndarray:
        return np.searchsorted(self.primary["chunk_first_unit"], np.asarray(units, np.int64), side="right") - 1

    # -- accounting --
    @property
    def nbytes(self) -> int:
        n = self.file_row_start.nbytes
        for a in self.cols.values():
            n += sum(v.nbytes for v in a.values())
        return n

    @property
    def num_pages(self) -> int:
        return int(self.primary["unit_pages"].sum()) if self.num_units else 0

    @property
    def bytes_per_page(self) -> float:
        """Index memory per data page of the first column (all projected columns included)."""
        return self.nbytes / max(self.num_pages, 1)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for f in self.files:
            h.update(f"{f.path}|{f.size}|{f.mtime_ns}|{f.num_rows}\n".encode())
        return h.hexdigest()[:16]

    def where(self, col: str, chunk: int, unit: int | None = None) -> dict:
        a = self.cols[col]
        f = self.files[int(a["chunk_file"][chunk])]
        d = {"file": f.path, "row_group": int(a["chunk_rg"][chunk]), "column": col}
        if unit is not None:
            d["page"] = int(unit - a["chunk_first_unit"][chunk])
        return d


def build_source_index(paths: list[str], columns: list[str], *, sizes=None, mtimes=None, filesystem=None,
                       stats: IOStats | None = None, cache_dir: str | None = "default",
                       on_bad=None, on_bad_chunk=None, index: SourceIndex | None = None) -> SourceIndex:
    """Index files in the given order (append to ``index`` if given). A file that cannot be
    indexed is recorded in ``index.bad_files`` and reported to ``on_bad(error)``; it holds no rows
    (``error.pages_lost``: its pages, where known). A column chunk of an indexed file whose pages
    could not be scanned is reported to ``on_bad_chunk(error)`` (its row group holds a placeholder)."""
    if cache_dir == "default":
        cache_dir = default_cache_dir()
    idx = index if index is not None else SourceIndex(columns)

    def bad(path: str, e: ParquetError) -> None:
        idx.bad_files[path] = e
        if on_bad is not None:
            on_bad(e)

    readable: list[FileIndex] = []
    for i, path in enumerate(paths):
        size = int(sizes[i]) if sizes is not None else os.path.getsize(path)
        mtime = int(mtimes[i]) if mtimes is not None else os.stat(path).st_mtime_ns
        try:
            fi = load_or_index_file(path, columns, size=size, mtime_ns=mtime, filesystem=filesystem, stats=stats,
                                    cache_dir=cache_dir)
            readable.append(fi)
            idx.check_kind(fi)
        except ParquetError as e:
            if readable and readable[-1].path == path:
                e.pages_lost = readable.pop().num_pages()
            bad(path, e)
    idx.choose_schema(readable)  # the majority's types, not whichever file sorts first
    for fi in readable:
        try:
            idx.add(fi)
        except ParquetError as e:
            e.pages_lost = fi.num_pages()
            bad(fi.path, e)
            continue
        for e in fi.bad_chunks:
            if on_bad_chunk is not None:
                on_bad_chunk(e)
    idx.finish()
    return idx


# ----------------------------------------------------------------------------------------------
# reading indexed rows


class _LRU:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.items: OrderedDict = OrderedDict()
        self.nbytes = 0

    def get(self, key):
        v = self.items.get(key)
        if v is not None:
            self.items.move_to_end(key)
        return v

    def put(self, key, value, nbytes: int) -> None:
        old = self.items.pop(key, None)
        if old is not None:
            self.nbytes -= old[1]
        self.items[key] = (value, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.budget and len(self.items) > 1:
            _, (_, nb) = self.items.popitem(last=False)
            self.nbytes -= nb

    def clear(self) -> None:
        self.items.clear()
        self.nbytes = 0


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

    def __init__(self, index: SourceIndex, *, filesystem=None, stats: IOStats | None = None, verify_crc: bool = True,
                 dict_cache_bytes: int | None = None, max_open_files: int = 64):
        self.index = index
        self.fs = filesystem
        self.stats = stats if stats is not None else IOStats()
        self.verify_crc = verify_crc
        self._auto_dict_budget = dict_cache_bytes is None
        self._dicts = _LRU(dict_cache_budget(index) if dict_cache_bytes is None else int(dict_cache_bytes))
        self.dict_reads = 0
        self._budget_chunks = len(index.primary["chunk_rg"]) if index.primary is not None else 0
        self._readers: OrderedDict[int, RangeReader] = OrderedDict()
        self._max_open = max_open_files

    def _reader(self, file_i: int) -> RangeReader:
        r = self._readers.get(file_i)
        if r is None:
            f = self.index.files[file_i]
            r = RangeReader(f.path, self.fs, self.stats)
            if r.size != f.size:
                r.close()
                raise CorruptFileError(f"file changed since it was indexed ({f.size} -> {r.size} bytes)", file=f.path)
            self._readers[file_i] = r
            while len(self._readers) > self._max_open:
                _, old = self._readers.popitem(last=False)
                old.close()
        else:
            self._readers.move_to_end(file_i)
        return r

    def _dictionary(self, col: ColumnInfo, chunk: int):
        a = self.index.cols[col.name]
        key = (col.name, chunk)
        hit = self._dicts.get(key)
        if hit is not None:
            return hit[0]
        dlen = int(a["chunk_dict_len"][chunk])
        if dlen == 0:
            return None
        buf = self._reader(int(a["chunk_file"][chunk])).read_at(int(a["chunk_dict_off"][chunk]), dlen)
        self.dict_reads += 1
        d = pr.read_dictionary(self.index.file_column(int(a["chunk_file"][chunk]), col.name), buf,
                               int(a["chunk_codec"][chunk]), verify_crc=self.verify_crc)
        if self._auto_dict_budget and self._budget_chunks != len(a["chunk_rg"]):  # a live source grew
            self._budget_chunks = len(a["chunk_rg"])
            self._dicts.budget = max(self._dicts.budget, dict_cache_budget(self.index))
        self._dicts.put(key, d, d.nbytes)
        return d

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
            buf = self._reader(int(a["chunk_file"][chunk])).read_at(off, end - off)
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
        slice them and take the selected rows."""
        out: dict[str, pa.Array] = {}
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
        for r in self._readers.values():
            r.close()
        self._readers.clear()
        self._dicts.clear()

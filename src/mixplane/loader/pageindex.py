"""Global page index of a source (YOUMU §5.3): pure data, no I/O.

For the projected columns of every file: column chunk -> data page byte ranges and row counts
(:class:`FileIndex`, built by :mod:`mixplane.loader.indexscan` from footers, OffsetIndexes or a header
scan, cached by :mod:`mixplane.loader.sidecar`), concatenated per source into :class:`SourceIndex`
(read by :mod:`mixplane.loader.sourcereader`).

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
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypedDict, TypeVar

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from mixplane.loader.parquet import ColumnInfo, ParquetError, SchemaMismatchError

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


_NO_ROWS = np.zeros(0, np.int64)


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


def _signature(cols: list[ColumnInfo]) -> list[str]:
    """What a file delivers, for the majority vote on the source's types."""
    return [str(c.arrow_type) for c in cols]


S = TypeVar("S")


def reference_signature(sigs: list[S]) -> S:
    """The most common signature; ties go to the earliest."""
    counts: dict[str, int] = {}
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


class Where(TypedDict, total=False):
    """Where a unit of a source lies, as the keyword arguments of a :class:`ParquetError`."""

    file: str
    row_group: int
    column: str
    page: int


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
        self.file_row_start: np.ndarray = np.zeros(1, np.int64)
        self.cols: dict[str, dict[str, np.ndarray]] = {}
        self._folded = 0  # files already in the arrays (_rebuild folds in only those after them)
        self._released = 0  # files whose own page arrays were dropped once folded (release_pages)
        self._last_folded: FileIndex | None = None
        # set by _rebuild: the first projected column's arrays (None when no column is projected), rows, units
        self.primary: dict[str, np.ndarray] | None = None
        self.num_rows = 0
        self.num_units = 0
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

    def release_pages(self) -> None:
        """Drop the per-file page arrays of the files folded in (a file keeps its path, size, mtime, rows and
        columns): the source's arrays hold the same pages, and at 10^5 files the per-file copies -- a dozen small
        numpy arrays each -- were most of a loader's memory. Files added later are folded in as before; a rebuild
        of the released files is refused."""
        for f in self.files[self._released: self._folded]:
            f.pages = {}
            f.rg_rows = _NO_ROWS
        self._released = self._folded

    def decoded_bytes_per_row(self) -> float:
        """Mean uncompressed bytes of a row's projected columns (from the footers, nothing read)."""
        if not self.num_rows:
            return 0.0
        total = sum(int(np.sum(self.cols[c]["chunk_raw_len"])) for c in self.columns if c in self.cols)
        return total / self.num_rows

    _DTYPES: ClassVar[dict[str, type[np.integer[Any]]]] = {"chunk_file": np.int32, "chunk_rg": np.int32, "chunk_codec": np.int8, "chunk_dict_off": np.int64,
               "chunk_dict_len": np.int32, "chunk_raw_len": np.int64, "chunk_row_start": np.int64, "chunk_rows": np.int64,
               "unit_off": np.int64, "unit_len": np.int32, "unit_rows": np.int32, "unit_pages": np.int16,
               "chunk_nunits": np.int64}

    def _rebuild(self) -> None:
        """Fold the files added since the last call into the source's arrays. Only the new files are walked (a live
        source that gains a few files to 10^5 indexed ones does not rebuild them all); files replaced or removed
        since (never done by the loader) rebuild everything."""
        F = len(self.files)
        k0 = self._folded
        if k0 > F or (k0 and self.files[k0 - 1] is not self._last_folded):
            k0 = 0
        if k0 < self._released:
            raise RuntimeError("the index's files were replaced after their page arrays were released: "
                               "build a new SourceIndex")
        new = self.files[k0:]
        starts = np.zeros(F + 1, np.int64)
        if k0:
            starts[: k0 + 1] = self.file_row_start[: k0 + 1]
        if new:
            starts[k0 + 1:] = starts[k0] + np.cumsum(np.array([f.num_rows for f in new], np.int64))
        self.file_row_start = starts
        self.num_rows = int(starts[-1])
        old = self.cols if k0 else {}
        self.cols = {}
        # the new files' row groups, numbered across them: where each starts in the source
        rg_rows_all = np.concatenate([f.rg_rows for f in new]).astype(np.int64) if new else np.zeros(0, np.int64)
        rg_base = np.zeros(len(new) + 1, np.int64)
        if new:
            rg_base[1:] = np.cumsum([len(f.rg_rows) for f in new])
        excl = np.cumsum(rg_rows_all) - rg_rows_all  # rows before each row group, over the new files
        rg_file = np.repeat(np.arange(len(new), dtype=np.int64), np.diff(rg_base))
        rg_start_all = starts[k0 + rg_file] + excl - excl[rg_base[rg_file]] if len(rg_file) else excl
        for c in self.columns:
            cps = [f.pages[c] for f in new]
            nchunks = np.array([len(cp.chunk_rg) for cp in cps], np.int64)

            def cat(field: str, cps: list[ColumnPages] = cps) -> np.ndarray:
                dt = self._DTYPES[field]
                return np.concatenate([getattr(cp, field) for cp in cps]).astype(dt) if cps else np.zeros(0, dt)

            a = {k: cat(k) for k in ("chunk_rg", "chunk_codec", "chunk_dict_off", "chunk_dict_len", "chunk_raw_len",
                                     "unit_off", "unit_len", "unit_rows", "unit_pages")}
            local_file = np.repeat(np.arange(len(new), dtype=np.int64), nchunks)
            a["chunk_file"] = (local_file + k0).astype(np.int32)
            rg_global = rg_base[local_file] + a["chunk_rg"]
            a["chunk_row_start"] = rg_start_all[rg_global]
            a["chunk_rows"] = rg_rows_all[rg_global]
            a["chunk_nunits"] = (np.concatenate([np.diff(cp.chunk_first_unit) for cp in cps]).astype(np.int64) if cps
                                 else np.zeros(0, np.int64))
            file_units = np.cumsum([len(cp.unit_off) for cp in cps]).tolist() if cps else []
            prev = old.get(c)
            u0 = int(prev["chunk_first_unit"][-1]) if prev is not None else 0
            a["chunk_first_unit"] = u0 + np.concatenate([[0], np.cumsum(a.pop("chunk_nunits"))]).astype(np.int64)
            a["file_first_unit"] = u0 + np.array([0] + file_units, np.int64)
            nun = len(a["unit_off"])
            # the source row of each unit's first row: chunk row start + rows of earlier units in the chunk
            first = a["chunk_first_unit"] - u0
            chunk_of_unit = np.repeat(np.arange(len(a["chunk_rg"])), np.diff(first))
            cum = np.concatenate([[0], np.cumsum(a["unit_rows"].astype(np.int64))])
            a["unit_row_start"] = (a["chunk_row_start"][chunk_of_unit] + cum[:-1]
                                   - cum[first[chunk_of_unit]]) if nun else np.zeros(0, np.int64)
            if prev is not None:
                for k, v in a.items():
                    if k in ("chunk_first_unit", "file_first_unit"):  # both start with the previous part's end
                        a[k] = np.concatenate([prev[k][:-1], v])
                    else:
                        a[k] = np.concatenate([prev[k], v])
            self.cols[c] = a
        self._folded = F
        self._last_folded = self.files[-1] if F else None
        p = self.cols[self.columns[0]] if self.columns else None
        self.primary = p
        self.num_units = len(p["unit_off"]) if p is not None else 0

    # -- views of the primary column --
    def primary_arrays(self) -> dict[str, np.ndarray]:
        """The first projected column's arrays (:attr:`primary`, which is None only for a source that projects
        no column)."""
        p = self.primary
        if p is None:
            raise RuntimeError("the source projects no column: it has no primary column")
        return p

    @property
    def unit_rows(self) -> np.ndarray:
        return self.primary_arrays()["unit_rows"]

    @property
    def unit_row_start(self) -> np.ndarray:
        return self.primary_arrays()["unit_row_start"]

    @property
    def num_chunks(self) -> int:
        return len(self.primary_arrays()["chunk_rg"])

    @property
    def chunk_row_start(self) -> np.ndarray:
        return self.primary_arrays()["chunk_row_start"]

    @property
    def chunk_rows(self) -> np.ndarray:
        return self.primary_arrays()["chunk_rows"]

    def locate(self, units: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Global unit -> (file, chunk, unit within chunk), vectorised over ``units``: the chunk by
        :meth:`chunk_of_units` (what the reader uses), the file from the chunk table."""
        u = np.asarray(units, dtype=np.int64)
        if len(u) and (u.min() < 0 or u.max() >= self.num_units):
            raise IndexError(f"unit out of range [0, {self.num_units})")
        p = self.primary_arrays()
        c = self.chunk_of_units(u)
        return p["chunk_file"][c].astype(np.int64), c, u - p["chunk_first_unit"][c]

    def unit_of_rows(self, rows: npt.ArrayLike) -> np.ndarray:
        return np.searchsorted(self.unit_row_start, np.asarray(rows, np.int64), side="right") - 1

    def chunk_of_units(self, units: npt.ArrayLike) -> np.ndarray:
        return np.searchsorted(self.primary_arrays()["chunk_first_unit"], np.asarray(units, np.int64), side="right") - 1

    # -- accounting --
    @property
    def nbytes(self) -> int:
        n = self.file_row_start.nbytes
        for a in self.cols.values():
            n += sum(v.nbytes for v in a.values())
        return n

    @property
    def num_pages(self) -> int:
        return int(self.primary_arrays()["unit_pages"].sum()) if self.num_units else 0

    @property
    def bytes_per_page(self) -> float:
        """Index memory per data page of the first column (all projected columns included)."""
        return self.nbytes / max(self.num_pages, 1)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for f in self.files:
            h.update(f"{f.path}|{f.size}|{f.mtime_ns}|{f.num_rows}\n".encode())
        return h.hexdigest()[:16]

    def where(self, col: str, chunk: int, unit: int | None = None) -> Where:
        """File, row group, column and (with ``unit``) page within the chunk of column ``col``'s chunk ``chunk``."""
        a = self.cols[col]
        f = self.files[int(a["chunk_file"][chunk])]
        d: Where = {"file": f.path, "row_group": int(a["chunk_rg"][chunk]), "column": col}
        if unit is not None:
            d["page"] = int(unit - a["chunk_first_unit"][chunk])
        return d

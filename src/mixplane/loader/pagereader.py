"""Read Parquet data pages directly: footer and page headers (our own Thrift compact reader),
decompression (cramjam), and decoding with numpy — no pyarrow reader, no per-row Python loop.

The numpy path covers what training data mostly holds: data pages v1 and v2; PLAIN and dictionary
(PLAIN_DICTIONARY / RLE_DICTIONARY) encodings; RLE / bit-packed hybrid levels; nulls; flat columns
of every physical type but INT96, fields of structs (``meta.url``) and one level of list
(``list<int32>`` token columns, legacy two-level lists too). Every other page — DELTA_BINARY_PACKED,
DELTA_LENGTH_BYTE_ARRAY, DELTA_BYTE_ARRAY, BYTE_STREAM_SPLIT (what Spark's, DuckDB's and pyarrow's
v2 writers produce), and lists of lists — is handed as stored to Arrow's own decoders in a one-page
in-memory file (:func:`arrow_decode_page`). Codecs: none, SNAPPY, GZIP, ZSTD, BROTLI, LZ4_RAW. Page
CRCs are checked when the writer stored them. Anything else raises an error that names the file,
row group, column and page, so the caller can quarantine exactly that unit.

The one loop that is not vectorised walks the 4-byte length prefixes of PLAIN BYTE_ARRAY values of
pages of few values (one step per value, not per byte); everything else is numpy or Arrow C++.
"""

from __future__ import annotations

import base64
import os
import struct
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass, field

import cramjam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mixplane.errors import MixplaneError
from mixplane.loader import remote
from mixplane.loader import thrift as th
from mixplane.loader.thrift import ThriftError, read_struct

MAGIC = b"PAR1"

# physical types
BOOLEAN, INT32, INT64, INT96, FLOAT, DOUBLE, BYTE_ARRAY, FIXED_LEN_BYTE_ARRAY = range(8)
TYPE_NAMES = ["BOOLEAN", "INT32", "INT64", "INT96", "FLOAT", "DOUBLE", "BYTE_ARRAY", "FIXED_LEN_BYTE_ARRAY"]
# encodings
PLAIN, PLAIN_DICTIONARY, RLE, BIT_PACKED, RLE_DICTIONARY = 0, 2, 3, 4, 8
ENCODING_NAMES = {0: "PLAIN", 2: "PLAIN_DICTIONARY", 3: "RLE", 4: "BIT_PACKED", 5: "DELTA_BINARY_PACKED",
                  6: "DELTA_LENGTH_BYTE_ARRAY", 7: "DELTA_BYTE_ARRAY", 8: "RLE_DICTIONARY", 9: "BYTE_STREAM_SPLIT"}
# codecs
UNCOMPRESSED, SNAPPY, GZIP, LZO, BROTLI, LZ4, ZSTD, LZ4_RAW = range(8)
CODEC_NAMES = ["UNCOMPRESSED", "SNAPPY", "GZIP", "LZO", "BROTLI", "LZ4", "ZSTD", "LZ4_RAW"]
# page types
DATA_PAGE, INDEX_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2 = range(4)
# repetition
REQUIRED, OPTIONAL, REPEATED = range(3)

_FIXED_DTYPES = {INT32: np.dtype("<i4"), INT64: np.dtype("<i8"), FLOAT: np.dtype("<f4"), DOUBLE: np.dtype("<f8")}
_NATURAL_ARROW = {BOOLEAN: pa.bool_(), INT32: pa.int32(), INT64: pa.int64(), FLOAT: pa.float32(), DOUBLE: pa.float64()}
_u32 = struct.Struct("<I").unpack_from


# ----------------------------------------------------------------------------------------------
# errors


class ParquetError(MixplaneError, ValueError):
    """A Parquet file or page that cannot be read; the message names file, row group, column, page."""

    kind = "corrupt"

    def __init__(self, message: str, *, file: str | None = None, row_group: int | None = None,
                 column: str | None = None, page: int | None = None):
        self.file, self.row_group, self.column, self.page = file, row_group, column, page
        self.detail = message
        super().__init__(_where(file, row_group, column, page) + message)


class CorruptFileError(ParquetError):
    kind = "corrupt_file"


class CorruptPageError(ParquetError):
    kind = "corrupt_page"


class ChecksumError(CorruptPageError):
    kind = "checksum"


class MissingColumnError(ParquetError):
    kind = "missing_column"


class SchemaMismatchError(ParquetError):
    kind = "type_mismatch"


class EmptyFileError(ParquetError):
    kind = "empty_file"


class UnsupportedError(ParquetError):
    kind = "unsupported"


def _where(file, rg, col, page) -> str:
    parts = []
    if file is not None:
        parts.append(str(file))
    if rg is not None:
        parts.append(f"row group {rg}")
    if col is not None:
        parts.append(f"column {col!r}")
    if page is not None:
        parts.append(f"page {page}")
    return (", ".join(parts) + ": ") if parts else ""


# ----------------------------------------------------------------------------------------------
# positional reads


class IOStats:
    """Bytes and read calls actually issued to storage (shared by all readers of a stream, and by
    their read-ahead threads). Remote sources also count HTTP requests (each a ranged GET, or the
    HEAD of an open), retries, reads served from the reader's caches, and request latencies (the
    last few thousand, drained into the latency histogram by the loader)."""

    def __init__(self) -> None:
        self.bytes_read = 0
        self.reads = 0
        self.requests = 0
        self.retries = 0
        self.cache_hits = 0
        self._latencies: deque[float] = deque(maxlen=4096)
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n
            self.reads += 1

    def request(self, n: int, seconds: float) -> None:
        """One remote request of ``n`` bytes that took ``seconds``."""
        with self._lock:
            self.bytes_read += n
            self.reads += 1
            self.requests += 1
            self._latencies.append(seconds)

    def retry(self) -> None:
        with self._lock:
            self.retries += 1

    def hit(self) -> None:
        with self._lock:
            self.cache_hits += 1

    def drain_latencies(self) -> list[float]:
        with self._lock:
            out = list(self._latencies)
            self._latencies.clear()
        return out


def _as_bytes(b) -> bytes:
    return b if isinstance(b, bytes) else b.to_pybytes()


class MissingObjectFileError(ParquetError):
    """The file (object) is gone: deleted or replaced since it was listed."""

    kind = "missing_object"


class RangeReader:
    """Positional reads of one file. Local files use ``os.pread`` (no shared file position, no
    buffering); other URIs go through ``pyarrow.fs`` ``read_at``, one ranged request each, with
    retries (:mod:`mixplane.loader.remote`); a remote file's last ``tail_bytes`` are read in one request
    the first time any of them is wanted (footer, OffsetIndexes), and :meth:`hold` keeps other spans
    read in one go. Every read is counted."""

    def __init__(self, path: str, filesystem=None, stats: IOStats | None = None, io: remote.RemoteIO | None = None):
        self.path = path
        self.stats = stats if stats is not None else IOStats()
        self._fd: int | None = None
        self._f = None
        self._held: list[tuple[int, bytes]] = []
        self.io = io or remote.DEFAULTS
        self.remote = remote.is_remote(filesystem)
        self.name = remote.object_name(filesystem, path) if self.remote else path
        try:
            if not self.remote:
                self._fd = os.open(path, os.O_RDONLY)
                self.size = os.fstat(self._fd).st_size
            else:
                t0 = time.perf_counter()
                self._f = remote.with_retries("opening", self.name, lambda: remote.open_ranged(filesystem, path), self.io,
                                              on_retry=self.stats.retry)
                self.stats.request(0, time.perf_counter() - t0)
                self.size = self._f.size()
        except remote.MissingObjectError as e:
            raise MissingObjectFileError(str(e), file=path) from None
        except remote.RemoteError:
            raise
        except OSError as e:
            raise CorruptFileError(f"cannot open: {e}", file=path) from None

    def hold(self, offset: int, size: int) -> None:
        """Read [offset, offset + size) in one request and serve later reads inside it from memory."""
        if size > 0 and not self._covered(offset, size):
            self._held.append((offset, self.read_at(offset, size)))

    def held(self, offset: int, size: int) -> tuple[int, bytes] | None:
        """(start, bytes) of the span held in memory that covers [offset, offset + size), if one does."""
        for start, data in self._held:
            if start <= offset and offset + size <= start + len(data):
                return start, data
        return None

    def _covered(self, offset: int, size: int) -> bytes | None:
        for start, data in self._held:
            if start <= offset and offset + size <= start + len(data):
                return data[offset - start : offset - start + size]
        return None

    def read_at(self, offset: int, size: int) -> bytes:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise CorruptFileError(f"read of {size} bytes at {offset} runs past the end of the file ({self.size} bytes)",
                                   file=self.path)
        if size == 0:
            return b""
        if self._fd is not None:
            if self._held:  # (a local file's index reads: its tail, held once)
                got = self._covered(offset, size)
                if got is not None:
                    return got
            data = os.pread(self._fd, size, offset)
            while len(data) < size:  # short reads are legal; finish them
                more = os.pread(self._fd, size - len(data), offset + len(data))
                if not more:
                    raise CorruptFileError(f"file shrank while reading at {offset + len(data)}", file=self.path)
                data += more
            self.stats.add(size)
            return data
        if self._held:
            got = self._covered(offset, size)
            if got is not None:
                self.stats.hit()
                return got
        tail = min(self.size, self.io.tail_bytes)
        if offset >= self.size - tail and not self._held and size < tail:
            self._held.append((self.size - tail, self._get(self.size - tail, tail)))
            return self._covered(offset, size)  # type: ignore[return-value]
        return self._get(offset, size)

    def _get(self, offset: int, size: int) -> bytes:
        f = self._f
        t0 = time.perf_counter()
        try:
            data = remote.with_retries(f"reading {size} bytes at {offset}", self.name,
                                       lambda: _as_bytes(f.read_at(size, offset)), self.io, on_retry=self.stats.retry)
        except remote.MissingObjectError as e:
            raise MissingObjectFileError(str(e), file=self.path) from None
        self.stats.request(size, time.perf_counter() - t0)
        if len(data) != size:
            raise CorruptFileError(f"object returned {len(data)} of {size} bytes at {offset}: shorter than when listed",
                                   file=self.path)
        return data

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._f is not None:
            self._f.close()
            self._f = None
        self._held = []

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


# ----------------------------------------------------------------------------------------------
# footer


@dataclass
class ChunkMeta:
    physical_type: int
    codec: int
    num_values: int
    data_page_offset: int
    dictionary_page_offset: int | None
    total_compressed_size: int
    total_uncompressed_size: int
    offset_index_offset: int | None
    offset_index_length: int | None
    encodings: list[int]

    @property
    def start(self) -> int:
        d = self.dictionary_page_offset
        return d if d is not None and 0 < d < self.data_page_offset else self.data_page_offset


@dataclass
class RowGroupMeta:
    num_rows: int
    columns: list[ChunkMeta]


@dataclass
class SchemaNode:
    name: str
    repetition: int
    physical_type: int | None
    type_length: int | None
    converted_type: int | None
    logical_type: dict | None
    children: list["SchemaNode"] = field(default_factory=list)


@dataclass
class ColumnInfo:
    """How to decode one projected top-level column (one Parquet leaf)."""

    name: str
    leaf: int  # index of the leaf column in each row group
    physical_type: int
    type_length: int
    max_def: int
    max_rep: int
    list_def: int  # def level at which a list exists (empty); only for lists
    item_def: int  # def level at which a list item exists; only for lists
    value_type: pa.DataType  # arrow type of the decoded leaf values (before list wrapping)
    arrow_type: pa.DataType  # type delivered to users
    # the leaf's schema path as a Thrift list of SchemaElements (root, ancestors with one child each,
    # leaf): what a one-page file needs for Arrow's decoders to read a page (:func:`arrow_decode_page`)
    leaf_schema: bytes = b""
    struct_depth: int = 0  # struct levels above the leaf (``meta.url``: 1), unwrapped after Arrow's read

    @property
    def is_list(self) -> bool:
        return self.max_rep > 0

    @property
    def native(self) -> bool:
        """Whether numpy decodes this column's pages (flat or one level of list); deeper nesting
        (lists of lists) always goes through Arrow's decoders."""
        return self.max_rep <= 1

    def signature(self) -> tuple:
        return (self.physical_type, self.type_length, self.max_def, self.max_rep, str(self.arrow_type))


@dataclass
class FileMeta:
    path: str
    size: int
    num_rows: int
    row_groups: list[RowGroupMeta]
    schema: SchemaNode
    leaves: list[tuple[tuple[str, ...], SchemaNode, int, int]]  # (path, node, max_def, max_rep)
    arrow_schema: pa.Schema | None


def read_file_meta(reader: RangeReader) -> FileMeta:
    """Parse the footer of a Parquet file; every failure names the file."""
    raw = footer_bytes(reader)
    try:
        fm, _ = read_struct(raw)
        return _file_meta(reader.path, reader.size, fm)
    except (ThriftError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise CorruptFileError(f"corrupt footer ({type(e).__name__}: {e})", file=reader.path) from None


def footer_bytes(reader: RangeReader) -> bytes:
    """The FileMetaData bytes of a Parquet file (its magic and footer length checked); every failure names the
    file."""
    path, size = reader.path, reader.size
    if size == 0:
        raise EmptyFileError("file is empty (0 bytes)", file=path)
    if size < 12:
        raise CorruptFileError(f"file is truncated ({size} bytes, a Parquet file needs at least 12)", file=path)
    tail = reader.read_at(size - 8, 8)
    if tail[4:] != MAGIC:
        raise CorruptFileError(f"bad magic at the end ({tail[4:]!r}, expected {MAGIC!r}): truncated or not Parquet", file=path)
    if not reader.remote and reader.read_at(0, 4) != MAGIC:  # (remote: one request saved; the footer is checked)
        raise CorruptFileError("bad magic at the start: not a Parquet file", file=path)
    flen = _u32(tail, 0)[0]
    if flen <= 0 or flen > size - 12:
        raise CorruptFileError(f"footer length {flen} does not fit in a {size}-byte file (truncated?)", file=path)
    return reader.read_at(size - 8 - flen, flen)


def _int(v, what: str, optional: bool = False):
    """v if it is an integer (None too when optional): a footer's field of another type is a corrupt footer,
    not a TypeError later."""
    if type(v) is not int and not (optional and v is None):
        raise ThriftError(f"{what} is {type(v).__name__}, not an integer")
    return v


def _file_meta(path: str, size: int, fm: dict) -> FileMeta:
    elems = fm[2]
    pos = 0

    def build() -> SchemaNode:
        nonlocal pos
        if pos >= len(elems):
            raise ThriftError("schema ends early")
        e = elems[pos]
        pos += 1
        lt = e.get(10)
        if lt is not None and type(lt) is not dict:
            raise ThriftError("a schema element's logical type is not a struct")
        node = SchemaNode(name=e[4].decode("utf-8", "replace"), repetition=_int(e.get(3, REQUIRED), "repetition"),
                          physical_type=_int(e.get(1), "type", True), type_length=_int(e.get(2), "type_length", True),
                          converted_type=_int(e.get(6), "converted_type", True), logical_type=lt)
        for _ in range(_int(e.get(5, 0) or 0, "num_children")):
            node.children.append(build())
        return node

    root = build()
    leaves: list = []

    def walk(node: SchemaNode, path: tuple, d: int, r: int) -> None:
        for c in node.children:
            dd = d + (c.repetition != REQUIRED)
            rr = r + (c.repetition == REPEATED)
            if c.children:
                walk(c, path + (c.name,), dd, rr)
            else:
                leaves.append((path + (c.name,), c, dd, rr))

    walk(root, (), 0, 0)
    rgs = []
    for rg in fm.get(4, []):
        cols = []
        for cc in rg[1]:
            md = cc.get(3)
            if md is None:
                raise ThriftError("column chunk without metadata (encrypted or external file)")
            cols.append(ChunkMeta(physical_type=_int(md[1], "type"), codec=_int(md[4], "codec"),
                                  num_values=_int(md[5], "num_values"), data_page_offset=_int(md[9], "data_page_offset"),
                                  dictionary_page_offset=_int(md.get(11), "dictionary_page_offset", True),
                                  total_compressed_size=_int(md[7], "total_compressed_size"),
                                  total_uncompressed_size=_int(md.get(6, md[7]), "total_uncompressed_size"),
                                  offset_index_offset=_int(cc.get(4), "offset_index_offset", True),
                                  offset_index_length=_int(cc.get(5), "offset_index_length", True),
                                  encodings=list(md.get(2, []))))
        if len(cols) != len(leaves):
            raise ThriftError(f"row group has {len(cols)} column chunks, schema has {len(leaves)} leaves")
        rgs.append(RowGroupMeta(num_rows=_int(rg[3], "a row group's num_rows"), columns=cols))
    arrow_schema = None
    for kv in fm.get(5, []) or []:
        if kv.get(1) == b"ARROW:schema" and kv.get(2):
            try:
                v = kv[2]
                arrow_schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(v + b"=" * (-len(v) % 4))))
                arrow_schema.names  # noqa: B018  (a damaged one may fail only here: its names not UTF-8)
            except Exception:
                arrow_schema = None
    return FileMeta(path=path, size=size, num_rows=_int(fm.get(3, 0), "num_rows"), row_groups=rgs, schema=root, leaves=leaves,
                    arrow_schema=arrow_schema)


def _is_string(node: SchemaNode) -> bool:
    lt = node.logical_type or {}
    return node.converted_type in (0, 4) or any(k in lt for k in (1, 4, 5))  # UTF8/ENUM/JSON | STRING/ENUM/JSON


def _natural_type(node: SchemaNode) -> pa.DataType:
    pt = node.physical_type
    if pt == BYTE_ARRAY:
        return pa.string() if _is_string(node) else pa.binary()
    if pt == FIXED_LEN_BYTE_ARRAY:
        return pa.binary(node.type_length or 0)
    if pt in _NATURAL_ARROW:
        return _NATURAL_ARROW[pt]
    raise UnsupportedError(f"physical type {TYPE_NAMES[pt] if pt is not None and 0 <= pt < 8 else pt} is not supported")


def _find_column(meta: FileMeta, name: str) -> tuple[list[SchemaNode], list[int]]:
    """Schema nodes from the top-level column down to ``name`` (a top-level name, or a dotted path to a
    field of a struct: ``meta.url``) and the leaf indexes under it; raises MissingColumnError."""
    tops = {c.name: c for c in meta.schema.children}
    parts = [name] if name in tops else name.split(".")
    chain, n = [], meta.schema
    for part in parts:
        nxt = next((c for c in n.children if c.name == part), None)
        if nxt is None:
            raise MissingColumnError(f"no column {name!r} (has: {', '.join(tops)})", file=meta.path, column=name)
        chain.append(nxt)
        n = nxt
    prefix = tuple(c.name for c in chain)
    return chain, [i for i, (p, *_rest) in enumerate(meta.leaves) if p[: len(prefix)] == prefix]


def _leaf_schema(chain: list[SchemaNode], string: bool) -> bytes:
    """Thrift list<SchemaElement> of root -> chain (one child each): the schema of a one-leaf file.
    The leaf keeps only its physical type (and UTF8 for strings), so Arrow decodes it to
    :func:`_natural_type`, the type the numpy path produces; groups keep LIST / MAP annotations."""
    w = th.CompactWriter()
    elems = [[(4, th.BINARY, "schema"), (5, th.I32, 1)]]
    for nd in chain:
        if nd.children:
            f = [(3, th.I32, nd.repetition), (4, th.BINARY, nd.name), (5, th.I32, 1)]
            if nd.converted_type in (1, 2, 3):  # MAP, MAP_KEY_VALUE, LIST
                f.append((6, th.I32, nd.converted_type))
        else:
            f = [(1, th.I32, nd.physical_type)]
            if nd.physical_type == FIXED_LEN_BYTE_ARRAY:
                f.append((2, th.I32, nd.type_length or 0))
            f += [(3, th.I32, nd.repetition), (4, th.BINARY, nd.name)]
            if string:
                f.append((6, th.I32, 0))
        elems.append(f)
    w._value(th.LIST, (th.STRUCT, elems))
    return bytes(w.out)


def _arrow_field_type(schema: pa.Schema | None, name: str) -> pa.DataType | None:
    """The type the writer's ARROW:schema gives column ``name`` (a dotted path walks struct fields)."""
    if schema is None:
        return None
    i = schema.get_field_index(name)  # (-1 when missing, or named twice in a damaged footer)
    if i >= 0:
        t = schema.field(i).type
    else:
        parts = name.split(".")
        i = schema.get_field_index(parts[0])
        if i < 0:
            return None
        t = schema.field(i).type
        for part in parts[1:]:
            if not pa.types.is_struct(t) or t.get_field_index(part) < 0:
                return None
            t = t.field(t.get_field_index(part)).type
    return t.value_type if pa.types.is_dictionary(t) else t


def resolve_columns(meta: FileMeta, names: list[str]) -> list[ColumnInfo]:
    """Map column names (top-level, or ``a.b`` for a field of a struct) to their leaves; raise for a
    missing or unsupported column."""
    out = []
    for name in names:
        chain, idx = _find_column(meta, name)
        if len(idx) != 1:
            raise UnsupportedError(f"column {name!r} is a struct or map with {len(idx)} leaves; name one field "
                                   f"(e.g. {name}.{meta.leaves[idx[0]][0][len(chain)] if idx else 'field'})",
                                   file=meta.path, column=name)
        leaf_i = idx[0]
        path, node, max_def, max_rep = meta.leaves[leaf_i]
        # nodes along the whole leaf path (top-level first)
        full, n = [], meta.schema
        for part in path:
            n = next(c for c in n.children if c.name == part)
            full.append(n)
        # leading struct levels (plain groups) are unwrapped; below the first list every group must be
        # part of a list's structure (one child), so the column reads as a (nested) list of the leaf
        struct_depth = 0
        for nd in full[:-1]:
            if nd.repetition == REPEATED or nd.converted_type in (1, 2, 3):
                break
            struct_depth += 1
        if any(len(nd.children) != 1 for nd in full[struct_depth:-1]):
            raise UnsupportedError(f"column {name!r} holds a struct inside a list; only lists of one value are read",
                                   file=meta.path, column=name)
        list_def = item_def = 0
        if max_rep >= 1:
            d = 0
            for nd in full:
                if nd.repetition == REPEATED:
                    list_def, item_def = d, d + 1
                    break
                d += nd.repetition != REQUIRED
        try:
            value_type = _natural_type(node)
        except UnsupportedError as e:
            raise UnsupportedError(e.detail, file=meta.path, column=name) from None
        natural = value_type
        for _ in range(max_rep):
            natural = pa.list_(natural)
        arrow_type = _arrow_field_type(meta.arrow_schema, name) or natural
        out.append(ColumnInfo(name=name, leaf=leaf_i, physical_type=node.physical_type, type_length=node.type_length or 0,
                              max_def=max_def, max_rep=max_rep, list_def=list_def, item_def=item_def,
                              value_type=value_type, arrow_type=arrow_type,
                              leaf_schema=_leaf_schema(full, pa.types.is_string(value_type)), struct_depth=struct_depth))
    return out


def read_offset_index(reader: RangeReader, chunk: ChunkMeta) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(offsets, compressed sizes incl. header, first row index) of a chunk's data pages, if written."""
    if not chunk.offset_index_offset or not chunk.offset_index_length:
        return None
    raw = reader.read_at(chunk.offset_index_offset, chunk.offset_index_length)
    oi, _ = read_struct(raw)
    locs = oi.get(1, [])
    off = np.fromiter((p[1] for p in locs), dtype=np.int64, count=len(locs))
    size = np.fromiter((p[2] for p in locs), dtype=np.int64, count=len(locs))
    first = np.fromiter((p[3] for p in locs), dtype=np.int64, count=len(locs))
    return off, size, first


# ----------------------------------------------------------------------------------------------
# page headers


@dataclass
class PageHeader:
    type: int
    uncompressed_size: int
    compressed_size: int
    crc: int | None
    header_len: int
    num_values: int = 0
    encoding: int = PLAIN
    def_encoding: int = RLE
    rep_encoding: int = RLE
    num_nulls: int | None = None
    num_rows: int | None = None
    def_len: int = 0
    rep_len: int = 0
    is_compressed: bool = True


def parse_page_header(buf: bytes | memoryview, pos: int = 0) -> PageHeader:
    """Parse the Thrift PageHeader at ``pos``; raises ThriftError / ValueError when malformed."""
    h, end = read_struct(buf, pos)
    try:
        return _page_header(h, pos, end)
    except (TypeError, AttributeError, IndexError) as e:  # a field of another type (a damaged header)
        raise ThriftError(f"malformed page header ({type(e).__name__}: {e})") from None


def _page_header(h: dict, pos: int, end: int) -> PageHeader:
    try:
        ptype, usize, csize = h[1], h[2], h[3]
    except KeyError as e:
        raise ThriftError(f"page header lacks required field {e}") from None
    if usize < 0 or csize < 0:
        raise ThriftError(f"negative page size ({usize}, {csize})")
    crc = h.get(4)
    ph = PageHeader(type=ptype, uncompressed_size=usize, compressed_size=csize,
                    crc=(crc & 0xFFFFFFFF) if crc is not None else None, header_len=end - pos)
    if ptype == DATA_PAGE:
        d = h.get(5)
        if d is None:
            raise ThriftError("data page without data_page_header")
        ph.num_values, ph.encoding = d[1], d[2]
        ph.def_encoding, ph.rep_encoding = d.get(3, RLE), d.get(4, RLE)
    elif ptype == DATA_PAGE_V2:
        d = h.get(8)
        if d is None:
            raise ThriftError("data page v2 without data_page_header_v2")
        ph.num_values, ph.num_nulls, ph.num_rows, ph.encoding = d[1], d[2], d[3], d[4]
        ph.def_len, ph.rep_len = d[5], d[6]
        ph.is_compressed = d.get(7, True)
        if ph.def_len < 0 or ph.rep_len < 0 or ph.def_len + ph.rep_len > csize:
            raise ThriftError("level lengths exceed the page")
    elif ptype == DICTIONARY_PAGE:
        d = h.get(7)
        if d is None:
            raise ThriftError("dictionary page without dictionary_page_header")
        ph.num_values, ph.encoding = d[1], d[2]
    if ph.num_values < 0:
        raise ThriftError(f"negative value count {ph.num_values}")
    return ph


# ----------------------------------------------------------------------------------------------
# decompression


def decompress(codec: int, data, size: int) -> bytes | bytearray | memoryview:
    """Decompress a page body into exactly ``size`` bytes."""
    if codec == UNCOMPRESSED:
        if len(data) != size:
            raise ValueError(f"uncompressed page has {len(data)} bytes, header says {size}")
        return data
    out = _alloc(size)
    try:
        if codec == SNAPPY:
            n = cramjam.snappy.decompress_raw_into(bytes(data), out)
        elif codec == ZSTD:
            n = cramjam.zstd.decompress_into(bytes(data), out)
        elif codec == GZIP:
            n = cramjam.gzip.decompress_into(bytes(data), out)
        elif codec == BROTLI:
            n = cramjam.brotli.decompress_into(bytes(data), out)
        elif codec == LZ4_RAW:
            n = cramjam.lz4.decompress_block_into(bytes(data), out)
        else:
            raise UnsupportedError(f"codec {CODEC_NAMES[codec] if 0 <= codec < 8 else codec} is not supported")
    except UnsupportedError:
        raise
    except Exception as e:  # cramjam.DecompressionError and friends
        raise ValueError(f"{CODEC_NAMES[codec]} decompression failed: {e}") from None
    if n != size:
        raise ValueError(f"page decompressed to {n} bytes, header says {size}")
    return out


def int64_array(x) -> pa.Array:
    """An Arrow int64 array of ``x`` (e.g. take indices), built without ``pa.array``: that one
    imports pandas on first use whenever pandas is installed (~30 MB for a loader process)."""
    a = np.ascontiguousarray(x, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(a), [None, pa.py_buffer(a)])


def _alloc(n: int):
    """A writable buffer from Arrow's memory pool: page-sized allocations come and go all the time,
    and the pool gives them back to the system far better than the C heap does."""
    return pa.allocate_buffer(max(n, 0), resizable=False) if n else bytearray(0)


# ----------------------------------------------------------------------------------------------
# RLE / bit-packed hybrid


def unpack_bits(data, bit_width: int, count: int) -> np.ndarray:
    """``count`` little-endian bit-packed unsigned integers of ``bit_width`` bits (vectorised)."""
    if bit_width == 0:
        return np.zeros(count, np.int64)
    a = np.frombuffer(data, dtype=np.uint8)
    need = (count * bit_width + 7) // 8
    if len(a) < need:
        raise ValueError(f"bit-packed data too short ({len(a)} bytes for {count} values of {bit_width} bits)")
    if bit_width == 8:
        return a[:count].astype(np.int64)
    if bit_width in (16, 32):
        return np.frombuffer(a[: count * bit_width // 8].tobytes(), dtype=f"<u{bit_width // 8}").astype(np.int64)
    a = np.concatenate([a[:need], np.zeros(8, np.uint8)])
    bitpos = np.arange(count, dtype=np.int64) * bit_width
    byte = bitpos >> 3
    shift = (bitpos & 7).astype(np.uint64)
    nbytes = (bit_width + 7 + 7) // 8
    word = np.zeros(count, np.uint64)
    for k in range(nbytes):
        word |= a[byte + k].astype(np.uint64) << np.uint64(8 * k)
    return ((word >> shift) & np.uint64((1 << bit_width) - 1)).astype(np.int64)


def decode_hybrid(buf, pos: int, end: int, bit_width: int, count: int) -> np.ndarray:
    """Decode ``count`` values of the RLE / bit-packed hybrid encoding from buf[pos:end].

    The loop runs once per *run* (each run covers at least 8 values, usually hundreds); bit-packed
    runs are unpacked together in one vectorised step."""
    if count == 0:
        return np.zeros(0, np.int64)
    if bit_width == 0:
        return np.zeros(count, np.int64)
    if bit_width > 32:
        raise ValueError(f"bit width {bit_width} > 32")
    vbytes = (bit_width + 7) // 8
    kinds: list[int] = []  # 0 = rle, 1 = bit-packed
    counts: list[int] = []
    rle_values: list[int] = []
    bp_chunks: list = []
    got = 0
    mv = memoryview(buf)
    while got < count:
        # varint run header
        h = shift = 0
        while True:
            if pos >= end:
                raise ValueError(f"level/index data ends after {got} of {count} values")
            b = mv[pos]
            pos += 1
            h |= (b & 0x7F) << shift
            if not b & 0x80:
                break
            shift += 7
            if shift > 35:
                raise ValueError("run header varint too long")
        if h & 1:
            groups = h >> 1
            nb = groups * bit_width
            if pos + nb > end:
                # a final bit-packed run may be cut short by writers; only values still needed must fit
                needed = ((count - got) * bit_width + 7) // 8
                if pos + needed > end:
                    raise ValueError("bit-packed run runs past the end of the data")
                nb = end - pos
            n = groups * 8
            if n == 0:
                raise ValueError("empty bit-packed run")
            bp_chunks.append(mv[pos : pos + nb])
            pos += nb
            kinds.append(1)
        else:
            n = h >> 1
            if n == 0:
                raise ValueError("zero-length RLE run")
            if pos + vbytes > end:
                raise ValueError("RLE run value runs past the end of the data")
            rle_values.append(int.from_bytes(mv[pos : pos + vbytes], "little"))
            pos += vbytes
            kinds.append(0)
        counts.append(n)
        got += n
    if len(kinds) == 1 and kinds[0] == 0:
        return np.full(count, rle_values[0], np.int64)
    if not rle_values:
        data = bp_chunks[0] if len(bp_chunks) == 1 else b"".join(bp_chunks)
        return unpack_bits(data, bit_width, count)
    # mixed: unpack all bit-packed runs at once (each run is a whole number of bytes)
    bp_total = sum(c for k, c in zip(kinds, counts) if k)
    bp_vals = unpack_bits(b"".join(bp_chunks), bit_width, bp_total) if bp_chunks else np.zeros(0, np.int64)
    kinds_a = np.array(kinds, np.int8)
    counts_a = np.array(counts, np.int64)
    # value for each run's slots: rle runs repeat their value; bp runs take consecutive unpacked values
    out = np.empty(int(counts_a.sum()), np.int64)
    run_of = np.repeat(np.arange(len(kinds)), counts_a)
    is_bp = np.repeat(kinds_a == 1, counts_a)
    rle_idx = np.cumsum(kinds_a == 0) - 1
    out[~is_bp] = np.array(rle_values, np.int64)[rle_idx[run_of[~is_bp]]]
    out[is_bp] = bp_vals[: int(is_bp.sum())]
    return out[:count]


# ----------------------------------------------------------------------------------------------
# values


def _plain_page_file(body, n: int) -> bytes:
    """A minimal Parquet file of one REQUIRED BYTE_ARRAY column holding ``body`` (PLAIN values) as
    its only data page: lets Arrow's C++ reader follow the length chain instead of a Python loop."""
    size = len(body)
    h = th.CompactWriter()
    h.struct([(1, th.I32, DATA_PAGE), (2, th.I32, size), (3, th.I32, size),
              (5, th.STRUCT, [(1, th.I32, n), (2, th.I32, PLAIN), (3, th.I32, RLE), (4, th.I32, RLE)])])
    page_off = 4
    total = len(h.out) + size
    m = th.CompactWriter()
    chunk_meta = [(1, th.I32, BYTE_ARRAY), (2, th.LIST, (th.I32, [PLAIN])), (3, th.LIST, (th.BINARY, ["v"])),
                  (4, th.I32, UNCOMPRESSED), (5, th.I64, n), (6, th.I64, total), (7, th.I64, total), (9, th.I64, page_off)]
    m.struct([(1, th.I32, 1),
              (2, th.LIST, (th.STRUCT, [[(4, th.BINARY, "s"), (5, th.I32, 1)],
                                        [(1, th.I32, BYTE_ARRAY), (3, th.I32, 0), (4, th.BINARY, "v")]])),
              (3, th.I64, n),
              (4, th.LIST, (th.STRUCT, [[(1, th.LIST, (th.STRUCT, [[(2, th.I64, page_off), (3, th.STRUCT, chunk_meta)]])),
                                         (2, th.I64, total), (3, th.I64, n)]]))])
    return b"".join([MAGIC, bytes(h.out), body, bytes(m.out), struct.pack("<I", len(m.out)), MAGIC])


PLAIN_LOOP_MAX_VALUES = 1024  # pages with fewer values (e.g. ~1 KB+ texts in a 1 MB page) follow the chain in Python


def _plain_byte_array(buf, pos: int, end: int, n: int, select: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Offsets (int64, n+1) and the concatenated bytes (uint8) of n PLAIN BYTE_ARRAY values
    (only of the values at ``select``, ascending indices, when given). Each value's offset depends
    on the previous length, so no numpy pass finds them: a page of many values goes through Arrow's
    reader on a one-page file, a page of few values through a short loop (bounded per page)."""
    if n <= PLAIN_LOOP_MAX_VALUES:
        return _plain_byte_array_loop(buf, pos, end, n, select)
    return _plain_byte_array_arrow(buf, pos, end, n, select)


def _plain_byte_array_loop(buf, pos: int, end: int, n: int, select: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`_plain_byte_array` for pages of few (long) values: one step per value along the length chain,
    then one copy of just the wanted bytes — cheaper there than the C++ reader's per-page setup and
    its copy of the whole page."""
    starts = [0] * n
    p = pos
    u32 = _u32
    limit = end - 4
    for i in range(n):  # one step per value: follows the length chain (cannot be vectorised in numpy)
        if p > limit:
            raise ValueError(f"BYTE_ARRAY data ends after {i} of {n} values")
        starts[i] = p
        p += 4 + u32(buf, p)[0]
    if p > end:
        raise ValueError("BYTE_ARRAY value runs past the end of the page")
    a = np.frombuffer(buf, dtype=np.uint8, count=p - pos, offset=pos)
    st = np.array(starts, dtype=np.int64) - pos
    lens = np.empty(n, np.int64)
    if n:
        lens[:-1] = st[1:] - st[:-1] - 4
        lens[-1] = (p - pos) - st[-1] - 4
    if select is not None:  # copy just the selected values' bytes
        sel = np.asarray(select, np.int64)
        if len(sel) and (sel[0] < 0 or sel[-1] >= n):
            raise IndexError("row selection outside the page")
        ls = lens[sel]
        offsets = np.zeros(len(sel) + 1, np.int64)
        np.cumsum(ls, out=offsets[1:])
        mv = memoryview(buf)
        data = np.frombuffer(b"".join([mv[starts[i] + 4 : starts[i] + 4 + ln] for i, ln in zip(sel.tolist(), ls.tolist())]),
                             np.uint8)
        return offsets, data
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    if n == 0:
        return offsets, np.zeros(0, np.uint8)
    if n * 64 <= p - pos:
        # long values (text): copy each value's bytes in one memcpy, skipping the length prefixes
        mv = memoryview(buf)
        data = np.frombuffer(b"".join([mv[q + 4 : q + 4 + ln] for q, ln in zip(starts, lens.tolist())]), np.uint8)
    else:
        # short values: one vectorised pass with a mask of the prefix bytes
        keep = np.ones(p - pos, bool)
        keep[(st[:, None] + np.arange(4)).ravel()] = False
        data = np.frombuffer(_alloc(int(offsets[-1])), np.uint8)
        np.compress(keep, a, out=data)
    return offsets, data


def _plain_byte_array_arrow(buf, pos: int, end: int, n: int, select: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`_plain_byte_array` for pages of many values: Arrow's C++ reader follows the length chain."""
    if n == 0:
        return np.zeros(1, np.int64), np.zeros(0, np.uint8)
    if end - pos < 4 * n:
        raise ValueError(f"BYTE_ARRAY data has {end - pos} bytes for {n} values")
    body = memoryview(buf)[pos:end]
    try:
        arr = pq.ParquetFile(pa.BufferReader(_plain_page_file(body, n))).read().column(0).combine_chunks()
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"BYTE_ARRAY data does not hold {n} values ({e})") from None
    if len(arr) != n:
        raise ValueError(f"BYTE_ARRAY data holds {len(arr)} of {n} values")
    if select is not None:
        sel = np.asarray(select, np.int64)
        if len(sel) and (sel[0] < 0 or sel[-1] >= n):
            raise IndexError("row selection outside the page")
        arr = arr.take(pa.array(sel, pa.int64()))
    bufs = arr.buffers()
    offs = np.frombuffer(bufs[1], np.int32, len(arr) + 1, arr.offset * 4).astype(np.int64)
    data = np.frombuffer(bufs[2], np.uint8, int(offs[-1] - offs[0]), int(offs[0])) if bufs[2] is not None \
        else np.zeros(0, np.uint8)
    return offs - offs[0], data


def _binary_array(offsets: np.ndarray, data: np.ndarray, valid: np.ndarray | None, string: bool) -> pa.Array:
    n = len(offsets) - 1
    large = offsets[-1] >= (1 << 31) - 1
    typ = (pa.large_string() if string else pa.large_binary()) if large else (pa.string() if string else pa.binary())
    offs = offsets if large else offsets.astype(np.int32)
    vb, nulls = _validity(valid)
    return pa.Array.from_buffers(typ, n, [vb, pa.py_buffer(offs), pa.py_buffer(data)], null_count=nulls)


def _validity(valid: np.ndarray | None):
    if valid is None:
        return None, 0
    nulls = int(len(valid) - np.count_nonzero(valid))
    if nulls == 0:
        return None, 0
    return pa.py_buffer(np.packbits(valid, bitorder="little")), nulls


def decode_plain(col: ColumnInfo, buf, pos: int, end: int, n: int, select: np.ndarray | None = None):
    """PLAIN values: numpy array for fixed width, (offsets, data) for BYTE_ARRAY (only the
    BYTE_ARRAY values at ``select`` when given; other types ignore it)."""
    pt = col.physical_type
    if pt in _FIXED_DTYPES:
        dt = _FIXED_DTYPES[pt]
        if pos + n * dt.itemsize > end:
            raise ValueError(f"PLAIN data has {end - pos} bytes for {n} {TYPE_NAMES[pt]} values")
        return np.frombuffer(buf, dtype=dt, count=n, offset=pos)
    if pt == BYTE_ARRAY:
        return _plain_byte_array(buf, pos, end, n, select)
    if pt == BOOLEAN:
        nb = (n + 7) // 8
        if pos + nb > end:
            raise ValueError("PLAIN BOOLEAN data too short")
        return np.unpackbits(np.frombuffer(buf, np.uint8, nb, pos), bitorder="little")[:n].astype(bool)
    if pt == FIXED_LEN_BYTE_ARRAY:
        w = col.type_length
        if pos + n * w > end:
            raise ValueError("PLAIN FIXED_LEN_BYTE_ARRAY data too short")
        return np.frombuffer(buf, np.uint8, n * w, pos).reshape(n, w) if w else np.zeros((n, 0), np.uint8)
    raise UnsupportedError(f"physical type {TYPE_NAMES[pt]} is not supported")


@dataclass
class Dictionary:
    values: object  # numpy array (fixed width) or pa.Array (byte arrays); None when only ``raw`` is kept
    size: int
    nbytes: int
    raw: bytes | None = None  # the page as stored (header included): columns decoded by Arrow need it


def decode_dictionary_page(col: ColumnInfo, header: PageHeader, body, raw=None) -> Dictionary:
    """Decoded dictionary values; for a column Arrow decodes (:attr:`ColumnInfo.native` false) only
    the stored page ``raw`` (header included), which Arrow reads with the data pages."""
    if not col.native:
        if raw is None:
            raise ValueError("dictionary page of a nested column without its stored bytes")
        return Dictionary(None, header.num_values, len(raw), bytes(raw))
    if header.encoding not in (PLAIN, PLAIN_DICTIONARY):
        raise UnsupportedError(f"dictionary page encoding {ENCODING_NAMES.get(header.encoding, header.encoding)}")
    n = header.num_values
    vals = decode_plain(col, body, 0, len(body), n)
    if col.physical_type == BYTE_ARRAY:
        offsets, data = vals
        arr = _binary_array(offsets, data, None, pa.types.is_string(col.value_type) or pa.types.is_large_string(col.value_type))
        return Dictionary(arr, n, arr.nbytes)
    vals = np.array(vals)  # own the memory: the page buffer is released
    return Dictionary(vals, n, vals.nbytes)


def _values_to_arrow(col: ColumnInfo, vals, valid: np.ndarray | None, n_slots: int) -> pa.Array:
    """Arrow array of n_slots slots from the present values and a validity mask."""
    pt = col.physical_type
    if pt == BYTE_ARRAY:
        offsets, data = vals
        if valid is not None and len(offsets) - 1 != n_slots:
            lens = np.zeros(n_slots, np.int64)
            lens[valid] = np.diff(offsets)
            offsets = np.zeros(n_slots + 1, np.int64)
            np.cumsum(lens, out=offsets[1:])
        return _binary_array(offsets, data, valid, pa.types.is_string(col.value_type))
    if pt == FIXED_LEN_BYTE_ARRAY:
        w = col.type_length
        full = vals
        if valid is not None and len(vals) != n_slots:
            full = np.zeros((n_slots, w), np.uint8)
            full[valid] = vals
        vb, nulls = _validity(valid)
        return pa.Array.from_buffers(pa.binary(w), n_slots, [vb, pa.py_buffer(np.ascontiguousarray(full))], null_count=nulls)
    if pt == BOOLEAN:
        full = vals
        if valid is not None and len(vals) != n_slots:
            full = np.zeros(n_slots, bool)
            full[valid] = vals
        vb, nulls = _validity(valid)
        return pa.Array.from_buffers(pa.bool_(), n_slots, [vb, pa.py_buffer(np.packbits(full, bitorder="little"))],
                                     null_count=nulls)
    full = vals
    if valid is not None and len(vals) != n_slots:
        full = np.zeros(n_slots, vals.dtype)
        full[valid] = vals
    vb, nulls = _validity(valid)
    return pa.Array.from_buffers(col.value_type, n_slots, [vb, pa.py_buffer(np.ascontiguousarray(full))], null_count=nulls)


def _dict_to_arrow(col: ColumnInfo, d: Dictionary, idx: np.ndarray, valid: np.ndarray | None, n_slots: int) -> pa.Array:
    if len(idx) and (idx.max() >= d.size or idx.min() < 0):
        raise ValueError(f"dictionary index {int(idx.max())} out of range (dictionary has {d.size} values)")
    if col.physical_type == BYTE_ARRAY:
        full = idx
        if valid is not None and len(idx) != n_slots:
            full = np.zeros(n_slots, np.int64)
            full[valid] = idx
        vb, nulls = _validity(valid)
        ind = pa.Array.from_buffers(pa.int32(), n_slots, [vb, pa.py_buffer(full.astype(np.int32))], null_count=nulls)
        return d.values.take(ind)
    return _values_to_arrow(col, d.values[idx], valid, n_slots)


def _finish_type(arr: pa.Array, target: pa.DataType) -> pa.Array:
    """``arr`` as the delivered type: a view when only the logical type differs, else a cast that
    refuses lossy conversions (a file's int64 token ids cast to a source's int32 must all fit)."""
    if arr.type == target:
        return arr
    try:
        if (pa.types.is_primitive(arr.type) and pa.types.is_primitive(target) and not pa.types.is_boolean(target)
                and arr.type.bit_width == target.bit_width):
            return arr.view(target)
    except (ValueError, pa.ArrowInvalid, NotImplementedError):
        pass
    narrowing = pa.types.is_integer(_innermost(target)) and pa.types.is_integer(_innermost(arr.type)) \
        and _innermost(target).bit_width < _innermost(arr.type).bit_width
    return arr.cast(target, safe=narrowing)


def _innermost(t: pa.DataType) -> pa.DataType:
    while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        t = t.value_type
    return t


# ----------------------------------------------------------------------------------------------
# data pages


def _levels_v1(body, pos: int, max_level: int, n: int, encoding: int) -> tuple[np.ndarray, int]:
    if encoding != RLE:
        raise UnsupportedError(f"level encoding {ENCODING_NAMES.get(encoding, encoding)} is not supported")
    if pos + 4 > len(body):
        raise ValueError("level length prefix runs past the page")
    ln = _u32(body, pos)[0]
    pos += 4
    if pos + ln > len(body):
        raise ValueError(f"levels ({ln} bytes) run past the page")
    bw = max_level.bit_length()
    lv = decode_hybrid(body, pos, pos + ln, bw, n)
    return lv, pos + ln


def decode_data_page(col: ColumnInfo, header: PageHeader, raw, codec: int, dictionary: Dictionary | None,
                     select: np.ndarray | None = None) -> pa.Array:
    """Decode one data page (``raw`` = the page bytes after its header, as stored) to an Arrow array
    with one slot per row of the page (one list per row for list columns); with ``select``
    (ascending row indices of the page) only those rows, in that order."""
    n = header.num_values
    rep = dfn = None
    if header.type == DATA_PAGE:
        body = decompress(codec, raw, header.uncompressed_size)
        pos = 0
        if col.max_rep:
            rep, pos = _levels_v1(body, pos, col.max_rep, n, header.rep_encoding)
        if col.max_def:
            dfn, pos = _levels_v1(body, pos, col.max_def, n, header.def_encoding)
        vend = len(body)
    elif header.type == DATA_PAGE_V2:
        rl, dl = header.rep_len, header.def_len
        lv = memoryview(raw)[: rl + dl]
        if col.max_rep:
            rep = decode_hybrid(lv, 0, rl, col.max_rep.bit_length(), n)
        if col.max_def:
            dfn = decode_hybrid(lv, rl, rl + dl, col.max_def.bit_length(), n)
        vraw = memoryview(raw)[rl + dl :]
        vsize = header.uncompressed_size - rl - dl
        if header.is_compressed and codec != UNCOMPRESSED:
            body = decompress(codec, vraw, vsize)
        else:
            if len(vraw) != vsize:
                raise ValueError(f"v2 page values have {len(vraw)} bytes, header says {vsize}")
            body = vraw
        pos, vend = 0, len(body)
    else:
        raise ValueError(f"page type {header.type} is not a data page")

    if dfn is not None:
        if len(dfn) and (dfn.max() > col.max_def or dfn.min() < 0):
            raise ValueError(f"definition level {int(dfn.max())} above the column's maximum {col.max_def}")
        present = dfn == col.max_def
        n_present = int(np.count_nonzero(present))
    else:
        present = None
        n_present = n
    if rep is not None:
        if len(rep) and (rep.max() > col.max_rep or rep[0] != 0):
            raise ValueError("repetition levels are inconsistent (page does not start a row, or level too high)")
    if header.num_nulls is not None and header.type == DATA_PAGE_V2 and header.num_nulls != n - n_present:
        raise ValueError(f"header says {header.num_nulls} nulls, levels say {n - n_present}")

    enc = header.encoding
    # selecting rows while decoding (no copy of the other rows) needs one value per row
    early = select is not None and not col.is_list and n_present == n
    if enc == PLAIN:
        vals = decode_plain(col, body, pos, vend, n_present, select if early else None)
        if early and col.physical_type != BYTE_ARRAY:
            vals = vals[np.asarray(select, np.int64)]
        dict_mode = False
    elif enc in (PLAIN_DICTIONARY, RLE_DICTIONARY):
        if dictionary is None:
            raise ValueError("dictionary-encoded page but the column chunk has no dictionary page")
        if pos >= vend and n_present:
            raise ValueError("dictionary index data missing")
        bw = body[pos] if n_present else 0
        idx = decode_hybrid(body, pos + 1, vend, bw, n_present) if n_present else np.zeros(0, np.int64)
        if early:
            idx = idx[np.asarray(select, np.int64)]
        dict_mode = True
    elif enc == RLE and col.physical_type == BOOLEAN:
        if pos + 4 > vend:
            raise ValueError("RLE boolean data lacks its length prefix")
        ln = _u32(body, pos)[0]
        if pos + 4 + ln > vend:
            raise ValueError("RLE boolean data runs past the page")
        vals = decode_hybrid(body, pos + 4, pos + 4 + ln, 1, n_present).astype(bool)
        if early:
            vals = vals[np.asarray(select, np.int64)]
        dict_mode = False
    else:
        raise UnsupportedError(f"encoding {ENCODING_NAMES.get(enc, enc)} is not supported")

    if not col.is_list:
        if early:
            k = len(select)
            arr = _dict_to_arrow(col, dictionary, idx, None, k) if dict_mode else _values_to_arrow(col, vals, None, k)
            return _finish_type(arr, col.arrow_type)
        valid = present if (present is not None and n_present != n) else None
        arr = _dict_to_arrow(col, dictionary, idx, valid, n) if dict_mode else _values_to_arrow(col, vals, valid, n)
        arr = _finish_type(arr, col.arrow_type)
        return arr if select is None else arr.take(int64_array(select))

    # one level of list: rows start where rep == 0; items exist where def >= item_def
    d = dfn if dfn is not None else np.full(n, col.max_def, np.int64)
    row_start = rep == 0
    n_rows = int(np.count_nonzero(row_start))
    row_of = np.cumsum(row_start) - 1
    is_item = d >= col.item_def
    item_rows = row_of[is_item]
    counts = np.bincount(item_rows, minlength=n_rows) if n_rows else np.zeros(0, np.int64)
    offsets = np.zeros(n_rows + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    list_valid = None
    if col.list_def > 0:
        lv = d[row_start] >= col.list_def
        if not lv.all():
            list_valid = lv
    n_items = int(offsets[-1])
    item_valid = None
    if col.max_def > col.item_def:
        iv = d[is_item] == col.max_def
        if not iv.all():
            item_valid = iv
    items = _dict_to_arrow(col, dictionary, idx, item_valid, n_items) if dict_mode else _values_to_arrow(col, vals, item_valid, n_items)
    if n_items >= (1 << 31):
        raise UnsupportedError("page has more than 2^31 list items")
    vb, nulls = _validity(list_valid)
    arr = pa.Array.from_buffers(pa.list_(items.type), n_rows, [vb, pa.py_buffer(offsets.astype(np.int32))],
                                null_count=nulls, children=[items])
    arr = _finish_type(arr, col.arrow_type)
    return arr if select is None else arr.take(int64_array(select))


def _native_encoding(col: ColumnInfo, encoding: int) -> bool:
    return encoding in (PLAIN, PLAIN_DICTIONARY, RLE_DICTIONARY) or (encoding == RLE and col.physical_type == BOOLEAN)


def page_rows(col: ColumnInfo, header: PageHeader, raw, codec: int) -> int:
    """Rows a data page holds (a v1 page of a list column counts its repetition levels equal to 0)."""
    if header.type == DATA_PAGE_V2 and header.num_rows is not None:
        return int(header.num_rows)
    return count_rows_v1(col, header, raw, codec)


def arrow_decode_page(col: ColumnInfo, page, codec: int, dictionary: Dictionary | None, rows: int) -> pa.Array:
    """Decode one stored data page (``page``: header + body, as in the file) with Arrow's own C++
    decoders: the page (after its stored dictionary page, if any) goes into a one-page in-memory
    file whose schema is the column's leaf path (:attr:`ColumnInfo.leaf_schema`). Serves what the
    numpy path does not: DELTA_BINARY_PACKED, DELTA_LENGTH_BYTE_ARRAY, DELTA_BYTE_ARRAY,
    BYTE_STREAM_SPLIT and any other encoding Arrow knows, and lists of lists."""
    h = parse_page_header(page, 0)
    prefix = dictionary.raw if dictionary is not None and dictionary.raw is not None else b""
    if h.encoding in (PLAIN_DICTIONARY, RLE_DICTIONARY) and not prefix:
        raise ValueError("dictionary-encoded page but the column chunk has no dictionary page")
    total = len(prefix) + len(page)
    leaf_path = _leaf_path_names(col.leaf_schema)
    chunk_meta = [(1, th.I32, col.physical_type),
                  (2, th.LIST, (th.I32, sorted({h.encoding, RLE} | ({PLAIN, RLE_DICTIONARY} if prefix else set())))),
                  (3, th.LIST, (th.BINARY, leaf_path)), (4, th.I32, codec), (5, th.I64, h.num_values),
                  (6, th.I64, max(total, len(prefix) + h.header_len + h.uncompressed_size)), (7, th.I64, total),
                  (9, th.I64, 4 + len(prefix))]
    if prefix:
        chunk_meta.append((11, th.I64, 4))
    m = th.CompactWriter()
    m.struct([(1, th.I32, 1), (2, th.LIST, col.leaf_schema), (3, th.I64, rows),
              (4, th.LIST, (th.STRUCT, [[(1, th.LIST, (th.STRUCT, [[(2, th.I64, 4), (3, th.STRUCT, chunk_meta)]])),
                                         (2, th.I64, total), (3, th.I64, rows)]]))])
    f = b"".join([MAGIC, prefix, bytes(page), bytes(m.out), struct.pack("<I", len(m.out)), MAGIC])
    try:
        arr = pq.ParquetFile(pa.BufferReader(f), pre_buffer=False).read(use_threads=False).column(0).combine_chunks()
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"Arrow cannot decode the {ENCODING_NAMES.get(h.encoding, h.encoding)} page ({e})") from None
    if len(arr) != rows:
        raise ValueError(f"page decoded to {len(arr)} rows, expected {rows}")
    for _ in range(col.struct_depth):  # meta.url: the struct's one field, null where the struct is
        arr = arr.flatten()[0]
    return _finish_type(arr, col.arrow_type)


def _leaf_path_names(leaf_schema: bytes) -> list[bytes]:
    r = th.CompactReader(leaf_schema)
    elems = r.list(0)
    return [e[4] for e in elems[1:]]


def count_rows_v1(col: ColumnInfo, header: PageHeader, raw, codec: int) -> int:
    """Rows in a page: what the header says, or (v1 pages of list columns) rep levels equal to 0."""
    if header.type == DATA_PAGE_V2:
        return int(header.num_rows)
    if not col.max_rep:
        return int(header.num_values)
    body = decompress(codec, raw, header.uncompressed_size)
    rep, _ = _levels_v1(body, 0, col.max_rep, header.num_values, header.rep_encoding)
    return int(np.count_nonzero(rep == 0))


def first_rep_level(col: ColumnInfo, header: PageHeader, raw, codec: int) -> int:
    """The first repetition level of a page (0 = the page starts a new row)."""
    if not col.max_rep or header.num_values == 0:
        return 0
    if header.type == DATA_PAGE_V2:
        rep = decode_hybrid(memoryview(raw), 0, header.rep_len, col.max_rep.bit_length(), 1)
    else:
        body = decompress(codec, raw, header.uncompressed_size)
        rep, _ = _levels_v1(body, 0, col.max_rep, 1, header.rep_encoding)
    return int(rep[0])


# ----------------------------------------------------------------------------------------------
# reading a run of pages


def check_crc(header: PageHeader, raw) -> None:
    if header.crc is not None:
        got = zlib.crc32(raw) & 0xFFFFFFFF
        if got != header.crc:
            raise ChecksumError(f"page CRC mismatch (stored {header.crc:#010x}, computed {got:#010x})")


def read_dictionary(col: ColumnInfo, buf: bytes, codec: int, *, verify_crc: bool = True) -> Dictionary:
    """Decode a dictionary page from its bytes (header included)."""
    h = parse_page_header(buf, 0)
    if h.type != DICTIONARY_PAGE:
        raise ValueError(f"expected a dictionary page, found page type {h.type}")
    raw = memoryview(buf)[h.header_len : h.header_len + h.compressed_size]
    if len(raw) != h.compressed_size:
        raise ValueError("dictionary page runs past the bytes read")
    if verify_crc:
        check_crc(h, raw)
    if not col.native:
        return decode_dictionary_page(col, h, None, raw=memoryview(buf)[: h.header_len + h.compressed_size])
    return decode_dictionary_page(col, h, decompress(codec, raw, h.uncompressed_size))


def decode_page_run(col: ColumnInfo, buf: bytes, codec: int, dictionary, *,
                    verify_crc: bool = True, expect_rows: int | None = None,
                    select: np.ndarray | None = None) -> list[pa.Array]:
    """Decode consecutive data pages filling ``buf`` exactly (headers included). Dictionary pages
    met on the way replace ``dictionary``. ``dictionary`` may be a callable returning it: it is
    then called only if a dictionary-encoded page needs it (writers fall back to PLAIN once the
    dictionary is full, so most pages of a text column never need theirs). With ``select``
    (ascending row indices within the run) only those rows are returned. Raises on any
    inconsistency; the caller adds context."""
    out: list[pa.Array] = []
    pos, end = 0, len(buf)
    mv = memoryview(buf)
    rows = 0
    while pos < end:
        h = parse_page_header(buf, pos)
        body_start = pos + h.header_len
        body_end = body_start + h.compressed_size
        if body_end > end:
            raise ValueError(f"page at byte {pos} of the run claims {h.compressed_size} bytes, only {end - body_start} remain")
        raw = mv[body_start:body_end]
        if verify_crc:
            check_crc(h, raw)
        if h.type == DICTIONARY_PAGE:
            dictionary = decode_dictionary_page(col, h, None if not col.native else decompress(codec, raw, h.uncompressed_size),
                                                raw=mv[pos:body_end])
        elif h.type in (DATA_PAGE, DATA_PAGE_V2):
            if callable(dictionary) and h.encoding in (PLAIN_DICTIONARY, RLE_DICTIONARY):
                dictionary = dictionary()
            d = None if callable(dictionary) else dictionary
            if not col.native or not _native_encoding(col, h.encoding):
                n_rows = page_rows(col, h, raw, codec)
                arr = arrow_decode_page(col, mv[pos:body_end], codec, d, n_rows)
                rows += n_rows
            elif select is not None and not out and body_end == end and not col.is_list:
                # the run is this one page: select while decoding (a non-list page has one value per row)
                arr = decode_data_page(col, h, raw, codec, d, select)
                rows += h.num_values
                select = None
            else:
                arr = decode_data_page(col, h, raw, codec, d)
                rows += len(arr)
            out.append(arr)
        elif h.type == INDEX_PAGE:
            pass
        else:
            raise ValueError(f"unknown page type {h.type}")
        pos = body_end
    if expect_rows is not None and rows != expect_rows:
        raise ValueError(f"pages hold {rows} rows, the index says {expect_rows}")
    if select is not None:
        whole = out[0] if len(out) == 1 else pa.concat_arrays(out)
        out = [whole.take(int64_array(select))]
    return out



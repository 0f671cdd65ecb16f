"""A Parquet file's metadata: its footer (schema, row groups, column chunks), the projection of named columns onto
its leaves (how each is decoded and the Arrow type it is delivered as), the OffsetIndex of a column chunk, and the
header of each page. Everything that is parsed from Thrift before any page is decompressed lives here, so that the
index scan and the page decoders share one reading of the format."""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from mixplane.loader.parquet import thrift as th
from mixplane.loader.parquet.errors import CorruptFileError, EmptyFileError, MissingColumnError, UnsupportedError
from mixplane.loader.parquet.format import (
    BOOLEAN, BYTE_ARRAY, DATA_PAGE, DATA_PAGE_V2, DICTIONARY_PAGE, DOUBLE, FIXED_LEN_BYTE_ARRAY, FLOAT, INT32, INT64, MAGIC,
    PLAIN, REPEATED, REQUIRED, RLE, type_name,
)
from mixplane.loader.parquet.io import RangeReader
from mixplane.loader.parquet.thrift import ThriftError, read_struct

_NATURAL_ARROW = {BOOLEAN: pa.bool_(), INT32: pa.int32(), INT64: pa.int64(), FLOAT: pa.float32(), DOUBLE: pa.float64()}
_u32 = struct.Struct("<I").unpack_from


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
    logical_type: dict[int, Any] | None
    children: list[SchemaNode] = field(default_factory=list)


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

    def signature(self) -> tuple[int, int, int, int, str]:
        return (self.physical_type, self.type_length, self.max_def, self.max_rep, str(self.arrow_type))


Leaf = tuple[tuple[str, ...], SchemaNode, int, int]  # (path, node, max_def, max_rep)


@dataclass
class FileMeta:
    path: str
    size: int
    num_rows: int
    row_groups: list[RowGroupMeta]
    schema: SchemaNode
    leaves: list[Leaf]
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


def _int(v: object, what: str) -> int:
    """v if it is an integer: a footer's field of another type is a corrupt footer, not a TypeError later."""
    if type(v) is not int:
        raise ThriftError(f"{what} is {type(v).__name__}, not an integer")
    return v


def _opt_int(v: object, what: str) -> int | None:
    """:func:`_int` of an optional field (absent: None)."""
    return None if v is None else _int(v, what)


def _file_meta(path: str, size: int, fm: dict[int, Any]) -> FileMeta:
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
                          physical_type=_opt_int(e.get(1), "type"), type_length=_opt_int(e.get(2), "type_length"),
                          converted_type=_opt_int(e.get(6), "converted_type"), logical_type=lt)
        for _ in range(_int(e.get(5, 0) or 0, "num_children")):
            node.children.append(build())
        return node

    root = build()
    leaves: list[Leaf] = []

    def walk(node: SchemaNode, path: tuple[str, ...], d: int, r: int) -> None:
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
                                  dictionary_page_offset=_opt_int(md.get(11), "dictionary_page_offset"),
                                  total_compressed_size=_int(md[7], "total_compressed_size"),
                                  total_uncompressed_size=_int(md.get(6, md[7]), "total_uncompressed_size"),
                                  offset_index_offset=_opt_int(cc.get(4), "offset_index_offset"),
                                  offset_index_length=_opt_int(cc.get(5), "offset_index_length"),
                                  encodings=list(md.get(2, []))))
        if len(cols) != len(leaves):
            raise ThriftError(f"row group has {len(cols)} column chunks, schema has {len(leaves)} leaves")
        rgs.append(RowGroupMeta(num_rows=_int(rg[3], "a row group's num_rows"), columns=cols))
    return FileMeta(path=path, size=size, num_rows=_int(fm.get(3, 0), "num_rows"), row_groups=rgs, schema=root, leaves=leaves,
                    arrow_schema=_arrow_schema(fm.get(5, []) or []))


def _arrow_schema(key_values: list[dict[int, Any]]) -> pa.Schema | None:
    """The writer's ARROW:schema (the Arrow types of the columns), or None when absent or damaged: the types
    Parquet itself declares are then delivered, so a damaged copy costs only the logical types."""
    arrow_schema = None
    for kv in key_values:
        if kv.get(1) == b"ARROW:schema" and kv.get(2):
            try:
                v = kv[2]
                arrow_schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(v + b"=" * (-len(v) % 4))))
                arrow_schema.names  # noqa: B018  (a damaged one may fail only here: its names not UTF-8)
            except (ValueError, TypeError, OSError, pa.ArrowException):  # (base64, IPC, UTF-8: each a damaged copy)
                arrow_schema = None
    return arrow_schema


def _is_string(node: SchemaNode) -> bool:
    lt = node.logical_type or {}
    return node.converted_type in (0, 4) or any(k in lt for k in (1, 4, 5))  # UTF8/ENUM/JSON | STRING/ENUM/JSON


def _natural_type(node: SchemaNode) -> pa.DataType:
    pt = node.physical_type
    if pt == BYTE_ARRAY:
        return pa.string() if _is_string(node) else pa.binary()
    if pt == FIXED_LEN_BYTE_ARRAY:
        return pa.binary(node.type_length or 0)
    if pt is not None and pt in _NATURAL_ARROW:
        return _NATURAL_ARROW[pt]
    raise UnsupportedError(f"physical type {type_name(pt)} is not supported")


def _find_column(meta: FileMeta, name: str) -> tuple[list[SchemaNode], list[int]]:
    """Schema nodes from the top-level column down to ``name`` (a top-level name, or a dotted path to a
    field of a struct: ``meta.url``) and the leaf indexes under it; raises MissingColumnError."""
    tops = {c.name: c for c in meta.schema.children}
    parts = [name] if name in tops else name.split(".")
    chain: list[SchemaNode] = []
    n = meta.schema
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
    elems: list[list[th.Field]] = [[(4, th.BINARY, "schema"), (5, th.I32, 1)]]
    for nd in chain:
        f: list[th.Field]
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
    w.value(th.LIST, (th.STRUCT, elems))
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
        full: list[SchemaNode] = []
        n = meta.schema
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
        physical_type = node.physical_type
        if physical_type is None:  # (a leaf without one was refused just above; this narrows the type)
            raise UnsupportedError("the leaf has no physical type", file=meta.path, column=name)
        natural = value_type
        for _ in range(max_rep):
            natural = pa.list_(natural)
        arrow_type = _arrow_field_type(meta.arrow_schema, name) or natural
        out.append(ColumnInfo(name=name, leaf=leaf_i, physical_type=physical_type, type_length=node.type_length or 0,
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


def parse_page_header(buf: bytes | bytearray | memoryview, pos: int = 0) -> PageHeader:
    """Parse the Thrift PageHeader at ``pos``; raises ThriftError / ValueError when malformed."""
    h, end = read_struct(buf, pos)
    try:
        return _page_header(h, pos, end)
    except (TypeError, AttributeError, IndexError) as e:  # a field of another type (a damaged header)
        raise ThriftError(f"malformed page header ({type(e).__name__}: {e})") from None


def _page_header(h: dict[int, Any], pos: int, end: int) -> PageHeader:
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

"""Parquet data pages: levels, one page decoded to an Arrow array (numpy for what training data mostly holds, Arrow's
own decoders on a one-page file for every other encoding and for lists of lists), CRC checks, and a run of
consecutive pages (dictionary pages met on the way) decoded in one call, the unit the loader reads."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mixplane.loader.parquet import thrift as th
from mixplane.loader.parquet.encodings import (
    Buffer, Dictionary, Values, decode_dictionary_page, decode_hybrid, decode_plain, decompress, dict_to_arrow, finish_type,
    int64_array, validity, values_to_arrow,
)
from mixplane.loader.parquet.errors import ChecksumError, UnsupportedError
from mixplane.loader.parquet.format import (
    BOOLEAN, DATA_PAGE, DATA_PAGE_V2, DICTIONARY_PAGE, INDEX_PAGE, MAGIC, PLAIN, PLAIN_DICTIONARY, RLE, RLE_DICTIONARY,
    UNCOMPRESSED, encoding_name,
)
from mixplane.loader.parquet.metadata import ColumnInfo, PageHeader, parse_page_header

_u32 = struct.Struct("<I").unpack_from


def _levels_v1(body: Buffer, pos: int, max_level: int, n: int, encoding: int) -> tuple[np.ndarray, int]:
    if encoding != RLE:
        raise UnsupportedError(f"level encoding {encoding_name(encoding)} is not supported")
    if pos + 4 > len(body):
        raise ValueError("level length prefix runs past the page")
    ln = _u32(body, pos)[0]
    pos += 4
    if pos + ln > len(body):
        raise ValueError(f"levels ({ln} bytes) run past the page")
    bw = max_level.bit_length()
    lv = decode_hybrid(body, pos, pos + ln, bw, n)
    return lv, pos + ln


def decode_data_page(col: ColumnInfo, header: PageHeader, raw: Buffer, codec: int, dictionary: Dictionary | None,
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
    sel = np.asarray(select, np.int64) if early else None
    dic: Dictionary | None = None  # set for a dictionary-encoded page: its values are indexes into it
    vals: Values
    idx: np.ndarray
    if enc == PLAIN:
        vals = decode_plain(col, body, pos, vend, n_present, sel)
        if sel is not None and not isinstance(vals, tuple):  # (BYTE_ARRAY values were selected while decoded)
            vals = vals[sel]
    elif enc in (PLAIN_DICTIONARY, RLE_DICTIONARY):
        if dictionary is None:
            raise ValueError("dictionary-encoded page but the column chunk has no dictionary page")
        dic = dictionary
        if pos >= vend and n_present:
            raise ValueError("dictionary index data missing")
        bw = body[pos] if n_present else 0
        idx = decode_hybrid(body, pos + 1, vend, bw, n_present) if n_present else np.zeros(0, np.int64)
        if sel is not None:
            idx = idx[sel]
    elif enc == RLE and col.physical_type == BOOLEAN:
        if pos + 4 > vend:
            raise ValueError("RLE boolean data lacks its length prefix")
        ln = _u32(body, pos)[0]
        if pos + 4 + ln > vend:
            raise ValueError("RLE boolean data runs past the page")
        bools = decode_hybrid(body, pos + 4, pos + 4 + ln, 1, n_present).astype(bool)
        vals = bools if sel is None else bools[sel]
    else:
        raise UnsupportedError(f"encoding {encoding_name(enc)} is not supported")

    if not col.is_list:
        if sel is not None:
            k = len(sel)
            arr = dict_to_arrow(col, dic, idx, None, k) if dic is not None else values_to_arrow(col, vals, None, k)
            return finish_type(arr, col.arrow_type)
        valid = present if (present is not None and n_present != n) else None
        arr = dict_to_arrow(col, dic, idx, valid, n) if dic is not None else values_to_arrow(col, vals, valid, n)
        arr = finish_type(arr, col.arrow_type)
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
    items = dict_to_arrow(col, dic, idx, item_valid, n_items) if dic is not None else values_to_arrow(col, vals, item_valid, n_items)
    if n_items >= (1 << 31):
        raise UnsupportedError("page has more than 2^31 list items")
    vb, nulls = validity(list_valid)
    arr = pa.Array.from_buffers(pa.list_(items.type), n_rows, [vb, pa.py_buffer(offsets.astype(np.int32))],
                                null_count=nulls, children=[items])
    arr = finish_type(arr, col.arrow_type)
    return arr if select is None else arr.take(int64_array(select))


def _native_encoding(col: ColumnInfo, encoding: int) -> bool:
    return encoding in (PLAIN, PLAIN_DICTIONARY, RLE_DICTIONARY) or (encoding == RLE and col.physical_type == BOOLEAN)


def page_rows(col: ColumnInfo, header: PageHeader, raw: Buffer, codec: int) -> int:
    """Rows a data page holds (a v1 page of a list column counts its repetition levels equal to 0)."""
    if header.type == DATA_PAGE_V2 and header.num_rows is not None:
        return int(header.num_rows)
    return count_rows_v1(col, header, raw, codec)


def arrow_decode_page(col: ColumnInfo, page: Buffer, codec: int, dictionary: Dictionary | None, rows: int) -> pa.Array:
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
        raise ValueError(f"Arrow cannot decode the {encoding_name(h.encoding)} page ({e})") from None
    if len(arr) != rows:
        raise ValueError(f"page decoded to {len(arr)} rows, expected {rows}")
    for _ in range(col.struct_depth):  # meta.url: the struct's one field, null where the struct is
        arr = arr.flatten()[0]
    return finish_type(arr, col.arrow_type)


def _leaf_path_names(leaf_schema: bytes) -> list[bytes]:
    r = th.CompactReader(leaf_schema)
    elems = r.list(0)
    return [e[4] for e in elems[1:]]


def count_rows_v1(col: ColumnInfo, header: PageHeader, raw: Buffer, codec: int) -> int:
    """Rows in a page: what the header says, or (v1 pages of list columns) rep levels equal to 0."""
    if header.type == DATA_PAGE_V2:
        if header.num_rows is None:
            raise ValueError("data page v2 header without num_rows")
        return int(header.num_rows)
    if not col.max_rep:
        return int(header.num_values)
    body = decompress(codec, raw, header.uncompressed_size)
    rep, _ = _levels_v1(body, 0, col.max_rep, header.num_values, header.rep_encoding)
    return int(np.count_nonzero(rep == 0))


def first_rep_level(col: ColumnInfo, header: PageHeader, raw: Buffer, codec: int) -> int:
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


def check_crc(header: PageHeader, raw: Buffer) -> None:
    if header.crc is not None:
        got = zlib.crc32(raw) & 0xFFFFFFFF
        if got != header.crc:
            raise ChecksumError(f"page CRC mismatch (stored {header.crc:#010x}, computed {got:#010x})")


def read_dictionary(col: ColumnInfo, buf: Buffer, codec: int, *, verify_crc: bool = True) -> Dictionary:
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


def decode_page_run(col: ColumnInfo, buf: Buffer, codec: int,
                    dictionary: Dictionary | Callable[[], Dictionary | None] | None, *,
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



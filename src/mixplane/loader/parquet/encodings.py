"""Parquet's value encodings, decoded with numpy: decompression (cramjam), the RLE / bit-packed hybrid of levels and
dictionary indexes, PLAIN values of every physical type, dictionary pages, and the Arrow arrays built from them.
Adding an encoding the numpy path decodes means a decoder here and a case in :func:`pages.decode_data_page`; one it
does not goes to Arrow's decoders (:func:`pages.arrow_decode_page`) without code here."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Union

import cramjam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mixplane.loader.parquet import thrift as th
from mixplane.loader.parquet.errors import UnsupportedError
from mixplane.loader.parquet.format import (
    BOOLEAN, BROTLI, BYTE_ARRAY, DATA_PAGE, DOUBLE, FIXED_LEN_BYTE_ARRAY, FLOAT, GZIP, INT32, INT64, LZ4_RAW, MAGIC, PLAIN,
    PLAIN_DICTIONARY, RLE, SNAPPY, TYPE_NAMES, UNCOMPRESSED, ZSTD, codec_name, encoding_name,
)
from mixplane.loader.parquet.metadata import ColumnInfo, PageHeader

# a page's bytes: as read (bytes), a slice of a run (memoryview) or decompressed into Arrow's pool (pa.Buffer)
Buffer = Union[bytes, bytearray, memoryview, pa.Buffer]
# PLAIN values: a numpy array of fixed-width values, or (offsets, bytes) of BYTE_ARRAY values
Values = Union[np.ndarray, tuple[np.ndarray, np.ndarray]]

_FIXED_DTYPES: dict[int, np.dtype[Any]] = {INT32: np.dtype("<i4"), INT64: np.dtype("<i8"), FLOAT: np.dtype("<f4"), DOUBLE: np.dtype("<f8")}
_u32 = struct.Struct("<I").unpack_from


def decompress(codec: int, data: Buffer, size: int) -> Buffer:
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
            raise UnsupportedError(f"codec {codec_name(codec)} is not supported")
    except UnsupportedError:
        raise
    except (cramjam.DecompressionError, ValueError, TypeError) as e:  # damaged data, or an output of another size
        raise ValueError(f"{codec_name(codec)} decompression failed: {e}") from None
    if n != size:
        raise ValueError(f"page decompressed to {n} bytes, header says {size}")
    return out


def int64_array(x: Any) -> pa.Array:
    """An Arrow int64 array of ``x`` (e.g. take indices), built without ``pa.array``: that one
    imports pandas on first use whenever pandas is installed (~30 MB for a loader process)."""
    a = np.ascontiguousarray(x, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(a), [None, pa.py_buffer(a)])


def _alloc(n: int) -> Buffer:
    """A writable buffer from Arrow's memory pool: page-sized allocations come and go all the time,
    and the pool gives them back to the system far better than the C heap does."""
    return pa.allocate_buffer(max(n, 0), resizable=False) if n else bytearray(0)


# ----------------------------------------------------------------------------------------------
# RLE / bit-packed hybrid


def unpack_bits(data: Buffer, bit_width: int, count: int) -> np.ndarray:
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


def decode_hybrid(buf: Buffer, pos: int, end: int, bit_width: int, count: int) -> np.ndarray:
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
    bp_chunks: list[memoryview] = []
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


def _plain_page_file(body: Buffer, n: int) -> bytes:
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


def _plain_byte_array(buf: Buffer, pos: int, end: int, n: int, select: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Offsets (int64, n+1) and the concatenated bytes (uint8) of n PLAIN BYTE_ARRAY values
    (only of the values at ``select``, ascending indices, when given). Each value's offset depends
    on the previous length, so no numpy pass finds them: a page of many values goes through Arrow's
    reader on a one-page file, a page of few values through a short loop (bounded per page)."""
    if n <= PLAIN_LOOP_MAX_VALUES:
        return _plain_byte_array_loop(buf, pos, end, n, select)
    return _plain_byte_array_arrow(buf, pos, end, n, select)


def _plain_byte_array_loop(buf: Buffer, pos: int, end: int, n: int, select: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
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


def _plain_byte_array_arrow(buf: Buffer, pos: int, end: int, n: int, select: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
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
    vb, nulls = validity(valid)
    return pa.Array.from_buffers(typ, n, [vb, pa.py_buffer(offs), pa.py_buffer(data)], null_count=nulls)


def validity(valid: np.ndarray | None) -> tuple[pa.Buffer | None, int]:
    """An Arrow validity bitmap of ``valid`` and the null count (no bitmap when nothing is null)."""
    if valid is None:
        return None, 0
    nulls = int(len(valid) - np.count_nonzero(valid))
    if nulls == 0:
        return None, 0
    return pa.py_buffer(np.packbits(valid, bitorder="little")), nulls


def decode_plain(col: ColumnInfo, buf: Buffer, pos: int, end: int, n: int, select: np.ndarray | None = None) -> Values:
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
    values: np.ndarray | pa.Array | None  # numpy array (fixed width) or pa.Array (byte arrays); None when only ``raw`` is kept
    size: int
    nbytes: int
    raw: bytes | None = None  # the page as stored (header included): columns decoded by Arrow need it


def decode_dictionary_page(col: ColumnInfo, header: PageHeader, body: Buffer | None, raw: Buffer | None = None) -> Dictionary:
    """Decoded dictionary values; for a column Arrow decodes (:attr:`ColumnInfo.native` false) only
    the stored page ``raw`` (header included), which Arrow reads with the data pages."""
    if not col.native:
        if raw is None:
            raise ValueError("dictionary page of a nested column without its stored bytes")
        return Dictionary(None, header.num_values, len(raw), bytes(raw))
    if body is None:
        raise ValueError("dictionary page of a flat column without its decompressed values")
    if header.encoding not in (PLAIN, PLAIN_DICTIONARY):
        raise UnsupportedError(f"dictionary page encoding {encoding_name(header.encoding)}")
    n = header.num_values
    vals = decode_plain(col, body, 0, len(body), n)
    if col.physical_type == BYTE_ARRAY:
        offsets, data = vals
        arr = _binary_array(offsets, data, None, pa.types.is_string(col.value_type) or pa.types.is_large_string(col.value_type))
        return Dictionary(arr, n, arr.nbytes)
    vals = np.array(vals)  # own the memory: the page buffer is released
    return Dictionary(vals, n, vals.nbytes)


def values_to_arrow(col: ColumnInfo, vals: Values, valid: np.ndarray | None, n_slots: int) -> pa.Array:
    """Arrow array of n_slots slots from the present values and a validity mask."""
    pt = col.physical_type
    if isinstance(vals, tuple):  # BYTE_ARRAY: (offsets, bytes)
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
        vb, nulls = validity(valid)
        return pa.Array.from_buffers(pa.binary(w), n_slots, [vb, pa.py_buffer(np.ascontiguousarray(full))], null_count=nulls)
    if pt == BOOLEAN:
        full = vals
        if valid is not None and len(vals) != n_slots:
            full = np.zeros(n_slots, bool)
            full[valid] = vals
        vb, nulls = validity(valid)
        return pa.Array.from_buffers(pa.bool_(), n_slots, [vb, pa.py_buffer(np.packbits(full, bitorder="little"))],
                                     null_count=nulls)
    full = vals
    if valid is not None and len(vals) != n_slots:
        full = np.zeros(n_slots, vals.dtype)
        full[valid] = vals
    vb, nulls = validity(valid)
    return pa.Array.from_buffers(col.value_type, n_slots, [vb, pa.py_buffer(np.ascontiguousarray(full))], null_count=nulls)


def dict_to_arrow(col: ColumnInfo, d: Dictionary, idx: np.ndarray, valid: np.ndarray | None, n_slots: int) -> pa.Array:
    if len(idx) and (idx.max() >= d.size or idx.min() < 0):
        raise ValueError(f"dictionary index {int(idx.max())} out of range (dictionary has {d.size} values)")
    if d.values is None:
        raise ValueError("dictionary page kept only as stored bytes (for Arrow's decoders) met by the numpy path")
    if col.physical_type == BYTE_ARRAY:
        full = idx
        if valid is not None and len(idx) != n_slots:
            full = np.zeros(n_slots, np.int64)
            full[valid] = idx
        vb, nulls = validity(valid)
        ind = pa.Array.from_buffers(pa.int32(), n_slots, [vb, pa.py_buffer(full.astype(np.int32))], null_count=nulls)
        return d.values.take(ind)
    return values_to_arrow(col, d.values[idx], valid, n_slots)


def finish_type(arr: pa.Array, target: pa.DataType) -> pa.Array:
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


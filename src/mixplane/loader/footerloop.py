"""Compiled (numba) parse of Parquet footers and OffsetIndexes into flat arrays, for indexing many files.

At 10^5 files a cold start spent most of each loader's CPU decoding footers and OffsetIndexes into Python dicts
(``thrift.read_struct``: ~0.3 of the ~0.5 ms a file). The readable specification of what a file's index is stays
the Python path (``parquet.read_file_meta``, ``resolve_columns``, ``indexscan._scan_chunk``); this module is a
second implementation of its *common case* only, used by ``indexscan.index_file``:

* :func:`walk` -- one loop over the Thrift compact protocol, driven by a table of the fields wanted
  (:data:`FOOTER`: FileMetaData -> RowGroup -> ColumnChunk -> ColumnMetaData, KeyValue; OffsetIndex ->
  PageLocation): every struct met becomes a row of an int64 table (its kind, its parent's row, the integers and
  byte spans of its wanted fields, which fields were present); everything else is skipped with the checks the
  Python decoder makes. The footer's schema list and ``ARROW:schema`` value are returned as byte spans: files
  of one corpus share them, so the caller resolves a schema once (with the Python path) and keys it on them.
* :func:`chunks` -- the projected column chunks, with the checks ``index_file`` makes of them, and (walking
  their OffsetIndexes) the checks ``_scan_chunk`` makes of those, and each chunk's units.

Neither raises on bad input. Where the fast path does not do exactly what the specification does -- a truncated
or malformed struct, a wanted field of another type, missing or given twice, nesting deeper than 24, a varint of
2^64 or more, a MAP, an OffsetIndex missing, empty or inconsistent -- it answers ``False`` and the caller indexes
that file with the Python path, which decides (and words the error, naming the file). So the fast path need only
be right where it answers, which ``tests/unit/test_footerloop.py`` checks against the Python path on the writer
zoo, the start-up benchmark's files, and the same files truncated and with bytes flipped.
"""

from __future__ import annotations

import os
from typing import Any


from mixplane.numbacache import ensure_cache_dir  # noqa: E402

ensure_cache_dir(__file__)  # before numba is imported

import numpy as np  # noqa: E402
from numba import njit  # noqa: E402

# compact protocol types (thrift.py)
_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(13)
_MAX_LEVEL = 24  # structs and lists nested (the Python decoder refuses beyond 32)

# ---- the table: what to keep of which struct --------------------------------------------------------------
# A row of walk's output: [kind, parent row, fields...]. Kinds (structs):
FILE, ROW_GROUP, CHUNK, COLUMN_META, KEY_VALUE, OFFSET_INDEX, PAGE = range(7)
# columns of a row (per kind; MASK / META_MASK: the field ids present, bit = id)
KIND, PARENT = 0, 1
NUM_ROWS, SCHEMA_LO, SCHEMA_HI, MASK = 2, 3, 4, 5  # FILE (MASK: every kind's own)
RG_ROWS = 2  # ROW_GROUP
OI_OFF, OI_LEN, PHYS, CODEC, NUM_VALUES, UNCOMPRESSED, COMPRESSED, DATA_OFF, DICT_OFF, META_MASK = (
    2, 3, 6, 7, 8, 9, 10, 11, 12, 13)  # CHUNK, its ColumnMetaData's fields in the same row
KEY_LO, KEY_HI, VALUE_LO, VALUE_HI = 2, 3, 6, 7  # KEY_VALUE
PAGE_OFF, PAGE_SIZE, PAGE_FIRST = 2, 3, 6  # PAGE (PageLocation)
WIDTH = 14

# actions: 0 skip; 1-99 an integer into that column; 100 + k a struct of kind k in the same row; 200 + k a list
# of structs of kind k, each a new row; 300 + c the bytes of a list value (c, c + 1: from, to); 400 + c a binary
# value's bytes; 500 a list of anything, skipped
_SKIP, _INT, _SAME, _ROWS, _SPAN, _BIN, _ANYLIST = 0, 1, 100, 200, 300, 400, 500
_FIELDS = 16
_SPEC = {  # kind: ({field id: action}, required field ids, the mask's column)  -- parquet.thrift's numbering
    FILE: ({2: _SPAN + SCHEMA_LO, 3: NUM_ROWS, 4: _ROWS + ROW_GROUP, 5: _ROWS + KEY_VALUE}, (2,), MASK),
    ROW_GROUP: ({1: _ROWS + CHUNK, 3: RG_ROWS}, (1, 3), MASK),
    CHUNK: ({3: _SAME + COLUMN_META, 4: OI_OFF, 5: OI_LEN}, (3,), MASK),
    COLUMN_META: ({1: PHYS, 2: _ANYLIST, 4: CODEC, 5: NUM_VALUES, 6: UNCOMPRESSED, 7: COMPRESSED, 9: DATA_OFF,
                   11: DICT_OFF}, (1, 4, 5, 7, 9), META_MASK),
    KEY_VALUE: ({1: _BIN + KEY_LO, 2: _BIN + VALUE_LO}, (), MASK),
    OFFSET_INDEX: ({1: _ROWS + PAGE}, (1,), MASK),
    PAGE: ({1: PAGE_OFF, 2: PAGE_SIZE, 3: PAGE_FIRST}, (1, 2, 3), MASK),
}


def _tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    act = np.zeros((len(_SPEC), _FIELDS), np.int64)
    need = np.zeros(len(_SPEC), np.int64)
    maskcol = np.zeros(len(_SPEC), np.int64)
    for kind, (fields, required, mc) in _SPEC.items():
        for fid, a in fields.items():
            act[kind, fid] = a
        need[kind] = sum(1 << f for f in required)
        maskcol[kind] = mc
    return act, need, maskcol


ACT, REQUIRED, MASKCOL = _tables()


@njit(cache=True, nogil=True)
def _varint(buf, pos, end):
    """(value, position after it); position -1 when past `end`, longer than 10 bytes, or 2^64 or more."""
    result = np.uint64(0)
    shift = 0
    while True:
        if pos >= end:
            return np.uint64(0), -1
        b = np.uint64(buf[pos])
        pos += 1
        if shift == 63 and (b & np.uint64(0x7F)) > np.uint64(1):
            return np.uint64(0), -1
        result |= (b & np.uint64(0x7F)) << np.uint64(shift)
        if (b & np.uint64(0x80)) == np.uint64(0):
            return result, pos
        shift += 7
        if shift > 63:
            return np.uint64(0), -1


@njit(cache=True, nogil=True)
def _walk(buf, starts, ends, top, act, need, maskcol, out):
    F = _MAX_LEVEL + 1
    f_list = np.zeros(F, np.bool_)  # a list (else a struct)
    f_kind = np.zeros(F, np.int64)  # struct: its kind (-1: skipped); list: its elements' kind (-1: skipped)
    f_row = np.zeros(F, np.int64)  # the row its fields go to (and its span's)
    f_seen = np.zeros(F, np.int64)  # struct: wanted field ids met
    f_fid = np.zeros(F, np.int64)  # struct: the last field id
    f_left = np.zeros(F, np.int64)  # list: elements left
    f_et = np.zeros(F, np.int64)  # list: their type
    f_span = np.zeros(F, np.int64)  # the column where its end goes (-1: none)
    nrows = 0
    fail = (False, out, 0)
    for t in range(starts.shape[0]):
        pos = starts[t]
        end = ends[t]
        if nrows >= out.shape[0]:
            grown = np.zeros((2 * out.shape[0] + 8, out.shape[1]), np.int64)
            grown[: out.shape[0]] = out
            out = grown
        out[nrows, :] = 0
        out[nrows, KIND] = top
        out[nrows, PARENT] = -1
        sp = 1
        f_list[0] = False
        f_kind[0] = top
        f_row[0] = nrows
        f_seen[0] = 0
        f_fid[0] = 0
        f_span[0] = -1
        nrows += 1
        while sp > 0:
            k = sp - 1
            row = f_row[k]
            if f_list[k]:
                if f_left[k] == 0:
                    if f_span[k] >= 0:
                        out[row, f_span[k] + 1] = pos
                    sp -= 1
                    continue
                f_left[k] -= 1
                ct = f_et[k]
                elem = True
                a = _SKIP
                if f_kind[k] >= 0:  # a struct of a wanted kind: a new row
                    if nrows >= out.shape[0]:
                        grown = np.zeros((2 * out.shape[0] + 8, out.shape[1]), np.int64)
                        grown[: out.shape[0]] = out
                        out = grown
                    out[nrows, :] = 0
                    out[nrows, KIND] = f_kind[k]
                    out[nrows, PARENT] = row
                    a = _SAME + f_kind[k]
                    row = nrows
                    nrows += 1
            else:
                if pos >= end:
                    return fail
                h = np.int64(buf[pos])
                pos += 1
                ct = h & 0x0F
                if ct == _STOP:
                    kind = f_kind[k]
                    if kind >= 0:
                        if f_seen[k] & need[kind] != need[kind]:
                            return fail
                        out[row, maskcol[kind]] = f_seen[k]
                    if f_span[k] >= 0:
                        out[row, f_span[k] + 1] = pos
                    sp -= 1
                    continue
                if h >> 4:
                    fid = f_fid[k] + (h >> 4)
                else:
                    u, pos = _varint(buf, pos, end)
                    if pos < 0:
                        return fail
                    fid = np.int64(u >> np.uint64(1)) ^ -np.int64(u & np.uint64(1))
                f_fid[k] = fid
                elem = False
                a = _SKIP
                if f_kind[k] >= 0 and 0 <= fid < act.shape[1]:
                    a = act[f_kind[k], fid]
                    if a != _SKIP:
                        if f_seen[k] & (1 << fid):
                            return fail  # given twice: the Python decoder keeps the last; left to it
                        f_seen[k] |= 1 << fid
            # one value of type ct (a list element when elem: a bool there is a byte), for action a
            if _INT <= a < _SAME:
                if ct != _I16 and ct != _I32 and ct != _I64:
                    return fail
                u, pos = _varint(buf, pos, end)
                if pos < 0:
                    return fail
                out[row, a] = np.int64(u >> np.uint64(1)) ^ -np.int64(u & np.uint64(1))
                continue
            if _BIN <= a < _ANYLIST:
                if ct != _BINARY:
                    return fail
                u, pos = _varint(buf, pos, end)
                if pos < 0 or u > np.uint64(end - pos):
                    return fail
                out[row, a - _BIN] = pos
                out[row, a - _BIN + 1] = pos + np.int64(u)
                pos += np.int64(u)
                continue
            span = -1
            if _SPAN <= a < _BIN:
                if ct != _LIST:
                    return fail
                span = a - _SPAN
                out[row, span] = pos
            if _SAME <= a < _ROWS:
                if ct != _STRUCT:
                    return fail
            elif _ROWS <= a < _SPAN:
                if ct != _LIST:
                    return fail
            elif a == _ANYLIST:
                if ct != _LIST and ct != _SET:
                    return fail
            if ct == _STRUCT:
                if sp >= _MAX_LEVEL:
                    return fail
                f_list[sp] = False
                f_kind[sp] = a - _SAME if _SAME <= a < _ROWS else -1
                f_row[sp] = row
                f_seen[sp] = 0
                f_fid[sp] = 0
                f_span[sp] = span
                sp += 1
            elif ct == _LIST or ct == _SET:
                if sp >= _MAX_LEVEL or pos >= end:
                    return fail
                h = np.int64(buf[pos])
                pos += 1
                n = h >> 4
                et = h & 0x0F
                if n == 15:
                    u, pos = _varint(buf, pos, end)
                    if pos < 0 or u > np.uint64(end - pos):
                        return fail
                    n = np.int64(u)
                if n > end - pos:  # each element takes a byte at least
                    return fail
                kind = -1
                if _ROWS <= a < _SPAN:
                    if n and et != _STRUCT:
                        return fail
                    kind = a - _ROWS
                f_list[sp] = True
                f_kind[sp] = kind
                f_row[sp] = row
                f_left[sp] = n
                f_et[sp] = et
                f_span[sp] = span
                sp += 1
            elif ct == _I16 or ct == _I32 or ct == _I64:
                u, pos = _varint(buf, pos, end)
                if pos < 0:
                    return fail
            elif ct == _BINARY:
                u, pos = _varint(buf, pos, end)
                if pos < 0 or u > np.uint64(end - pos):
                    return fail
                pos += np.int64(u)
            elif ct == _TRUE or ct == _FALSE:
                if elem:
                    if pos >= end:
                        return fail
                    pos += 1
            elif ct == _BYTE:
                if pos >= end:
                    return fail
                pos += 1
            elif ct == _DOUBLE:
                if pos + 8 > end:
                    return fail
                pos += 8
            else:  # MAP (not in these structs), STOP as an element type, unknown types
                return fail
    return True, out, nrows


def walk(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, top: int,
         scratch: np.ndarray | None = None) -> tuple[bool, np.ndarray]:
    """The structs of kind ``top`` at ``buf[starts[i]:ends[i]]`` and the wanted structs in them, as rows of
    WIDTH int64 (see the column names above), in the order they start; (False, ...) where the Python path must
    decide."""
    out = scratch if scratch is not None else np.zeros((64, WIDTH), np.int64)
    ok, out, n = _walk(buf, starts, ends, top, ACT, REQUIRED, MASKCOL, out)
    return ok, out[:n]


# chunks' answers
OK, FALLBACK, NEED = 0, 1, 2
_CODEC_OK = (1 << 0) | (1 << 1) | (1 << 2) | (1 << 4) | (1 << 6) | (1 << 7)  # UNCOMPRESSED SNAPPY GZIP BROTLI ZSTD LZ4_RAW
_INT32_MAX = 2**31 - 1
# columns of a projected chunk's row (_select, _finish)
C_RG, C_CODEC, C_START, C_END, C_ROWS, C_RAW, C_OI, C_OI_END, C_UNITS, C_DICT_OFF, C_DICT_LEN = range(11)
_CW = 11


@njit(cache=True, nogil=True)
def _select(rows, leaves, leaf_i, phys, file_size, base, size):
    """(answer, lo, hi, chunks): the projected leaves' chunks of a footer's rows (from _walk), leaf by leaf over
    the row groups that hold rows, with the checks index_file makes of each; NEED when their OffsetIndexes
    [lo, hi) do not lie in the `size` bytes from `base` the caller holds."""
    none = np.zeros((0, _CW), np.int64)
    nrg = 0
    nch = 0
    total = 0
    for r in range(rows.shape[0]):
        if rows[r, KIND] == ROW_GROUP:
            nrg += 1
            if rows[r, RG_ROWS] < 0:
                return FALLBACK, 0, 0, none
            total += rows[r, RG_ROWS]
        elif rows[r, KIND] == CHUNK:
            nch += 1
    if rows[0, NUM_ROWS] == 0 or nrg == 0 or nch != nrg * leaves or total != rows[0, NUM_ROWS]:
        return FALLBACK, 0, 0, none
    rg_row = np.zeros(nrg, np.int64)  # each row group's row in `rows`
    chunk = np.zeros(nch, np.int64)  # each chunk's, row group by row group
    g = -1
    c = 0
    for r in range(rows.shape[0]):
        if rows[r, KIND] == ROW_GROUP:
            g += 1
            rg_row[g] = r
        elif rows[r, KIND] == CHUNK:
            if g < 0 or rows[r, PARENT] != rg_row[g] or c >= (g + 1) * leaves:
                return FALLBACK, 0, 0, none
            chunk[c] = r
            c += 1
    # the projected chunks' OffsetIndexes, in one span (as _hold_offset_indexes reads them)
    lo = -1
    hi = -1
    nproj = 0
    for ci in range(leaf_i.shape[0]):
        for g in range(nrg):
            r = chunk[g * leaves + leaf_i[ci]]
            o = rows[r, OI_OFF]
            n = rows[r, OI_LEN]
            if o != 0 and n != 0:
                if lo < 0 or o < lo:
                    lo = o
                if hi < 0 or o + n > hi:
                    hi = o + n
            if rows[rg_row[g], RG_ROWS] != 0:
                nproj += 1
    if lo < 0 or not (0 <= lo < hi <= file_size) or hi - lo > 16 << 20:
        return FALLBACK, 0, 0, none
    if lo < base or hi > base + size:
        return NEED, lo, hi, none
    out = np.zeros((nproj, _CW), np.int64)
    k = 0
    for ci in range(leaf_i.shape[0]):
        for g in range(nrg):
            rg_rows = rows[rg_row[g], RG_ROWS]
            if rg_rows == 0:
                continue
            r = chunk[g * leaves + leaf_i[ci]]
            codec = rows[r, CODEC]
            if rows[r, PHYS] != phys[ci] or codec < 0 or codec > 7 or not (_CODEC_OK >> codec) & 1:
                return FALLBACK, 0, 0, none
            d = rows[r, DICT_OFF]
            data_off = rows[r, DATA_OFF]
            start = d if (rows[r, META_MASK] >> 11) & 1 and 0 < d < data_off else data_off
            comp = rows[r, COMPRESSED]
            if start < 4 or comp > file_size - 8 - start:  # (start + comp > size - 8, without overflow)
                return FALLBACK, 0, 0, none
            o = rows[r, OI_OFF]
            n = rows[r, OI_LEN]
            if o == 0 or n <= 0:
                return FALLBACK, 0, 0, none
            out[k, C_RG] = g
            out[k, C_CODEC] = codec
            out[k, C_START] = start
            out[k, C_END] = start + comp
            out[k, C_ROWS] = rg_rows
            out[k, C_RAW] = rows[r, UNCOMPRESSED] if (rows[r, META_MASK] >> 6) & 1 else comp
            out[k, C_OI] = o - base
            out[k, C_OI_END] = o - base + n
            k += 1
    return OK, lo, hi, out


@njit(cache=True, nogil=True)
def _finish(ch, pl):
    """indexscan._scan_chunk's checks of each chunk's OffsetIndex (the rows `pl` _walk made of them) and the
    chunks' units: (True, [offset, size, rows] per unit), each chunk's unit count and dictionary span written
    into `ch`; False when a check fails (the Python path then raises, naming the file)."""
    nu = 0
    for r in range(pl.shape[0]):
        nu += pl[r, KIND] == PAGE
    units = np.zeros((nu, 3), np.int64)
    k = -1
    j = 0
    for r in range(pl.shape[0]):
        if pl[r, KIND] == OFFSET_INDEX:
            k += 1
            ch[k, C_UNITS] = 0
        else:
            units[j, 0] = pl[r, PAGE_OFF]
            units[j, 1] = pl[r, PAGE_SIZE]
            units[j, 2] = pl[r, PAGE_FIRST]
            ch[k, C_UNITS] += 1
            j += 1
    if k + 1 != ch.shape[0]:
        return False, units
    p = 0
    for i in range(ch.shape[0]):
        n = ch[i, C_UNITS]
        if n <= 0:
            return False, units
        q = p + n - 1
        start = ch[i, C_START]
        end = ch[i, C_END]
        rows = ch[i, C_ROWS]
        if units[p, 0] < start or units[p, 2] != 0:
            return False, units
        for u in range(p, q + 1):
            if units[u, 1] <= 0:
                return False, units
            if u < q and (units[u + 1, 0] <= units[u, 0] or units[u + 1, 2] < units[u, 2]):
                return False, units
        # (offsets >= start >= 4: end - off cannot overflow, off + size could)
        if units[q, 0] > end or units[q, 1] > end - units[q, 0] or units[q, 2] >= max(rows, 1):
            return False, units
        ch[i, C_DICT_OFF] = 0
        ch[i, C_DICT_LEN] = 0
        if units[p, 0] > start:
            if units[p, 0] - start > _INT32_MAX:
                return False, units  # (the Python path's int32 array refuses it)
            ch[i, C_DICT_OFF] = start
            ch[i, C_DICT_LEN] = units[p, 0] - start
        for u in range(p, q):  # first row index -> rows of the unit
            units[u, 2] = units[u + 1, 2] - units[u, 2]
        units[q, 2] = rows - units[q, 2]
        p = q + 1
    return True, units


def chunks(rows: np.ndarray, leaves: int, leaf_i: np.ndarray, phys: np.ndarray, file_size: int, buf: np.ndarray,
           base: int) -> tuple[int, int, int, np.ndarray | None, np.ndarray | None]:
    """The projected leaves' column chunks of a footer walked by :func:`walk` (row groups that hold rows, leaf by
    leaf) and their units, from the OffsetIndexes in ``buf`` (the file's bytes from ``base``): ``(OK, lo, hi,
    chunks, units)`` -- a row per chunk (columns C_RG ... C_DICT_LEN) and one per unit (offset, size, rows);
    ``(NEED, lo, hi, None, None)``: the OffsetIndexes lie in [lo, hi), not in ``buf``; ``(FALLBACK, ...)``: the
    Python path decides this file."""
    answer, lo, hi, ch = _select(rows, leaves, leaf_i, phys, file_size, base, buf.shape[0])
    if answer != OK:
        return answer, lo, hi, None, None
    ok, pl = walk(buf, ch[:, C_OI].copy(), ch[:, C_OI_END].copy(), OFFSET_INDEX,
                  np.zeros((8 * len(ch) + 8, WIDTH), np.int64))
    if not ok:
        return FALLBACK, lo, hi, None, None
    ok, units = _finish(ch, pl)
    return (OK if ok else FALLBACK), lo, hi, ch, units


def cached() -> bool:
    """Whether numba's cache holds this module's kernels (then loading them takes ~1 s, not compiling ~12 s);
    False when that cannot be told."""
    try:
        kernels: list[Any] = [_walk, _select, _finish]  # (numba's dispatchers: their cache is not typed)
        return all(os.path.exists(f._cache._cache_file._index_path) for f in kernels)
    except (AttributeError, OSError):
        return False

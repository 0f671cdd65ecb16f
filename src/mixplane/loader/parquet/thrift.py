"""A small reader for the Thrift compact protocol, enough for Parquet footers and page headers.

Structs decode to ``dict[field_id, value]``; lists to Python lists; binary to ``bytes``.
Unknown fields are kept (or skipped) generically, so newer writers' extra fields do not break us.
Every malformed input raises :class:`ThriftError` (truncation, bad type, absurd sizes, deep nesting).
"""

from __future__ import annotations

import struct
from typing import Any, Union

from mixplane.errors import MixplaneError

STOP, TRUE, FALSE, BYTE, I16, I32, I64, DOUBLE, BINARY, LIST, SET, MAP, STRUCT = range(13)
_MAX_DEPTH = 32
_MAX_CONTAINER = 1 << 28
_unpack_double = struct.Struct("<d").unpack_from

Buffer = Union[bytes, bytearray, memoryview]
Struct = dict[int, Any]  # a decoded struct: field id -> value
Field = tuple[int, int, Any]  # a field to write: (field id, compact type, value)


class ThriftError(MixplaneError, ValueError):
    """Malformed Thrift compact-protocol data."""


class CompactReader:
    """The generic decoder: every compact type, one method call per value. The fast path of footers and page
    headers (:func:`read_struct`) inlines the common types and falls back to this one for the rest."""

    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf: Buffer, pos: int = 0, end: int | None = None):
        self.buf = buf
        self.pos = pos
        self.end = len(buf) if end is None else end

    def _byte(self) -> int:
        if self.pos >= self.end:
            raise ThriftError("truncated thrift data")
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        buf, pos, end = self.buf, self.pos, self.end
        result = shift = 0
        while True:
            if pos >= end:
                raise ThriftError("truncated varint")
            b = buf[pos]
            pos += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                break
            shift += 7
            if shift > 63:
                raise ThriftError("varint too long")
        self.pos = pos
        return result

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def value(self, ctype: int, depth: int = 0) -> Any:
        if ctype == I32 or ctype == I64 or ctype == I16:
            return self.zigzag()
        if ctype == BINARY:
            n = self.varint()
            if n > self.end - self.pos:
                raise ThriftError(f"binary of {n} bytes runs past the end")
            v = bytes(self.buf[self.pos : self.pos + n])
            self.pos += n
            return v
        if ctype == STRUCT:
            return self.struct(depth + 1)
        if ctype == LIST or ctype == SET:
            return self.list(depth + 1)
        if ctype == TRUE:
            return True
        if ctype == FALSE:
            return False
        if ctype == BYTE:
            b = self._byte()
            return b - 256 if b > 127 else b
        if ctype == DOUBLE:
            if self.pos + 8 > self.end:
                raise ThriftError("truncated double")
            v = _unpack_double(self.buf, self.pos)[0]
            self.pos += 8
            return v
        if ctype == MAP:
            return self.map(depth + 1)
        raise ThriftError(f"unknown thrift type {ctype}")

    def list(self, depth: int) -> list[Any]:
        if depth > _MAX_DEPTH:
            raise ThriftError("thrift nesting too deep")
        h = self._byte()
        n, et = h >> 4, h & 0x0F
        if n == 15:
            n = self.varint()
        if n > _MAX_CONTAINER or n > (self.end - self.pos) * 8 + 8:
            raise ThriftError(f"list of {n} elements cannot fit")
        if et == TRUE or et == FALSE:  # bools in containers are one byte each
            return [self._byte() == 1 for _ in range(n)]
        return [self.value(et, depth) for _ in range(n)]

    def map(self, depth: int) -> dict[Any, Any]:
        if depth > _MAX_DEPTH:
            raise ThriftError("thrift nesting too deep")
        n = self.varint()
        if n == 0:
            return {}
        if n > _MAX_CONTAINER or n > self.end - self.pos:
            raise ThriftError(f"map of {n} entries cannot fit")
        h = self._byte()
        kt, vt = h >> 4, h & 0x0F
        out: dict[Any, Any] = {}
        for _ in range(n):
            k = self.value(kt, depth)
            if isinstance(k, (list, dict)):
                raise ThriftError("map key of a container type")
            out[k] = self.value(vt, depth)
        return out

    def struct(self, depth: int = 0) -> Struct:
        if depth > _MAX_DEPTH:
            raise ThriftError("thrift nesting too deep")
        out: Struct = {}
        fid = 0
        while True:
            h = self._byte()
            ctype = h & 0x0F
            if ctype == STOP:
                return out
            delta = h >> 4
            fid = fid + delta if delta else self.zigzag()
            out[fid] = self.value(ctype, depth)


def read_struct(buf: Buffer, pos: int = 0, end: int | None = None) -> tuple[Struct, int]:
    """Decode one struct starting at ``pos``; returns (struct, position after it)."""
    if end is not None and end < len(buf):
        buf = buf[:end]  # the fast reader's bound is the buffer's end
    try:
        return _struct(buf, pos, 0)
    except IndexError:  # a read past the buffer: a truncation
        raise ThriftError("truncated thrift data") from None
    except RecursionError:
        raise ThriftError("thrift nesting too deep") from None


# The decoder footers and page headers go through: what CompactReader does, with the varints and the common
# types inline (a Python call per value made parsing 10^5 footers most of a cold start's time). A read past the
# buffer raises IndexError, which read_struct reports as a truncation.

def _varint(buf: Buffer, pos: int) -> tuple[int, int]:
    b = buf[pos]
    pos += 1
    result = b & 0x7F
    shift = 7
    while b & 0x80:
        if shift > 63:
            raise ThriftError("varint too long")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        shift += 7
    return result, pos


def _struct(buf: Buffer, pos: int, depth: int) -> tuple[Struct, int]:
    if depth > _MAX_DEPTH:
        raise ThriftError("thrift nesting too deep")
    out: Struct = {}
    fid = 0
    while True:
        h = buf[pos]
        pos += 1
        ctype = h & 0x0F
        if ctype == STOP:
            return out, pos
        delta = h >> 4
        if delta:
            fid += delta
        else:
            n, pos = _varint(buf, pos)
            fid = (n >> 1) ^ -(n & 1)
        if ctype == I32 or ctype == I64 or ctype == I16:
            b = buf[pos]
            pos += 1
            if b < 0x80:
                out[fid] = (b >> 1) ^ -(b & 1)
            else:
                n, pos = _varint(buf, pos - 1)
                out[fid] = (n >> 1) ^ -(n & 1)
        elif ctype == BINARY:
            n, pos = _varint(buf, pos)
            if n > len(buf) - pos:
                raise ThriftError(f"binary of {n} bytes runs past the end")
            out[fid] = bytes(buf[pos : pos + n])
            pos += n
        elif ctype == STRUCT:
            out[fid], pos = _struct(buf, pos, depth + 1)
        elif ctype == LIST or ctype == SET:
            out[fid], pos = _list(buf, pos, depth + 1)
        elif ctype == TRUE:
            out[fid] = True
        elif ctype == FALSE:
            out[fid] = False
        else:
            r = CompactReader(buf, pos)
            out[fid] = r.value(ctype, depth)
            pos = r.pos


def _list(buf: Buffer, pos: int, depth: int) -> tuple[list[Any], int]:
    if depth > _MAX_DEPTH:
        raise ThriftError("thrift nesting too deep")
    h = buf[pos]
    pos += 1
    n, et = h >> 4, h & 0x0F
    if n == 15:
        n, pos = _varint(buf, pos)
    if n > _MAX_CONTAINER or n > (len(buf) - pos) * 8 + 8:
        raise ThriftError(f"list of {n} elements cannot fit")
    out: list[Any] = []
    if et == STRUCT:
        for _ in range(n):
            v, pos = _struct(buf, pos, depth + 1)
            out.append(v)
    elif et == I32 or et == I64 or et == I16:
        for _ in range(n):
            b = buf[pos]
            pos += 1
            if b >= 0x80:
                b, pos = _varint(buf, pos - 1)
            out.append((b >> 1) ^ -(b & 1))
    elif et == TRUE or et == FALSE:  # bools in containers are one byte each
        for _ in range(n):
            out.append(buf[pos] == 1)
            pos += 1
    else:
        r = CompactReader(buf, pos)
        out = [r.value(et, depth) for _ in range(n)]
        pos = r.pos
    return out, pos


# ---- writer (tests build corrupt or unusual files with it; the page decoders wrap a page in a one-page file for
# Arrow to decode: a few small structs per page) ----

class CompactWriter:
    """Thrift compact-protocol encoding of structs given as (field id, compact type, value) lists."""

    def __init__(self) -> None:
        self.out = bytearray()

    def varint(self, n: int) -> None:
        while True:
            b = n & 0x7F
            n >>= 7
            if n:
                self.out.append(b | 0x80)
            else:
                self.out.append(b)
                return

    def zigzag(self, n: int) -> None:
        self.varint((n << 1) ^ (n >> 63))

    def struct(self, fields: list[Field]) -> None:
        """fields: (field id, compact type, value), in increasing id order."""
        last = 0
        for fid, ctype, v in fields:
            if ctype in (TRUE, FALSE):
                ctype = TRUE if v else FALSE
            d = fid - last
            if 0 < d <= 15:
                self.out.append((d << 4) | ctype)
            else:
                self.out.append(ctype)
                self.zigzag(fid)
            last = fid
            self.value(ctype, v)
        self.out.append(STOP)

    def value(self, ctype: int, v: Any) -> None:
        """One value of compact type ``ctype``: a LIST value is (element type, items), or bytes encoded before."""
        if ctype in (I16, I32, I64):
            self.zigzag(int(v))
        elif ctype == BINARY:
            b = v.encode() if isinstance(v, str) else bytes(v)
            self.varint(len(b))
            self.out += b
        elif ctype == STRUCT:
            self.struct(v)
        elif ctype in (TRUE, FALSE):
            pass
        elif ctype == LIST and isinstance(v, (bytes, bytearray)):
            self.out += v  # a list encoded before (e.g. a column's one-leaf schema)
        elif ctype == LIST:
            et, items = v
            n = len(items)
            self.out.append(((n if n < 15 else 15) << 4) | et)
            if n >= 15:
                self.varint(n)
            for it in items:
                self.value(et, it)
        else:
            raise ValueError(f"cannot write thrift type {ctype}")

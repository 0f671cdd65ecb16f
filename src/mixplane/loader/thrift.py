"""A small reader for the Thrift compact protocol, enough for Parquet footers and page headers.

Structs decode to ``dict[field_id, value]``; lists to Python lists; binary to ``bytes``.
Unknown fields are kept (or skipped) generically, so newer writers' extra fields do not break us.
Every malformed input raises :class:`ThriftError` (truncation, bad type, absurd sizes, deep nesting).
"""

from __future__ import annotations

import struct

from mixplane.errors import MixplaneError

STOP, TRUE, FALSE, BYTE, I16, I32, I64, DOUBLE, BINARY, LIST, SET, MAP, STRUCT = range(13)
_MAX_DEPTH = 32
_MAX_CONTAINER = 1 << 28
_unpack_double = struct.Struct("<d").unpack_from


class ThriftError(MixplaneError, ValueError):
    """Malformed Thrift compact-protocol data."""


class CompactReader:
    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf: bytes | bytearray | memoryview, pos: int = 0, end: int | None = None):
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

    def value(self, ctype: int, depth: int = 0):
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

    def list(self, depth: int) -> list:
        if depth > _MAX_DEPTH:
            raise ThriftError("thrift nesting too deep")
        h = self._byte()
        n, et = h >> 4, h & 0x0F
        if n == 15:
            n = self.varint()
        if n > _MAX_CONTAINER or n > (self.end - self.pos) * 8 + 8:
            raise ThriftError(f"list of {n} elements cannot fit")
        if et == TRUE or et == FALSE:  # bools in containers are one byte each
            out = []
            for _ in range(n):
                out.append(self._byte() == 1)
            return out
        return [self.value(et, depth) for _ in range(n)]

    def map(self, depth: int) -> dict:
        if depth > _MAX_DEPTH:
            raise ThriftError("thrift nesting too deep")
        n = self.varint()
        if n == 0:
            return {}
        if n > _MAX_CONTAINER or n > self.end - self.pos:
            raise ThriftError(f"map of {n} entries cannot fit")
        h = self._byte()
        kt, vt = h >> 4, h & 0x0F
        return {self.value(kt, depth): self.value(vt, depth) for _ in range(n)}

    def struct(self, depth: int = 0) -> dict:
        if depth > _MAX_DEPTH:
            raise ThriftError("thrift nesting too deep")
        out: dict[int, object] = {}
        fid = 0
        while True:
            h = self._byte()
            ctype = h & 0x0F
            if ctype == STOP:
                return out
            delta = h >> 4
            fid = fid + delta if delta else self.zigzag()
            out[fid] = self.value(ctype, depth)


def read_struct(buf: bytes | bytearray | memoryview, pos: int = 0, end: int | None = None) -> tuple[dict, int]:
    """Decode one struct starting at ``pos``; returns (struct, position after it)."""
    r = CompactReader(buf, pos, end)
    try:
        s = r.struct()
    except IndexError:  # defensive: any slip past the buffer is a truncation
        raise ThriftError("truncated thrift data") from None
    return s, r.pos


# ---- writer (tests build corrupt or unusual files with it; pagereader wraps a page in a one-page file for
# Arrow to decode: a few small structs per page) ----

class CompactWriter:
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

    def struct(self, fields: list[tuple[int, int, object]]) -> None:
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
            self._value(ctype, v)
        self.out.append(STOP)

    def _value(self, ctype: int, v) -> None:
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
                self._value(et, it)
        else:
            raise ValueError(f"cannot write thrift type {ctype}")

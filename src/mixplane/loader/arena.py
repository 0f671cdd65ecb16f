"""Slab memory for the decoded rows of a page-mode shuffle buffer.

The buffer's units (pages or page parts) are decoded, live for a random while and leave in random
order, each a few hundred KB. Handed to a general-purpose allocator, that pattern fragments the
heap: freed holes sit between live units and the process keeps far more memory than it uses (on
the loader benchmark: ~110 MB free-but-held heap beside ~150 MB of live decoded rows).

Here every unit's Arrow buffers are copied into fixed-size slabs, appended one after another. A
slab is given back (kept as the one spare, else freed) when no unit lives in it any more. To keep
slabs from being pinned by a few survivors, the stream relocates the rows still to be delivered
of the units in slabs that are mostly dead (:meth:`RowArena.sparse_slabs`), so resident memory
stays within a fixed factor of the rows actually buffered, whatever the allocator.

Arrays handed out point into slab memory through numpy views of the slab; a slab is reused only
when no view of it is alive (its reference count says so), so an array that outlives its unit
(a slice kept by a caller) stays valid: that slab is then simply dropped, not reused.
"""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pyarrow as pa

ALIGN = 64


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


class _Slab:
    __slots__ = ("mem", "used", "units", "dedicated")

    def __init__(self, size: int, dedicated: bool = False):
        # anonymous mmap: off the heap (no fragmentation there), returned to the OS when freed
        self.mem = np.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), np.uint8)
        self.used = 0
        self.units: dict[int, int] = {}  # unit -> bytes it occupies here
        self.dedicated = dedicated


class RowArena:
    """Decoded units packed into slabs of ``slab_bytes`` (larger units get a slab of their own)."""

    def __init__(self, slab_bytes: int = 4 << 20, spares: int = 2, pending: int = 8):
        self.slab_bytes = int(slab_bytes)
        self._slabs: dict[int, _Slab] = {}
        self._next_id = 0
        self._head: int | None = None
        self._spares: list[_Slab] = []  # empty slabs kept for reuse (no fresh pages to fault in)
        self._pending: list[_Slab] = []  # empty slabs that views still point into
        self._max_spares, self._max_pending = int(spares), int(pending)
        self.new_slabs = 0  # slabs mapped (not reused)
        self._where: dict[int, int] = {}  # unit -> slab id
        self.copied_bytes = 0  # bytes written into slabs (decoded once, plus relocations)

    # -- accounting --
    @property
    def resident_bytes(self) -> int:
        """Bytes of all slabs: in use, spare, and empty ones that a view still points into."""
        return sum(len(s.mem) for s in (*self._slabs.values(), *self._spares, *self._pending))

    @property
    def used_bytes(self) -> int:
        """Bytes written into the slabs in use (rows still to come and rows already delivered)."""
        return sum(s.used for s in self._slabs.values())

    @property
    def num_slabs(self) -> int:
        return len(self._slabs)

    def slab_of(self, unit: int) -> int | None:
        return self._where.get(unit)

    # -- storing --
    def _new_slab(self, need: int) -> int:
        self.reclaim()
        if need > self.slab_bytes:
            slab = _Slab(_aligned(need), dedicated=True)
            self.new_slabs += 1
        elif self._spares:
            slab = self._spares.pop()
            slab.used = 0
        else:
            slab = _Slab(self.slab_bytes)
            self.new_slabs += 1
        sid = self._next_id
        self._next_id += 1
        self._slabs[sid] = slab
        return sid

    def store(self, unit: int, arrays: dict[str, pa.Array]) -> dict[str, pa.Array]:
        """Copies of ``arrays`` that live in slab memory (arrays of a type it cannot rebuild are
        returned as they are). The unit must not be stored already."""
        if unit in self._where:
            raise ValueError(f"unit {unit} is already stored")
        plans = {c: _plan(a) for c, a in arrays.items()}
        need = sum(_aligned(b.size) for p in plans.values() if p is not None for b in _buffers(p))
        if need == 0:
            return dict(arrays)
        sid = self._head
        if sid is None or self._slabs[sid].used + need > len(self._slabs[sid].mem):
            sid = self._new_slab(need)
            if not self._slabs[sid].dedicated:
                self._head = sid
        slab = self._slabs[sid]

        def put(buf: pa.Buffer | None) -> pa.Buffer | None:
            if buf is None:
                return None
            n = buf.size
            off = slab.used
            slab.used = off + _aligned(n)
            view = slab.mem[off : off + n]
            if n:
                view[:] = np.frombuffer(buf, np.uint8, n)
            return pa.py_buffer(view)

        out = {}
        for c, a in arrays.items():
            p = plans[c]
            out[c] = a if p is None else _rebuild(p, put)
        slab.units[unit] = need
        self._where[unit] = sid
        self.copied_bytes += need
        return out

    def release(self, unit: int) -> None:
        """The unit's arrays are no longer used by the stream."""
        sid = self._where.pop(unit, None)
        if sid is None:
            return
        slab = self._slabs[sid]
        slab.units.pop(unit, None)
        if not slab.units and sid != self._head:
            self._drop(sid)

    def reclaim(self) -> None:
        """Empty slabs whose last views have died become spares (or are freed)."""
        if not self._pending:
            return
        still = []
        for sl in self._pending:
            if sys.getrefcount(sl.mem) > 2:
                still.append(sl)
            elif len(self._spares) < self._max_spares:
                self._spares.append(sl)
        self._pending = still

    def _drop(self, sid: int) -> None:
        slab = self._slabs.pop(sid)
        slab.units.clear()
        if slab.dedicated:
            return  # freed when its last view dies
        # reuse only once nothing points into it any more (views hold references to slab.mem)
        if sys.getrefcount(slab.mem) <= 2:
            if len(self._spares) < self._max_spares:
                self._spares.append(slab)
        else:
            self._pending.append(slab)
            if len(self._pending) > self._max_pending:
                self._pending.pop(0)  # let it go: freed when its last view dies

    def sparse_slabs(self, live: dict[int, float], ratio: float) -> list[int]:
        """Units to relocate: those in (non-head) slabs whose live bytes (``live``: unit -> bytes of
        its rows still to be delivered) are at most ``ratio`` of the bytes written to the slab."""
        out: list[int] = []
        for sid, slab in self._slabs.items():
            if sid == self._head or not slab.units:
                continue
            lb = sum(live.get(u, float(b)) for u, b in slab.units.items())
            if lb <= ratio * slab.used:
                out.extend(slab.units)
        return out

    def clear(self) -> None:
        self._slabs.clear()
        self._where.clear()
        self._head = None
        self._pending.clear()


# ----------------------------------------------------------------------------------------------
# rebuilding arrays on other memory


def _is(kind: str, t: pa.DataType) -> bool:
    f = getattr(pa.types, kind, None)
    return bool(f is not None and f(t))


def _plan(a: pa.Array):
    """A description of ``a`` that :func:`_rebuild` can recreate from copied buffers, or None
    if the type is not supported (the array then stays where it is)."""
    t = a.type
    if _is("is_dictionary", t) or _is("is_string_view", t) or _is("is_binary_view", t) or isinstance(t, pa.ExtensionType):
        return None
    if t.num_fields == 0:
        return ("flat", t, len(a), a.null_count, a.offset, a.buffers())
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        child = _plan(a.values)
        if child is None:
            return None
        return ("list", t, len(a), a.null_count, a.offset, a.buffers()[:2], child)
    return None


def _buffers(p) -> list[pa.Buffer]:
    own = [b for b in p[5] if b is not None]
    return own + (_buffers(p[6]) if p[0] == "list" else [])


def _rebuild(p, put) -> pa.Array:
    kind, t, n, nulls, offset, bufs = p[:6]
    new = [put(b) for b in bufs]
    if kind == "flat":
        return pa.Array.from_buffers(t, n, new, null_count=nulls, offset=offset)
    child = _rebuild(p[6], put)
    return pa.Array.from_buffers(t, n, new, null_count=nulls, offset=offset, children=[child])

"""Read-ahead for sources on object storage: the units a stream will read next are known from its read
order (the pages that entered page mode's shuffle buffer and the next ones of the order, the next
pages or row-group chunks of sequential / rowgroup mode, the pages of row mode's next rows), so their
byte ranges are fetched before they are wanted — close ranges coalesced into one request (a gap
threshold, as pyarrow's ``CacheOptions.hole_size_limit``), requests issued in the order they will be
needed, at most ``max_inflight`` at once, and what was fetched kept in a byte-bounded cache.

A fetched range is *pinned* once for every planned read of it and unpinned when read; only unpinned
ranges are evicted (least recently used first), so prefetched data is never thrown away before it is
used, and the cache never holds more than ``cache_bytes``: scheduling stops when it is full of
pinned ranges and resumes as they are read. An optional :class:`~mixplane.loader.diskcache.DiskCache`
keeps ranges across processes and restarts: a range found there is not requested at all."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from mixplane.loader.parquet import IOStats, RangeReader
from mixplane.loader.remote import RemoteIO

Range = tuple[int, int, int]  # (file, offset, size)


@dataclass
class Request:
    """One coalesced request: [start, end) of one file, serving ``members``; ``need`` is the earliest
    position (in the caller's order) at which one of them is wanted."""

    file: int
    start: int
    end: int
    members: list[Range]
    need: int = 0


def coalesce(ranges: list[Range], gap: int, max_request: int) -> list[Request]:
    """Merge ranges of a file whose holes are at most ``gap`` bytes into requests of at most
    ``max_request`` bytes (a single larger range stays one request). Pure; the requests come in the
    order they are first needed (``ranges`` is in need order)."""
    first: dict[Range, int] = {}
    for i, r in enumerate(ranges):
        first.setdefault(r, i)
    out: list[Request] = []
    for f, off, size in sorted(first):
        last = out[-1] if out else None
        need = first[(f, off, size)]
        if (last is not None and last.file == f and off - last.end <= gap
                and max(last.end, off + size) - last.start <= max_request):
            last.end = max(last.end, off + size)
            last.members.append((f, off, size))
            last.need = min(last.need, need)
        else:
            out.append(Request(f, off, off + size, [(f, off, size)], need))
    out.sort(key=lambda q: q.need)
    return out


def request_limit(total: int, io: RemoteIO) -> int:
    """Largest coalesced request for a batch of ``total`` bytes: ``max_request``, but small enough
    that the batch still spreads over every request slot (one huge request would make the first page
    wait for all of it), and never below ``min_request``."""
    share = -(-total // max(1, io.max_inflight))
    return max(io.min_request, min(io.max_request, share))


@dataclass
class _Entry:
    fut: Future
    start: int  # offset of the request's first byte
    share: int  # bytes of the cache budget this range accounts for
    pins: int = 0  # planned reads not done yet
    on_disk: bool = field(default=False)
    seq: int = 0  # the request's number (requests finish roughly in this order)


class ReadAhead:
    """Fetches ranges in the background; :meth:`get` returns a range's bytes once fetched (waiting for
    an in-flight request), or None if it was never scheduled or its request failed (the caller then
    reads it itself, so errors surface where the page is read)."""

    def __init__(self, io: RemoteIO, stats: IOStats, open_file: Callable[[int], RangeReader], disk=None):
        self.io = io
        self.stats = stats
        self.open_file = open_file
        self.disk = disk  # DiskCache or None
        self._pool: ThreadPoolExecutor | None = None
        self._entries: OrderedDict[Range, _Entry] = OrderedDict()  # insertion / use order = LRU order
        self._bytes = 0
        self._lock = threading.Lock()  # the entries are touched by the reading thread only; stats by all
        self.requests_issued = 0
        self.disk_hits = 0

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def room(self) -> int:
        return self.io.cache_bytes - self._bytes

    def holds(self, r: Range) -> bool:
        return r in self._entries

    def schedule(self, units: list[list[Range]]) -> int:
        """Plan one read of every range of each unit (a unit: the ranges one page or chunk read needs),
        in order; fetch those not held, coalesced. Units are taken whole while the cache has room for
        their new ranges; returns how many were taken (the caller offers the rest again later)."""
        taken = 0
        new: list[Range] = []
        new_set: set[Range] = set()
        new_bytes = 0
        pins: list[Range] = []
        for ranges in units:
            fresh = list(dict.fromkeys(r for r in ranges if r not in self._entries and r not in new_set
                                       and not (self.disk is not None and self.disk.has(r))))
            need = sum(r[2] for r in fresh)
            if need and self.room() - new_bytes < need:
                self._evict(new_bytes + need)
                if self.room() - new_bytes < need:
                    break
            new.extend(fresh)
            new_set.update(fresh)
            new_bytes += need
            pins.extend(r for r in ranges if r in self._entries or r in new_set)
            taken += 1
        if new:
            self._issue(new)
        for r in pins:
            self._entries[r].pins += 1
        return taken

    def _issue(self, ranges: list[Range]) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=max(1, self.io.max_inflight), thread_name_prefix="readahead")
        limit = request_limit(sum(r[2] for r in ranges), self.io)
        for req in coalesce(ranges, self.io.coalesce_gap, limit):
            fut = self._pool.submit(self._fetch, req.file, req.start, req.end - req.start)
            self.requests_issued += 1
            share = (req.end - req.start) // max(1, len(req.members))
            for m in req.members:
                self._entries[m] = _Entry(fut, req.start, share, seq=self.requests_issued)
                self._bytes += share

    def _fetch(self, file: int, start: int, size: int) -> bytes:
        return self.open_file(file).read_at(start, size)  # opened here: a HEAD does not hold up the reader

    def _evict(self, need: int) -> None:
        """Drop unpinned fetched ranges, least recently used first, until ``need`` bytes fit."""
        if self.room() >= need:
            return
        for key in list(self._entries):
            e = self._entries[key]
            if e.pins <= 0 and e.fut.done():
                del self._entries[key]
                self._bytes -= e.share
                if self.room() >= need:
                    return

    def get(self, file: int, offset: int, size: int, timeout: float | None = None) -> bytes | None:
        """The bytes of a scheduled (or kept) range; kept afterwards for other reads of it (e.g. the
        other parts of a split page) until evicted."""
        key = (file, offset, size)
        e = self._entries.get(key)
        if e is None:
            if self.disk is not None:
                data = self.disk.get(key)
                if data is not None:
                    self.disk_hits += 1
                    self.stats.hit()
                    self.put(file, offset, size, data)  # kept in memory too: other parts of the page
                    return data
            return None
        self._entries.move_to_end(key)
        e.pins = max(0, e.pins - 1)
        try:
            data = e.fut.result(timeout=timeout)
        except Exception:  # noqa: BLE001 - the caller reads the range itself and meets the error there
            self._drop(key)
            return None
        self.stats.hit()
        out = data[offset - e.start : offset - e.start + size] if (e.start != offset or len(data) != size) else data
        if self.disk is not None and not e.on_disk:
            e.on_disk = True
            self._write_behind(key, out)
        return out

    def _write_behind(self, key: Range, data: bytes) -> None:
        """Copy a range to the disk cache off the reading thread."""
        if self._pool is not None:
            self._pool.submit(self.disk.put, key, data)
        else:
            self.disk.put(key, data)

    def arrival(self, ranges: list[Range]) -> int:
        """When the ranges will all be here, as a rank: -1 if they are (or nothing is in flight for
        them), else the number of the last request they wait for."""
        last = -1
        for r in ranges:
            e = self._entries.get(r)
            if e is not None and not e.fut.done():
                last = max(last, e.seq)
        return last

    def _drop(self, key: Range) -> None:
        e = self._entries.pop(key, None)
        if e is not None:
            self._bytes -= e.share

    def put(self, file: int, offset: int, size: int, data: bytes) -> None:
        """Keep a range read directly (the other parts of a split page read it again soon)."""
        key = (file, offset, size)
        if self.disk is not None and not self.disk.has(key):
            self._write_behind(key, data)
        if key in self._entries or size > self.io.cache_bytes:
            return
        self._evict(size)
        if self.room() < size:
            return
        fut: Future = Future()
        fut.set_result(data)
        self._entries[key] = _Entry(fut, offset, size, on_disk=True)
        self._bytes += size

    def release(self, file: int, offset: int, size: int) -> None:
        """No more planned reads of this range (a dictionary page, decoded and kept by the reader)."""
        e = self._entries.get((file, offset, size))
        if e is not None:
            e.pins = 0

    def unpin_all(self) -> None:
        """Forget planned reads (a new epoch, a seek): what was fetched stays until evicted."""
        for e in self._entries.values():
            e.pins = 0

    def evict_all(self) -> None:
        for e in self._entries.values():
            e.fut.cancel()
        self._entries.clear()
        self._bytes = 0

    def close(self) -> None:
        self.evict_all()  # cancels every fetch not started yet
        if self._pool is not None:
            # queued disk-cache writes still run: cancelling them (cancel_futures) lost the pages read last, and a
            # restarted stream fetched them again over the network
            self._pool.shutdown(wait=True)
            self._pool = None

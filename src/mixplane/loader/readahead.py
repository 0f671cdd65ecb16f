"""Read-ahead for sources on object storage: the pages a page-mode stream will read next are known (the
shuffle order), so their byte ranges are fetched before they are wanted — close ranges coalesced into
one request (a gap threshold, as pyarrow's ``CacheOptions.hole_size_limit``), at most ``max_inflight``
requests at once, and what was fetched kept in a byte-bounded cache until read (or evicted)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from mixplane.loader.pagereader import IOStats, RangeReader
from mixplane.loader.remote import RemoteIO

Range = tuple[int, int, int]  # (file, offset, size)


@dataclass
class Request:
    """One coalesced request: [start, end) of one file, serving ``members``."""

    file: int
    start: int
    end: int
    members: list[Range]


def coalesce(ranges: list[Range], gap: int, max_request: int) -> list[Request]:
    """Merge ranges of a file whose holes are at most ``gap`` bytes into requests of at most
    ``max_request`` bytes (a single larger range stays one request). Pure; sorted by (file, offset)."""
    out: list[Request] = []
    for f, off, size in sorted(set(ranges)):
        last = out[-1] if out else None
        if (last is not None and last.file == f and off - last.end <= gap
                and max(last.end, off + size) - last.start <= max_request):
            last.end = max(last.end, off + size)
            last.members.append((f, off, size))
        else:
            out.append(Request(f, off, off + size, [(f, off, size)]))
    return out


class ReadAhead:
    """Fetches ranges in the background; :meth:`get` returns a range's bytes once fetched (waiting for
    an in-flight request), or None if it was never scheduled or its request failed (the caller then
    reads it itself, so errors surface where the page is read)."""

    def __init__(self, io: RemoteIO, stats: IOStats, open_file: Callable[[int], RangeReader]):
        self.io = io
        self.stats = stats
        self.open_file = open_file
        self._pool: ThreadPoolExecutor | None = None
        # range -> (future of the request's bytes, request start); insertion order = LRU order
        self._entries: OrderedDict[Range, tuple[Future, int, int]] = OrderedDict()
        self._bytes = 0
        self.requests_issued = 0

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def room(self) -> int:
        return self.io.cache_bytes - self._bytes

    def schedule(self, ranges: list[Range]) -> int:
        """Fetch the ranges not yet held, as long as the cache has room; returns the bytes scheduled."""
        todo = [r for r in ranges if r not in self._entries]
        if not todo:
            return 0
        self._evict(sum(r[2] for r in todo))
        budget = self.room()
        picked, total = [], 0
        for r in todo:
            if total + r[2] > budget:
                break
            picked.append(r)
            total += r[2]
        if not picked:
            return 0
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=max(1, self.io.max_inflight), thread_name_prefix="readahead")
        for req in coalesce(picked, self.io.coalesce_gap, self.io.max_request):
            try:
                reader = self.open_file(req.file)
            except Exception:  # noqa: BLE001 - opened again (and the error raised) when the page is read
                continue
            fut = self._pool.submit(reader.read_at, req.start, req.end - req.start)
            self.requests_issued += 1
            share = (req.end - req.start) // max(1, len(req.members))
            for m in req.members:
                self._entries[m] = (fut, req.start, share)
                self._bytes += share
        return total

    def _evict(self, need: int) -> None:
        """Drop the least recently used fetched ranges until ``need`` bytes fit (in-flight ones stay)."""
        for key in list(self._entries):
            if self.room() >= need:
                return
            fut, _, share = self._entries[key]
            if fut.done():
                del self._entries[key]
                self._bytes -= share

    def get(self, file: int, offset: int, size: int, timeout: float | None = None) -> bytes | None:
        """The bytes of a scheduled range (kept for later reads of the same page, e.g. its other parts)."""
        key = (file, offset, size)
        e = self._entries.get(key)
        if e is None:
            return None
        self._entries.move_to_end(key)
        fut, start, share = e
        try:
            data = fut.result(timeout=timeout)
        except Exception:  # noqa: BLE001 - the caller reads the range itself and meets the error there
            del self._entries[key]
            self._bytes -= share
            return None
        self.stats.hit()
        return data[offset - start : offset - start + size]

    def put(self, file: int, offset: int, size: int, data: bytes) -> None:
        """Keep a range read directly (the other parts of a split page read it again soon)."""
        key = (file, offset, size)
        if key in self._entries or size > self.io.cache_bytes:
            return
        self._evict(size)
        fut: Future = Future()
        fut.set_result(data)
        self._entries[key] = (fut, offset, size)
        self._bytes += size

    def evict_all(self) -> None:
        for fut, _, _ in self._entries.values():
            fut.cancel()
        self._entries.clear()
        self._bytes = 0

    def close(self) -> None:
        self.evict_all()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

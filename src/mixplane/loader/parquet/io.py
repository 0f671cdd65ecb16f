"""Positional reads of one Parquet file, local or on object storage, each counted: the reader's only contact with
storage, so that read amplification, request counts and retries are measured where they happen."""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Any, Protocol

from mixplane.loader import remote
from mixplane.loader.parquet.errors import CorruptFileError, MissingObjectFileError


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


class RangedFile(Protocol):
    """What a remote file opened for ranged reads offers (``pyarrow`` random-access files and
    :class:`mixplane.loader.remote.FsspecObject` alike)."""

    def size(self) -> int: ...

    def read_at(self, nbytes: int, offset: int) -> Any: ...

    def close(self) -> None: ...


def _as_bytes(b: Any) -> bytes:
    return b if isinstance(b, bytes) else b.to_pybytes()


class RangeReader:
    """Positional reads of one file. Local files use ``os.pread`` (no shared file position, no
    buffering); other URIs go through ``pyarrow.fs`` ``read_at``, one ranged request each, with
    retries (:mod:`mixplane.loader.remote`); a remote file's last ``tail_bytes`` are read in one request
    the first time any of them is wanted (footer, OffsetIndexes), and :meth:`hold` keeps other spans
    read in one go. Every read is counted."""

    def __init__(self, path: str, filesystem: Any = None, stats: IOStats | None = None,
                 io: remote.RemoteIO | None = None):
        self.path = path
        self.stats = stats if stats is not None else IOStats()
        self._fd: int | None = None
        self._f: RangedFile | None = None
        self._held: list[tuple[int, bytes]] = []
        self.io: remote.RemoteIO = io or remote.DEFAULTS
        self.remote: bool = remote.is_remote(filesystem)
        self.name: str = remote.object_name(filesystem, path) if self.remote else path
        self.size: int
        try:
            if not self.remote:
                self._fd = os.open(path, os.O_RDONLY)
                self.size = os.fstat(self._fd).st_size
            else:
                t0 = time.perf_counter()
                f: RangedFile = remote.with_retries("opening", self.name, lambda: remote.open_ranged(filesystem, path),
                                                    self.io, on_retry=self.stats.retry)
                self._f = f
                self.stats.request(0, time.perf_counter() - t0)
                self.size = f.size()
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
            start = self.size - tail
            whole = self._get(start, tail)
            self._held.append((start, whole))
            return whole[offset - start : offset - start + size]
        return self._get(offset, size)

    def _get(self, offset: int, size: int) -> bytes:
        f = self._f
        if f is None:  # a programming error (a read of a closed reader), not damaged data: not a ParquetError
            raise RuntimeError(f"{self.path}: read after close")
        t0 = time.perf_counter()
        try:
            data: bytes = remote.with_retries(f"reading {size} bytes at {offset}", self.name,
                                              lambda: _as_bytes(f.read_at(size, offset)), self.io,
                                              on_retry=self.stats.retry)
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

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:  # a finaliser must not raise: a reader collected half-built, or at interpreter exit
            pass

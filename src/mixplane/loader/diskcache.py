"""A bounded disk cache of byte ranges of remote objects (page runs, dictionary pages), so a restarted
loader, a second epoch or another loader process on the same node reads them from local disk instead
of object storage.

One file per range under ``<root>/<object key>/<offset>-<size>``, the object key a hash of the object's
identity (path, size, mtime: a rewritten object never serves its old bytes); each file carries an
xxh64 digest of its bytes, checked on every read (a damaged file is a miss and is removed, never wrong
data). Writes go to a temporary file renamed into place (readers never see half a file). The total is
kept under ``max_bytes`` by evicting the least recently used files (recency survives restarts through
the files' mtimes, refreshed on hits). Several processes may share a root: each keeps its own view of
the total, so together they may exceed the bound until their next eviction (each stays within it)."""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable

import xxhash

Range = tuple[int, int, int]  # (file, offset, size) of the reader that owns the cache
_DIGEST = 8


class DiskCache:
    def __init__(self, root: str, max_bytes: int, object_id: Callable[[int], str]):
        """``object_id(file)``: the identity of the reader's file ``file`` (path, size, mtime)."""
        self.root = root
        self.max_bytes = int(max_bytes)
        self.object_id = object_id
        self._lock = threading.Lock()
        self._files: OrderedDict[str, int] = OrderedDict()  # path -> bytes on disk, least recent first
        self.total = 0
        self.hits = self.misses = self.writes = self.evictions = self.damaged = 0
        self._dirs: dict[int, str] = {}
        os.makedirs(root, exist_ok=True)
        self._scan()

    def _scan(self) -> None:
        found = []
        for d in os.scandir(self.root):
            if not d.is_dir():
                continue
            for f in os.scandir(d.path):
                if f.name.endswith(".tmp"):
                    continue
                try:
                    st = f.stat()
                except OSError:
                    continue
                found.append((st.st_mtime_ns, f.path, st.st_size))
        for _, path, size in sorted(found):
            self._files[path] = size
            self.total += size
        self._evict()

    def _path(self, r: Range) -> str:
        d = self._dirs.get(r[0])
        if d is None:
            d = os.path.join(self.root, hashlib.sha256(self.object_id(r[0]).encode()).hexdigest()[:32])
            self._dirs[r[0]] = d
        return os.path.join(d, f"{r[1]}-{r[2]}")

    def has(self, r: Range) -> bool:
        return self._path(r) in self._files

    def get(self, r: Range) -> bytes | None:
        path = self._path(r)
        with self._lock:
            known = path in self._files
            if known:
                self._files.move_to_end(path)
        if not known:
            self.misses += 1
            return None
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except OSError:
            self._forget(path)
            self.misses += 1
            return None
        data, digest = blob[:-_DIGEST], blob[-_DIGEST:]
        if len(data) != r[2] or xxhash.xxh64_digest(data) != digest:
            self.damaged += 1
            self._forget(path, unlink=True)
            self.misses += 1
            return None
        try:
            os.utime(path)  # recency for the next process that scans the cache
        except OSError:
            pass
        self.hits += 1
        return data

    def put(self, r: Range, data: bytes) -> None:
        if len(data) != r[2] or len(data) + _DIGEST > self.max_bytes:
            return
        path = self._path(r)
        if path in self._files:
            return
        d = os.path.dirname(path)
        try:
            os.makedirs(d, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.write(xxhash.xxh64_digest(data))
            os.replace(tmp, path)
        except OSError:  # a full or read-only disk only costs the cache
            try:
                os.unlink(tmp)
            except (OSError, UnboundLocalError):
                pass
            return
        with self._lock:
            self._files[path] = len(data) + _DIGEST
            self.total += len(data) + _DIGEST
            self.writes += 1
        self._evict()

    def _forget(self, path: str, unlink: bool = False) -> None:
        with self._lock:
            size = self._files.pop(path, None)
            if size is not None:
                self.total -= size
        if unlink:
            try:
                os.unlink(path)
            except OSError:
                pass

    def _evict(self) -> None:
        while True:
            with self._lock:
                if self.total <= self.max_bytes or not self._files:
                    return
                path, size = self._files.popitem(last=False)
                self.total -= size
                self.evictions += 1
            try:
                os.unlink(path)
            except OSError:
                pass

"""Worker threads of one partition (``sources[].workers``): the stream's chunks transformed in parallel, in order.

A partition's read path is ``stream.take(n)`` (page reads, decompression, decoding, the shuffle buffer: stateful,
so driven from one thread; the pages a take decodes fan out to the stream's own decode threads) followed by ``transform(raw)`` (tokenizing, image decoding: a pure function of the rows). With N
workers the loader's thread keeps taking the next chunks of the stream while up to N earlier chunks are transformed
on a thread pool (HF tokenizers, Pillow, cramjam and pyarrow release the GIL), and chunks are handed out strictly in
the order they were taken. What a chunk holds depends only on the stream's order, never on which thread transformed
it or when, so windows, cursors, journals and replays are identical whatever N (tests/unit/test_loader_workers.py).

Bounded: at most ``depth`` chunks (default ``2 * workers``) and ``max_bytes`` of their raw columns in flight (the
chunk the caller waits for is always allowed). A seek that moves the stream drops what is in flight (:meth:`reset`);
what a transform records in its quarantine log is recorded when its chunk is handed out, so the log's order is that of
one thread too. An error of a transform (or of a take made ahead) is raised when its chunk's turn comes, not before
and never swallowed: a worker's ``TransformError`` names the source and column as it does on one thread.

``workers: auto`` -> :func:`resolve_workers`: the cores this process may use (CPU affinity and the cgroup's quota),
at most :data:`MAX_AUTO_WORKERS`.
"""

from __future__ import annotations

import math
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # any stream / transform of these shapes; no import at run time
    from mixplane.loader.stream import RawSamples, SourceStream
    from mixplane.loader.transforms import TransformedSamples

MAX_AUTO_WORKERS = 4  # `workers: auto` uses at most this many threads (bench/loader_io.py: the gain flattens)
DEFAULT_MAX_BYTES = 64 << 20  # raw column bytes of the chunks in flight beyond the one waited for


def available_cores() -> float:
    """Cores this process may use: its CPU affinity, bounded by a cgroup CPU quota (v2 ``cpu.max``, v1 CFS)."""
    try:
        n = float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        n = float(os.cpu_count() or 1)
    for path, parse in (("/sys/fs/cgroup/cpu.max", _cpu_max), ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", _cfs_quota)):
        try:
            with open(path) as f:
                q = parse(f.read(), path)
        except (OSError, ValueError):
            continue
        if q is not None and q > 0:
            n = min(n, q)
    return max(1.0, n)


def _cpu_max(text: str, path: str) -> float | None:
    quota, _, period = text.strip().partition(" ")
    return None if quota == "max" else float(quota) / float(period or 100000)


def _cfs_quota(text: str, path: str) -> float | None:
    quota = int(text.strip())
    if quota <= 0:
        return None
    with open(os.path.join(os.path.dirname(path), "cpu.cfs_period_us")) as f:
        return quota / int(f.read().strip())


def resolve_workers(value: int | str, cores: float | None = None) -> int:
    """Threads for a source's ``workers`` setting: an integer as given; ``auto``: the cores this process may use
    (``cores`` overrides, for tests), rounded down, in [1, MAX_AUTO_WORKERS]."""
    if value == "auto":
        c = available_cores() if cores is None else float(cores)
        return int(max(1, min(MAX_AUTO_WORKERS, math.floor(c + 1e-9))))
    n = int(value)
    if n < 1:
        raise ValueError(f"workers must be >= 1, got {value!r}")
    return n


@dataclass
class _Chunk:
    start: int  # stream position before the take
    raw: RawSamples | None = None
    error: BaseException | None = None  # a take made ahead that failed: raised when this chunk's turn comes
    future: Future | None = None
    nbytes: int = 0
    effects: list = field(default_factory=list)


def _raw_bytes(raw: RawSamples) -> int:
    return int(sum(getattr(c, "nbytes", 0) for c in raw.columns.values()))


class TransformPipeline:
    """``next(n)`` -> (raw, transformed) of the stream's next chunk, with up to ``workers`` chunks transformed ahead on
    a thread pool; ``workers == 1``: take and transform on the caller's thread (no pool, nothing ahead)."""

    def __init__(self, stream: SourceStream, transform: Callable[[RawSamples], TransformedSamples], workers: int = 1, *,
                 depth: int | None = None, max_bytes: int = DEFAULT_MAX_BYTES, name: str = ""):
        if int(workers) < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.stream, self.transform = stream, transform
        self.workers = int(workers)
        self.depth = int(depth) if depth is not None else 2 * self.workers
        if self.depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.max_bytes = int(max_bytes)
        self.name = name or str(getattr(stream, "name", "stream"))
        self._pool: ThreadPoolExecutor | None = None
        self._queue: deque[_Chunk] = deque()
        self._quarantine = getattr(transform, "quarantine", None)
        self.peak_chunks = 0  # most chunks in flight at once (tests, metrics)
        self.peak_bytes = 0  # most raw bytes in flight beyond the chunk waited for
        self.dropped_chunks = 0  # chunks taken ahead and dropped by a seek

    # -- state ---------------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self._queue)

    @property
    def in_flight_bytes(self) -> int:
        return sum(c.nbytes for c in self._queue)

    @property
    def position(self) -> int:
        """The stream position after the last chunk handed out: where an unpipelined stream would stand."""
        if self._queue:
            return self._queue[0].start
        return int(getattr(self.stream, "position", 0))

    def reset(self) -> None:
        """Drop what was taken ahead (before the stream is moved): their transforms' results and records are discarded."""
        while self._queue:
            c = self._queue.popleft()
            if c.future is not None:
                c.future.cancel()
            self.dropped_chunks += 1

    def close(self) -> None:
        self.reset()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # -- reading -------------------------------------------------------------------------------
    def _take(self, n: int, timeout: float | None) -> _Chunk:
        c = _Chunk(int(getattr(self.stream, "position", 0)))
        try:
            c.raw = self.stream.take(n) if timeout is None else self.stream.take(n, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - raised in order, when this chunk is the one asked for
            c.error = e
            return c
        c.nbytes = _raw_bytes(c.raw)
        if len(c.raw):
            assert self._pool is not None
            c.future = self._pool.submit(self._run, c.raw)
        return c

    def _run(self, raw: RawSamples) -> tuple[TransformedSamples, list]:
        q = self._quarantine
        if q is None or not hasattr(q, "deferred"):
            return self.transform(raw), []
        with q.deferred() as effects:
            return self.transform(raw), effects

    def _locate(self, e: Exception, raw: RawSamples, where: str) -> None:
        """Name the rows a failed transform was given (their file and row, from the stream's index) on the error."""
        pos: Any = getattr(raw, "positions", None)
        keys: Any = getattr(raw, "keys", None)
        if pos is None or keys is None or not len(pos):
            return
        what = f"source {self.name!r}: transforming the rows at stream positions {int(pos[0])}..{int(pos[-1])}{where}"
        locate = getattr(self.stream, "where_key", None)
        found = locate(int(keys[0])) if locate is not None else None
        if found is not None:
            what += f" (the first: file {found[0]}, row {found[1]})"
        e.add_note(what)

    def _top_up(self, n: int, live: bool) -> None:
        """Take chunks ahead while the bounds allow (a live source: only rows already there, never waiting)."""
        while len(self._queue) < self.depth:
            if len(self._queue) > 1 and self.in_flight_bytes - self._queue[0].nbytes >= self.max_bytes:
                break
            c = self._take(n, 0.0 if live else None)
            if c.raw is not None and not len(c.raw):
                break  # a dry live source: nothing more to take ahead now (an empty chunk is never queued)
            self._queue.append(c)
            self.peak_chunks = max(self.peak_chunks, len(self._queue))
            self.peak_bytes = max(self.peak_bytes, self.in_flight_bytes - self._queue[0].nbytes)
            if c.error is not None:
                break

    def next(self, n: int, *, timeout: float | None = None) -> tuple[RawSamples, TransformedSamples | None]:
        """The next chunk of up to ``n`` rows (the chunks taken ahead keep the size asked for when they were taken) and
        its transform; (empty rows, None) when a live source is dry past ``timeout``."""
        if self.workers == 1:
            raw = self.stream.take(n) if timeout is None else self.stream.take(n, timeout=timeout)
            try:
                return raw, (self.transform(raw) if len(raw) else None)
            except Exception as e:  # noqa: BLE001 - not swallowed: named with the rows it failed on, raised again
                self._locate(e, raw, "")
                raise
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix=f"mixplane-{self.name}-worker")
        if not self._queue:
            c = self._take(n, timeout)
            if c.raw is not None and not len(c.raw):
                return c.raw, None
            self._queue.append(c)
        self._top_up(n, bool(getattr(self.stream, "live", False)))
        self.peak_chunks = max(self.peak_chunks, len(self._queue))
        head = self._queue.popleft()
        if head.error is not None:
            self.reset()  # the stream stopped there: nothing after it can be handed out
            raise head.error
        assert head.raw is not None and head.future is not None
        try:
            out, effects = head.future.result()
        except Exception as e:  # noqa: BLE001 - not swallowed: the pool reset, the error named and raised again
            self.reset()
            self._locate(e, head.raw, " on a worker thread")
            raise
        if effects and self._quarantine is not None:
            self._quarantine.replay(effects)
        return head.raw, out


"""Bad units the loader skipped: what, where, why — and the counts behind
``mixplane_loader_quarantined_pages_total``."""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict, deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuarantineEntry:
    kind: str  # corrupt_file, corrupt_page, checksum, missing_column, type_mismatch, empty_file, unsupported
    file: str | None
    row_group: int | None
    column: str | None
    page: int | None
    # data pages of the first projected column lost: a page (run); every page of a row-group chunk; a
    # whole file's pages from its index, else (footer read, columns not) one per row group, else 1;
    # a chunk whose headers could not be scanned: exact when another column's chunk was bad, else an
    # estimate from the pages scanned before the bad header; 0 for a sample
    pages: int
    message: str


class QuarantineLog:
    """Thread-safe record of skipped files, pages and samples. ``pages_total`` feeds the Prometheus
    counter ``mixplane_loader_quarantined_pages_total``; ``units_total`` counts every unit recorded
    (a file, a page, or — in a transform's log — a sample); ``counts()`` breaks them down by kind.

    Memory is bounded: ``entries`` keeps the last ``max_entries`` records, and a unit is recognised
    as already recorded among the last ``max_seen`` units (None: all of them — right for pages and
    files, whose number is bounded by the source; a transform meets new sample keys every epoch).
    """

    def __init__(self, source: str = "", max_entries: int = 1000, max_seen: int | None = None):
        self.source = source
        self.entries: deque[QuarantineEntry] = deque(maxlen=max_entries)
        self.max_entries = max_entries
        self.max_seen = max_seen
        self.pages_total = 0
        self.files_total = 0
        self.units_total = 0
        self._by_kind: Counter[str] = Counter()
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self._lock = threading.Lock()
        # a sample's key -> (file, row in file): set by whoever knows the stream (the loader window), so a
        # quarantined sample's record and log line name its file
        self.locate: Callable[[int], tuple[str, int] | None] | None = None
        self._deferred = threading.local()  # a worker thread's records held until its chunk is handed out

    @contextmanager
    def deferred(self) -> Iterator[list]:
        """Within this block, this thread's :meth:`add` calls are only collected (into the list it yields) and
        recorded later by :meth:`replay`, in the order the caller chooses (loader.workers: the stream's order)."""
        held: list = []
        self._deferred.held = held
        try:
            yield held
        finally:
            self._deferred.held = None

    def replay(self, held: list) -> None:
        """Record what a :meth:`deferred` block collected."""
        for err, pages, whole_file in held:
            self.add(err, pages=pages, whole_file=whole_file)

    def add(self, err, *, pages: int = 1, whole_file: bool = False) -> bool:
        """Record an error (a ParquetError or anything with .kind/.file/...). Returns False if
        this exact unit was already recorded (a unit is counted once). Inside :meth:`deferred`: collected, True."""
        held = getattr(self._deferred, "held", None)
        if held is not None:
            held.append((err, pages, whole_file))
            return True
        kind = getattr(err, "kind", type(err).__name__)
        file, message = getattr(err, "file", None), str(err)
        if file is None and getattr(err, "unit", None) == "sample" and self.locate is not None:
            try:
                where = self.locate(int(err.page))
            except (TypeError, ValueError, IndexError):
                where = None
            if where is not None:
                file, message = where[0], f"{message} (file {where[0]}, row {where[1]})"
        key = (file, getattr(err, "row_group", None), getattr(err, "column", None), getattr(err, "page", None), whole_file)
        with self._lock:
            if key in self._seen:
                self._seen.move_to_end(key)
                return False
            self._seen[key] = None
            if self.max_seen is not None and len(self._seen) > self.max_seen:
                self._seen.popitem(last=False)
            self.entries.append(QuarantineEntry(kind=kind, file=key[0], row_group=key[1], column=key[2], page=key[3],
                                                pages=pages, message=message))
            self.pages_total += pages
            self.files_total += whole_file
            self.units_total += 1
            self._by_kind[kind] += 1
        unit = getattr(err, "unit", "file" if whole_file else "page")
        log.warning("source %r: quarantined %s: %s", self.source, unit, message)
        return True

    def counts(self) -> dict:
        with self._lock:
            return {"pages": self.pages_total, "files": self.files_total, "units": self.units_total,
                    "by_kind": dict(self._by_kind)}

    def messages(self) -> list[str]:
        with self._lock:
            return [e.message for e in self.entries]

"""The planner's resumable cursor: every window's position taken cheaply after a step and built (or written
as JSON) only when read -- the journal's checkpoints, replays and the cursor sent to every constructor."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np


class WindowMarks(Protocol):
    """What a cursor reads of one window (windows.ReplicaWindow)."""

    @property
    def low(self) -> int: ...
    @property
    def next_pos(self) -> int: ...
    @property
    def skip(self) -> set[int]: ...
    @property
    def restored_done(self) -> dict[int, int]: ...
    @property
    def listing(self) -> list[list[str]] | None: ...


class StoreColumns(Protocol):
    """What a cursor reads of the window store (windows.WindowStore): its windows in order, their (source,
    replica) ids, the columns, the window of every column entry and the entries compaction removed."""

    @property
    def windows(self) -> Sequence[WindowMarks]: ...
    @property
    def ids(self) -> list[tuple[int, int]]: ...
    @property
    def cols(self) -> dict[str, np.ndarray]: ...
    @property
    def win(self) -> np.ndarray: ...
    @property
    def gone(self) -> np.ndarray | None: ...


def window_cursor(low: int, next_pos: int, skip: set[int], restored: dict[int, int], listing: list[list[str]] | None,
                  partial_pos: list[int], partial_done: list[int]) -> dict[str, Any]:
    """A window's cursor (protocol.WindowCursor.to_json) from its state and its samples with partial progress."""
    # partial progress restored from a cursor but not yet re-announced by the loader counts too
    partial = {str(p): d for p, d in sorted(restored.items())} if restored else {}
    if partial_pos:
        partial.update(zip(map(str, partial_pos), partial_done))
    out: dict[str, Any] = {"low": low, "next": next_pos, "skip": sorted(skip), "partial": partial}
    if listing is not None:
        out["listing"] = [list(seg) for seg in listing]
    return out


class WindowCursors:
    """Every window's cursor entry (ReplicaWindow.cursor) as of one moment, taken cheaply and built when
    read: the windows' marks as Python ints, their skip sets (replaced, never changed in place), copies of
    the rare restored progress and live listings, and the samples with partial progress found in one pass
    over the store's columns (the block lists windows in order: each window's are one run of them). A
    step's plan carries the cursor before it, which only the journal's checkpoints and replays read."""

    def __init__(self, store: StoreColumns):
        ws = store.windows
        self.ids = store.ids
        self.low = [w.low for w in ws]
        self.next = [w.next_pos for w in ws]
        self.skip = [w.skip for w in ws]
        self.odd = {i: (dict(w.restored_done), None if w.listing is None else [list(seg) for seg in w.listing])
                    for i, w in enumerate(ws) if w.restored_done or w.listing is not None}
        done = store.cols["done"]
        nz = np.flatnonzero(done > 0 if store.gone is None else (done > 0) & ~store.gone)
        self.runs: dict[int, tuple[int, int]] = {}
        self.pos: list[int] = []
        self.got: list[int] = []
        if len(nz):
            wi = store.win[nz]
            cut = (np.flatnonzero(wi[1:] != wi[:-1]) + 1).tolist()
            self.runs = dict(zip(wi[[0, *cut]].tolist(), zip([0, *cut], [*cut, len(nz)])))
            self.pos = store.cols["pos"][nz].tolist()
            self.got = done[nz].tolist()

    def build(self) -> list[dict[str, Any]]:
        runs, pos, got = self.runs, self.pos, self.got
        keys = list(map(str, pos))
        # the common entry for every window (_window_cursor's keys, in its order), then the partial progress
        # where there is any, then the windows with restored progress or a listing in full
        out = [{"source": source, "replica": replica, "low": low, "next": nxt, "skip": sorted(skip) if skip else [],
                "partial": {}} for (source, replica), low, nxt, skip in zip(self.ids, self.low, self.next, self.skip)]
        for i, (a, b) in runs.items():
            out[i]["partial"] = dict(zip(keys[a:b], got[a:b]))
        for i, (restored, listing) in self.odd.items():
            a, b = runs.get(i, (0, 0))
            source, replica = self.ids[i]
            out[i] = {"source": source, "replica": replica, **window_cursor(self.low[i], self.next[i], self.skip[i], restored,
                                                                              listing, pos[a:b], got[a:b])}
        return out


_JSON = json.JSONEncoder(separators=(",", ":"))  # = json.dumps(.., separators=(",", ":"))


@dataclass(frozen=True)
class PlannerCursor:
    """StepPlanner.cursor() as of one moment; `build()` makes the dict (see WindowCursors)."""

    step: int
    sampler: dict[str, Any]
    schedule: dict[str, Any]
    windows: WindowCursors
    partitioning: dict[str, list[dict[str, Any]]] | None = None  # re-partitioned sources: their records
    listings: dict[str, str] | None = None  # static sources: the run's pinned listing (protocol.ListingPin.text)

    def build(self) -> dict[str, Any]:
        out = {"step": self.step, "sampler": self.sampler, "schedule": self.schedule, "windows": self.windows.build()}
        if self.partitioning:
            out["partitioning"] = self.partitioning
        if self.listings:
            out["listings"] = self.listings
        return out

    def json(self) -> str:
        """json.dumps(self.build(), separators=(",", ":")), the same text, written without the dicts: the cursor
        after every step travels to every constructor (~100 kB of JSON at 1,024 sources, ~2 entries a window
        built and encoded each step). Windows with restored progress or a live listing go through json.dumps."""
        w = self.windows
        compact = _JSON.encode
        runs, pos, got = w.runs, w.pos, w.got
        parts = []
        for i, ((source, replica), low, nxt, skip) in enumerate(zip(w.ids, w.low, w.next, w.skip)):
            if i in w.odd:
                continue
            ab = runs.get(i)
            partial = "{}" if ab is None else "{" + ",".join(f'"{p}":{d}' for p, d in zip(pos[ab[0]:ab[1]], got[ab[0]:ab[1]])) + "}"
            parts.append(f'{{"source":{source},"replica":{replica},"low":{low},"next":{nxt},'
                         f'"skip":[{",".join(map(str, sorted(skip))) if skip else ""}],"partial":{partial}}}')
        if w.odd:  # rare: in their places, as json.dumps writes them
            built = w.build()
            for i in sorted(w.odd):
                parts.insert(i, compact(built[i]))
        tail = f',"partitioning":{compact(self.partitioning)}' if self.partitioning else ""
        if self.listings:
            tail += f',"listings":{compact(self.listings)}'
        return (f'{{"step":{self.step},"sampler":{compact(self.sampler)},"schedule":{compact(self.schedule)},'
                f'"windows":[{",".join(parts)}]{tail}}}')

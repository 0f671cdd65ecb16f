"""Decoded units (pages, page parts, row-group chunks) a SourceStream holds while their rows are
still to be delivered, one cache kind per read order:

* :class:`ArenaCache` (page mode): units live in slabs (:class:`arena.RowArena`) from their first
  delivered row to their last; the units of mostly dead slabs are compacted to the rows still to
  come (:meth:`ArenaCache.before_take`), so memory stays within 1 / SLAB_LIVE_RATIO of the
  buffer's own rows plus one slab.
* :class:`PlainCache` (rowgroup, sequential): a unit is read for its block and dropped after it.
* :class:`LRUCache` (row): rows come from anywhere, so recently read pages are kept up to a byte budget.

The stream asks ``get(u, load)``, maps rows through ``remap`` (rows of a compacted unit moved),
and ``free``s the units its plan says are done. :class:`ByteLRU` is the byte-bounded LRU map of LRUCache and of the
source reader's decoded dictionaries.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Generic, Iterator, TypeVar

import numpy as np
import pyarrow as pa

from mixplane.loader.arena import RowArena
from mixplane.loader.parquet import int64_array
from mixplane.loader.shuffle import EpochPlan, PageParts, PagePlan

SLAB_LIVE_RATIO = 0.75  # relocate the units of a slab once its rows still to come fill no more than this share of it

K = TypeVar("K")
V = TypeVar("V")


class ByteLRU(Generic[K, V]):
    """A map of entries of known bytes, least recently used dropped first beyond ``budget_bytes`` (the newest entry
    always kept): LRUCache's units, the source reader's decoded dictionaries and split pages."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.nbytes = 0

    def get(self, key: K) -> tuple[V, int] | None:
        v = self.items.get(key)
        if v is not None:
            self.items.move_to_end(key)
        return v

    def put(self, key: K, value: V, nbytes: int) -> None:
        old = self.items.pop(key, None)
        if old is not None:
            self.nbytes -= old[1]
        self.items[key] = (value, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.budget and len(self.items) > 1:
            _, (_, nb) = self.items.popitem(last=False)
            self.nbytes -= nb

    def pop(self, key: K) -> None:
        old = self.items.pop(key, None)
        if old is not None:
            self.nbytes -= old[1]

    def clear(self) -> None:
        self.items.clear()
        self.nbytes = 0


Unit = dict[str, pa.Array]
Loader = Callable[[int], "Unit | None"]


class UnitCache:
    """Interface and the no-op parts shared by every cache kind."""

    def get(self, u: int, load: Loader) -> Unit | None:
        raise NotImplementedError

    def has(self, u: int) -> bool:
        """Whether unit ``u`` is held (a get would not load it)."""
        return u in getattr(self, "units", getattr(self, "items", ()))

    def remap(self, uniq: np.ndarray, inv: np.ndarray, local: np.ndarray) -> None:
        """Rewrite ``local`` (row within unit uniq[inv]) in place where a unit was compacted."""

    def free(self, units: list[int]) -> None:
        """Units whose last row was delivered."""

    def new_epoch(self) -> None:
        """A new epoch (or a seek) starts: units of the old plan are no longer needed."""
        self.clear()

    def before_take(self, plan: EpochPlan | None, layout: PageParts, pending: np.ndarray) -> None:
        """Between takes (no piece of a cached unit alive): a chance to compact."""

    def after_take(self) -> None:
        """A take's pieces are gone (copied into its result)."""

    def clear(self) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        return 0

    @property
    def resident_bytes(self) -> int:
        return 0


class PlainCache(UnitCache):
    def __init__(self) -> None:
        self.units: dict[int, Unit] = {}

    def get(self, u, load):
        d = self.units.get(u)
        if d is None:
            d = load(u)
            if d is not None:
                self.units[u] = d
        return d

    def free(self, units):
        for u in units:
            self.units.pop(u, None)

    def clear(self):
        self.units.clear()

    def __len__(self):
        return len(self.units)


class LRUCache(UnitCache):
    """Recently read units up to ``budget_bytes`` (the newest one is always kept)."""

    def __init__(self, budget_bytes: int):
        self.lru: ByteLRU[int, Unit] = ByteLRU(int(budget_bytes))

    def get(self, u, load):
        hit = self.lru.get(u)
        if hit is not None:
            return hit[0]
        d = load(u)
        if d is not None:
            self.lru.put(u, d, sum(a.nbytes for a in d.values()))
        return d

    def has(self, u: int) -> bool:
        return u in self.lru.items

    def new_epoch(self):
        pass  # pages stay pages across epochs: a page read late in one epoch may serve the next

    def clear(self):
        self.lru.clear()


class ArenaCache(UnitCache):
    """Page mode: units in slab memory, compacted when their slabs are mostly delivered."""

    def __init__(self, slab_bytes: int = 4 << 20):
        self.units: dict[int, Unit] = {}
        self.maps: dict[int, np.ndarray] = {}  # unit -> row-in-unit to row-in-cached-data, after compaction
        self.held: dict[int, int] = {}  # unit -> rows its cached data holds, after compaction
        self.arena = RowArena(slab_bytes)

    def get(self, u, load):
        d = self.units.get(u)
        if d is None:
            d = load(u)
            if d is not None:
                d = self.arena.store(u, {c: _compact(a) for c, a in d.items()})
                self.units[u] = d
        return d

    def remap(self, uniq, inv, local):
        if not self.maps:
            return
        for j, u in enumerate(uniq.tolist()):
            m = self.maps.get(u)
            if m is not None:
                sel = inv == j
                local[sel] = m[local[sel]]
                if (local[sel] < 0).any():
                    raise AssertionError("compacted unit lost a row that is still to be delivered")

    def free(self, units):
        for u in units:
            self._drop(u)

    def _drop(self, u: int) -> None:
        self.units.pop(u, None)
        self.maps.pop(u, None)
        self.held.pop(u, None)
        self.arena.release(u)

    def clear(self):
        self.units.clear()
        self.maps.clear()
        self.held.clear()
        self.arena.clear()

    def __len__(self):
        return len(self.units)

    @property
    def resident_bytes(self) -> int:
        return self.arena.resident_bytes

    def arena_units(self) -> Iterator[tuple[int, int]]:
        """(unit, bytes it occupies in its slab) of the cached units held in slabs."""
        for u in self.units:
            sid = self.arena.slab_of(u)
            if sid is not None:
                yield u, self.arena._slabs[sid].units[u]

    def after_take(self):
        self.arena.reclaim()  # slabs emptied during the take once its pieces are gone

    def before_take(self, plan, layout, pending):
        """Move the units of mostly dead slabs, cut to the rows still to be delivered (buffered in
        the plan's shuffle, or ``pending`` in the current block), into the newest slab. With ratio r
        every relocated byte frees at least (1 - r) / r bytes, so each decoded byte is copied at most
        about r / (1 - r) more times; and every slab but the newest is more than r full of rows still
        to come."""
        if not isinstance(plan, PagePlan) or not self.units:
            return
        sim = plan.sim
        held, left = self.held, sim.left
        live = {}
        for u, nb in self.arena_units():
            h = held.get(u)
            if h is None:
                h = int(layout.size(u))
            live[u] = nb * left.get(u, 0) / max(h, 1)
        victims = sorted(u for u in self.arena.sparse_slabs(live, SLAB_LIVE_RATIO) if u in self.units)
        if not victims:
            return
        owner, ids = sim.owner[: sim.size], sim.buf[: sim.size]
        sel = np.isin(owner, victims)
        own, rid = owner[sel], ids[sel]
        # rows of the current block not yet taken are still to be delivered too
        bu, bl = layout.unit_and_local(pending)
        bsel = np.isin(bu, victims)
        _, rl = layout.unit_and_local(rid)
        own = np.concatenate([own, bu[bsel]])
        loc = np.concatenate([rl, bl[bsel]])
        order = np.lexsort((loc, own))
        own, loc = own[order], loc[order]
        bounds = np.searchsorted(own, np.array(victims + [np.iinfo(np.int64).max], np.int64))
        for i, u in enumerate(victims):
            local = loc[bounds[i] : bounds[i + 1]]
            if not len(local):  # every row delivered: nothing to keep
                self._drop(u)
                continue
            old = self.maps.get(u)
            cur = old[local] if old is not None else local
            m = np.full(int(layout.size(u)), -1, np.int64)
            m[local] = np.arange(len(local))
            idx = int64_array(cur)
            cut = {c: a.take(idx) for c, a in self.units[u].items()}
            self.arena.release(u)
            self.units[u] = self.arena.store(u, cut)
            self.maps[u] = m
            held[u] = len(local)
        self.arena.reclaim()


def _compact(a: pa.Array) -> pa.Array:
    """``a`` on buffers of its own size (a slice of a larger decoded run is copied out)."""
    if a.offset or a.get_total_buffer_size() > 1.25 * a.nbytes + 4096:
        return a.take(int64_array(np.arange(len(a))))
    return a

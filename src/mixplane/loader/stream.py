"""A source partition as a deterministic, infinite, seekable stream of rows.

Contract (used by the loader server, the planner's journal replay and `mixplane replay`):

* The stream emits the rows of one partition of a source, epoch after epoch. Epoch e's order is a
  pure function of (seed, source name, e, partition, num_partitions) and the source's files.
* ``position`` counts rows emitted since the start of epoch 0; ``seek(p)`` makes the next
  ``take`` return exactly what an unbroken stream would have returned at position p.
* Every row carries a key ``make_key(epoch, row)`` where ``row`` is its index in the source
  (files sorted by path, rows in file order), so repeats within an epoch are detectable.

This module holds the simple row-group shuffle; page-level reading lives beside it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from mixplane.loader.files import SourceFiles, list_source_files, open_parquet
from mixplane.samples import make_key
from mixplane.spec import SourceSpec


@dataclass
class RawSamples:
    """Rows taken from a stream: keys, stream positions and the projected columns."""

    keys: np.ndarray  # int64
    positions: np.ndarray  # int64
    columns: dict[str, pa.Array] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.keys)


def epoch_rng(seed: int, source: str, epoch: int, *salt: int) -> np.random.Generator:
    """Independent, reproducible randomness per (seed, source, epoch, ...)."""
    return np.random.default_rng([seed & 0xFFFFFFFF, zlib.crc32(source.encode()), epoch, *salt])


@dataclass
class _Unit:
    file: int
    row_group: int
    first_row: int  # index of the unit's first row in the source
    rows: int


class RowGroupStream:
    """Row-group shuffle: random row-group order per epoch, rows shuffled within the group."""

    def __init__(self, source: SourceSpec, *, seed: int, partition: int = 0, num_partitions: int = 1,
                 files: SourceFiles | None = None):
        if not 0 <= partition < num_partitions:
            raise ValueError(f"partition {partition} not in [0, {num_partitions})")
        self.source = source
        self.seed = seed
        self.partition = partition
        self.num_partitions = num_partitions
        self.files = files or list_source_files(source.uri)
        self.columns = list(source.columns)
        self.units: list[_Unit] = []
        first = 0
        for fi, path in enumerate(self.files.paths):
            meta = open_parquet(self.files, path).metadata
            for rg in range(meta.num_row_groups):
                n = meta.row_group(rg).num_rows
                if n:
                    self.units.append(_Unit(fi, rg, first, n))
                first += n
        if not self.units:
            raise ValueError(f"source {source.name!r}: no rows in {source.uri}")
        self._unit_rows = np.array([u.rows for u in self.units], dtype=np.int64)
        self._epoch = 0
        self._epoch_units: np.ndarray = self._order(0)
        self._epoch_cum = np.concatenate([[0], np.cumsum(self._unit_rows[self._epoch_units])])
        self._epoch_start = 0  # stream position where the current epoch begins
        self._offset = 0  # position within the epoch
        self._cache: tuple[int, int, dict[str, pa.Array], np.ndarray] | None = None
        self._open: dict[int, object] = {}

    # -- order --------------------------------------------------------------------------
    def _order(self, epoch: int) -> np.ndarray:
        perm = epoch_rng(self.seed, self.source.name, epoch).permutation(len(self.units))
        mine = perm[self.partition :: self.num_partitions]
        if len(mine) == 0:
            raise ValueError(f"source {self.source.name!r}: partition {self.partition} of {self.num_partitions} has no row groups")
        return mine

    def _set_epoch(self, epoch: int, epoch_start: int) -> None:
        self._epoch = epoch
        self._epoch_units = self._order(epoch)
        self._epoch_cum = np.concatenate([[0], np.cumsum(self._unit_rows[self._epoch_units])])
        self._epoch_start = epoch_start
        self._offset = 0

    @property
    def position(self) -> int:
        return self._epoch_start + self._offset

    def seek(self, position: int) -> None:
        if position < 0:
            raise ValueError("position must be >= 0")
        self._set_epoch(0, 0)
        while position - self._epoch_start >= self._epoch_cum[-1]:
            self._set_epoch(self._epoch + 1, self._epoch_start + int(self._epoch_cum[-1]))
        self._offset = position - self._epoch_start

    # -- reading ------------------------------------------------------------------------
    def _unit_data(self, k: int) -> tuple[dict[str, pa.Array], np.ndarray]:
        ui = int(self._epoch_units[k])
        if self._cache is not None and self._cache[0] == self._epoch and self._cache[1] == ui:
            return self._cache[2], self._cache[3]
        u = self.units[ui]
        pf = self._open.get(u.file)
        if pf is None:
            pf = self._open[u.file] = open_parquet(self.files, self.files.paths[u.file])
        table = pf.read_row_group(u.row_group, columns=self.columns)  # type: ignore[attr-defined]
        perm = epoch_rng(self.seed, self.source.name, self._epoch, 1, ui).permutation(u.rows)
        cols = {c: table.column(c).combine_chunks().take(pa.array(perm)) for c in self.columns}
        rows = u.first_row + perm.astype(np.int64)
        self._cache = (self._epoch, ui, cols, rows)
        return cols, rows

    def take(self, n: int) -> RawSamples:
        keys, poss, parts = [], [], {c: [] for c in self.columns}
        while n > 0:
            if self._offset >= self._epoch_cum[-1]:
                self._set_epoch(self._epoch + 1, self._epoch_start + int(self._epoch_cum[-1]))
            k = int(np.searchsorted(self._epoch_cum, self._offset, side="right") - 1)
            cols, rows = self._unit_data(k)
            lo = self._offset - int(self._epoch_cum[k])
            hi = min(len(rows), lo + n)
            keys.append(make_key(self._epoch, rows[lo:hi]))
            poss.append(np.arange(self.position, self.position + hi - lo, dtype=np.int64))
            for c in self.columns:
                parts[c].append(cols[c].slice(lo, hi - lo))
            self._offset += hi - lo
            n -= hi - lo
        if not keys:
            return RawSamples(np.zeros(0, np.int64), np.zeros(0, np.int64), {})
        return RawSamples(np.concatenate(keys), np.concatenate(poss),
                          {c: pa.concat_arrays(v) for c, v in parts.items()})

    def close(self) -> None:
        self._open.clear()
        self._cache = None


def open_stream(source: SourceSpec, *, seed: int, partition: int = 0, num_partitions: int = 1):
    """The stream for a source's configured shuffle mode."""
    return RowGroupStream(source, seed=seed, partition=partition, num_partitions=num_partitions)

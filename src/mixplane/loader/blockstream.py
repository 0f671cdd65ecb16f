"""A large source read block by block (`BlockStream`): indexed lazily in read order, the next block in the background.

The stream contract of :class:`mixplane.loader.stream.SourceStream` (deterministic for a seed, ``seek(p)`` exact, keys
unique per (epoch, row), quarantined slots left empty) over the block order of :mod:`mixplane.loader.blocks`: each
block is a small page-mode ``SourceStream`` over the block's files, with a seed drawn per (epoch, block), built (its
files indexed, from the block's pack when kept) when the read order reaches it -- the next ``LOOKAHEAD_BLOCKS`` on a
background thread while the current one is read. A position names (epoch, block, offset), so ``seek`` indexes only
the block it lands in. A re-partitioned source reads its prefix pieces (slot ranges of older partitions' block
orders) first. Not supported here: live sources, other shuffle modes.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from mixplane.loader.blocks import (
    LOOKAHEAD_BLOCKS, MAX_BLOCK_SLOTS, OFFSET_BITS, RECENT_BLOCKS, BlockError, BlockLayout, decode_position,
    encode_position,
)
from mixplane.loader.files import SourceFiles
from mixplane.loader.pageindex import SourceIndex
from mixplane.loader.parquet import IOStats
from mixplane.loader.quarantine import QuarantineLog
from mixplane.loader.stream import STATE_VERSION, RawSamples, SourceStream, StreamError
from mixplane.repartition import Layout, Piece, RepartitionError
from mixplane.samples import key_row, make_key
from mixplane.spec import SourceSpec

log = logging.getLogger(__name__)


Place = tuple[int, int, int]  # (prefix piece or -1 for an own epoch, epoch, block's place j in that order)


class BlockStream:
    """A static page-mode source of many files as a stream of blocks (see the module's docstring).

    What is read is a *place* after another: block j of the block order of (epoch, partition, num_partitions) --
    this partition's own epochs, or, after a re-partition (:mod:`mixplane.repartition`), first the slot ranges of
    older partitions' epochs its prefix pieces name (a piece's slots are ``j << 30 | offset`` of that order)."""

    live = False
    dry = False

    def __init__(self, source: SourceSpec, *, seed: int, files: SourceFiles, partition: int = 0,
                 num_partitions: int = 1, quarantine: QuarantineLog | None = None, stats: IOStats | None = None,
                 **options: Any):
        if not 0 <= partition < num_partitions:
            raise ValueError(f"partition {partition} not in [0, {num_partitions})")
        self.source, self.name, self.mode = source, source.name, source.shuffle
        self.seed, self.partition, self.num_partitions = int(seed), int(partition), int(num_partitions)
        self.columns = list(source.columns)
        self.files = files
        self.blocks = BlockLayout(len(files.paths), int(source.block_files), self.seed, self.name)
        self.per_epoch = self.blocks.blocks_per_epoch(self.partition, self.num_partitions)
        if self.per_epoch < 1:
            raise StreamError(f"source {self.name!r}: {self.blocks.num_blocks} blocks of {source.block_files} files "
                              f"cannot be split into {self.num_partitions} partitions (lower sources[].block_files)")
        self.quarantine = quarantine if quarantine is not None else QuarantineLog(source.name)
        self.stats = stats if stats is not None else IOStats()
        self._options = dict(options)
        self.buffer_rows = int(options.get("buffer_rows", source.shuffle_buffer))
        self.page_reads = options.get("page_reads")
        self._orders: OrderedDict[tuple[int, int, int], np.ndarray] = OrderedDict()  # (epoch, p, N) -> order
        self._ahead: dict[Place, Future] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"mixplane-{self.name}-blocks")
        self._recent: OrderedDict[int, tuple[np.ndarray, list[str]]] = OrderedDict()  # block -> rows, paths
        self._prefix: tuple[Piece, ...] = ()
        self._base_epoch, self._base_pos = 0, 0
        self._place: Place = (-1, 0, 0)
        self._cur: SourceStream | None = None  # the block being read (None: empty, or not built yet)
        self._stop = 0  # the block's slot where reading it ends (its rows, or the end of a prefix piece)
        self._opened = False
        self._floor = 0  # the last seek's position: a seek into a block's unused slots stays there until a read
        # the first block's footers are read while the loader starts up (not its pages: a resume seeks elsewhere)
        self._prefetch((-1, 0, 0), pages=False)

    # ------------------------------------------------------------------------------------------
    # places and blocks

    def _ctx(self, t: int) -> tuple[int, int]:
        """(partition, num_partitions) whose block order place's piece ``t`` (-1: own epochs) follows."""
        if t < 0:
            return self.partition, self.num_partitions
        pc = self._prefix[t]
        return pc.partition, pc.num_partitions

    def _order(self, epoch: int, p: int, n: int) -> np.ndarray:
        k = (epoch, p, n)
        o = self._orders.get(k)
        if o is None:
            o = self._orders[k] = self.blocks.order(epoch, p, n)
            while len(self._orders) > 8:
                self._orders.popitem(last=False)
        return o

    def block_of(self, place: Place) -> int:
        t, epoch, j = place
        return int(self._order(epoch, *self._ctx(t))[j])

    def _piece_start(self, t: int) -> int:
        return self._base_pos - sum(len(p) for p in self._prefix[t:])

    def _block_position(self, place: Place) -> int:
        """Stream position of slot 0 of the place's block (a prefix piece's may lie before the piece starts)."""
        t, epoch, j = place
        if t < 0:
            return encode_position(self._base_pos, self._base_epoch, self.per_epoch, epoch, j, 0)
        return self._piece_start(t) + (j << OFFSET_BITS) - self._prefix[t].lo

    def _first_of_piece(self, t: int) -> Place:
        if t >= len(self._prefix):
            return (-1, self._base_epoch, 0)
        pc = self._prefix[t]
        return (t, pc.epoch, pc.lo >> OFFSET_BITS)

    def _next_place(self, place: Place) -> Place:
        t, epoch, j = place
        if t < 0:
            return (t, epoch, j + 1) if j + 1 < self.per_epoch else (t, epoch + 1, 0)
        pc = self._prefix[t]
        if ((j + 1) << OFFSET_BITS) < pc.hi:
            return (t, epoch, j + 1)
        return self._first_of_piece(t + 1)

    def _block_files(self, block: int) -> SourceFiles:
        ids = self.blocks.members(block).tolist()
        f = self.files
        return SourceFiles(f.uri, f.filesystem, [f.paths[i] for i in ids], [f.sizes[i] for i in ids],
                           [f.mtimes_ns[i] for i in ids])

    def _build(self, block: int, files: SourceFiles, seed: int, prefetch: bool = False) -> SourceStream | None:
        """A block's stream: its files indexed (bad ones quarantined by name); None when no row is readable.
        Runs on the look-ahead thread: everything it needs from this object is computed before."""
        try:
            s = SourceStream(self.source, seed=seed, files=files, quarantine=self.quarantine, stats=self.stats,
                             index_options={"use_pack": True, "use_recent": False}, **self._options)
        except StreamError as e:
            log.warning("source %r: block %d has no readable rows: %s", self.name, block, e)
            return None
        if s.epoch_len > MAX_BLOCK_SLOTS:
            s.close()
            raise StreamError(f"source {self.name!r}: block {block} holds {s.epoch_len} rows, more than a block's "
                              f"{MAX_BLOCK_SLOTS} slots (lower sources[].block_files)")
        if prefetch:
            s.prefetch()  # remote: the pages of the block's first shuffle buffer, fetched while the block before is read
        return s

    def _submit(self, place: Place, prefetch: bool = False) -> Future:
        b = self.block_of(place)
        return self._pool.submit(self._build, b, self._block_files(b), self.blocks.block_seed(place[1], b), prefetch)

    def _prefetch(self, place: Place, pages: bool = True) -> None:
        """Index the place's block in the background (and, remote, fetch the pages of its first shuffle buffer)."""
        if place not in self._ahead:
            self._ahead[place] = self._submit(place, prefetch=pages)

    def _open(self, place: Place, offset: int = 0) -> None:
        """Read the place's block from its slot ``offset`` on (built now unless the look-ahead has it)."""
        if self._cur is not None:
            self._cur.close()
        fut = self._ahead.pop(place, None) or self._submit(place)
        wanted, nxt = [], place
        for _ in range(LOOKAHEAD_BLOCKS):
            nxt = self._next_place(nxt)
            wanted.append(nxt)
        # blocks indexed ahead for another place in the order are dropped (a seek moved elsewhere)
        for k in [k for k in self._ahead if k not in wanted]:
            self._ahead.pop(k).add_done_callback(_close_result)
        for k in wanted:  # the next blocks are indexed while this one is read
            self._prefetch(k)
        cur = fut.result()
        self._place, self._opened, self._cur = place, True, cur
        rows = cur.epoch_len if cur is not None else 0
        t, _, j = place
        self._stop = rows if t < 0 else max(0, min(rows, self._prefix[t].hi - (j << OFFSET_BITS)))
        if t >= 0 and j == self._prefix[t].lo >> OFFSET_BITS:  # a piece begins inside its first block
            offset = max(offset, self._prefix[t].lo & (MAX_BLOCK_SLOTS - 1))
        if cur is not None:
            self._remember(self.block_of(place), cur)
            cur.seek(min(offset, self._stop))

    def _remember(self, block: int, s: SourceStream) -> None:
        """Enough of a block's index to name the file of a key's row (where_key), for the last RECENT_BLOCKS blocks."""
        self._recent[block] = (np.asarray(s.index.file_row_start, np.int64), [f.path for f in s.index.files])
        self._recent.move_to_end(block)
        while len(self._recent) > RECENT_BLOCKS:
            self._recent.popitem(last=False)

    def _ensure_open(self) -> None:
        if not self._opened:
            self._open(self._place)

    # ------------------------------------------------------------------------------------------
    # positions

    @property
    def position(self) -> int:
        off = self._cur.position if (self._opened and self._cur is not None) else 0
        if self._place[0] >= 0 and not self._opened:
            off = self._prefix[self._place[0]].lo & (MAX_BLOCK_SLOTS - 1)
        return max(self._block_position(self._place) + off, self._floor)

    @property
    def epoch(self) -> int:
        return self._place[1]

    @property
    def index(self) -> SourceIndex:
        """The index of the block being read (a large source has no index of every file)."""
        self._ensure_open()
        return self._cur.index if self._cur is not None else SourceIndex(self.columns, self.source.kind)

    def seek(self, position: int) -> None:
        """Continue at slot ``position``, exactly as an unbroken stream would: only its block is indexed."""
        position = int(position)
        self._seek(position)
        self._floor = position

    def _seek(self, position: int) -> None:
        first = self._piece_start(0) if self._prefix else self._base_pos
        if position < first:
            raise ValueError(f"source {self.name!r}: position {position} is before this stream's start ({first})")
        for t, pc in enumerate(self._prefix):
            start = self._piece_start(t)
            if position < start + len(pc):
                j, off = divmod(pc.lo + position - start, MAX_BLOCK_SLOTS)
                self._open((t, pc.epoch, j), off)
                return
        try:
            e, j, off = decode_position(position, self._base_pos, self._base_epoch, self.per_epoch)
        except BlockError as err:
            raise ValueError(f"source {self.name!r}: {err}") from None
        self._open((-1, e, j), off)

    def epoch_rows(self, epoch: int, partition: int, num_partitions: int) -> int:
        """Slots an epoch of a partition spans (positions are not dense: each block owns 2^30 of them)."""
        return self.blocks.blocks_per_epoch(partition, num_partitions) * MAX_BLOCK_SLOTS

    def start_epoch(self, epoch: int, position: int = 0) -> None:
        """Make slot ``position`` the start of ``epoch`` (replicas changed at an epoch boundary)."""
        self._prefix = ()
        self._base_epoch, self._base_pos = int(epoch), int(position)
        self.seek(int(position))

    def _check_prefix(self, prefix: Sequence[Piece]) -> None:
        for pc in prefix:
            span = self.epoch_rows(pc.epoch, pc.partition, pc.num_partitions)
            if not 0 <= pc.lo <= pc.hi <= span:
                raise StreamError(f"source {self.name!r}: piece {pc.to_json()} is not within its plan's {span} slots "
                                  "(the listing or block_files changed since the re-partition?)")

    def set_layout(self, layout: Layout) -> None:
        """Read ``layout`` (a re-partitioned source): its prefix pieces from position 0, then own epochs."""
        if (layout.partition, layout.num_partitions) != (self.partition, self.num_partitions):
            raise ValueError(f"source {self.name!r}: layout of partition {layout.partition} of "
                             f"{layout.num_partitions} given to partition {self.partition} of {self.num_partitions}")
        self._check_prefix(layout.prefix)
        self._prefix = tuple(layout.prefix)
        self._base_epoch, self._base_pos = int(layout.epoch), layout.prefix_rows
        self.seek(0)

    def layout(self) -> Layout:
        return Layout(self.partition, self.num_partitions, self._prefix, self._base_epoch)

    @property
    def order(self) -> str:
        """The read order positions count in: block by block, ``blocks:<block_files>``."""
        return f"blocks:{self.blocks.block_files}"

    def listing(self) -> list[list[str]] | None:
        return None

    def restore_listing(self, segs: Sequence[Sequence[str]]) -> None:
        return None

    # ------------------------------------------------------------------------------------------
    # reading

    def take(self, n: int, *, timeout: float | None = None) -> RawSamples:
        """The next ``n`` rows, block after block, epoch after epoch."""
        self._ensure_open()
        n = int(n)
        keys: list[np.ndarray] = []
        poss: list[np.ndarray] = []
        parts: dict[str, list[pa.Array]] = {c: [] for c in self.columns}
        got = 0
        barren = 0  # blocks passed in a row without a row delivered
        while got < n:
            cur = self._cur
            if cur is None or cur.position >= self._stop:
                barren += 1
                if barren > self.per_epoch + len(self._prefix) + 1:
                    raise StreamError(f"source {self.name!r}: every block of partition {self.partition} is "
                                      f"unreadable ({self.quarantine.counts()})")
                self._open(self._next_place(self._place))
                continue
            r = cur.take(n - got, until=self._stop)
            if not len(r):
                continue
            t, epoch, _ = self._place
            pos = r.positions + self._block_position(self._place)
            keep = slice(None)
            if t >= 0 and self._prefix[t].skip:  # slots consumed before the re-partition stay empty
                pc = self._prefix[t]
                kept = ~np.isin(pos, np.asarray(pc.skip, np.int64) - pc.lo + self._piece_start(t))
                if not kept.all():
                    keep = kept  # type: ignore[assignment]
            block = self.block_of(self._place)
            k = np.asarray(make_key(epoch, self.blocks.key_row(block, np.asarray(key_row(r.keys)))))[keep]
            if not len(k):
                continue
            keys.append(k)
            poss.append(pos[keep])
            for c in self.columns:
                col = r.columns[c]
                parts[c].append(col if isinstance(keep, slice) else col.filter(pa.array(keep)))
            got += len(k)
            barren = 0
        if not keys:
            return RawSamples(np.zeros(0, np.int64), np.zeros(0, np.int64), {c: pa.nulls(0) for c in self.columns})
        cols = {c: pa.concat_arrays(v) if len(v) > 1 else v[0] for c, v in parts.items()}
        return RawSamples(np.concatenate(keys), np.concatenate(poss), cols)

    def where_key(self, key: int) -> tuple[str, int] | None:
        """(file path, row within that file) of a sample key, for a block read lately (None otherwise)."""
        if key < 0:
            return None
        block, row = self.blocks.split_key_row(int(key_row(key)))
        got = self._recent.get(block)
        if got is None:
            return None
        starts, paths = got
        if not len(starts) or not 0 <= row < int(starts[-1]):
            return None
        f = int(np.searchsorted(starts, row, side="right")) - 1
        return paths[f], row - int(starts[f])

    # ------------------------------------------------------------------------------------------
    # status, state

    def status(self) -> dict:
        idx = self._cur.index if self._cur is not None else None
        return {"source": self.name, "mode": self.mode, "partition": self.partition,
                "num_partitions": self.num_partitions, "position": self.position, "epoch": self.epoch,
                "order": "blocks", "block": self._place[2], "blocks_per_epoch": self.per_epoch,
                "prefix_pieces": len(self._prefix),
                "files": len(self.files.paths), "block_files": len(idx.files) if idx is not None else 0,
                "rows": idx.num_rows if idx is not None else 0, "pages": idx.num_pages if idx is not None else 0,
                "index_bytes": idx.nbytes if idx is not None else 0,
                "index_bytes_per_page": idx.bytes_per_page if idx is not None else 0.0,
                "bytes_read": self.stats.bytes_read, "reads": self.stats.reads, "live": False, "dry": False,
                "dry_seconds": 0.0, "quarantined": self.quarantine.counts(),
                "buffered_pages": len(self._cur.cache) if self._cur is not None else 0,
                "slab_bytes": self._cur.cache.resident_bytes if self._cur is not None else 0}

    def status_line(self) -> str:
        s = self.status()
        return (f"source {self.name!r}: position {s['position']} epoch {s['epoch']} block {s['block']} of "
                f"{s['blocks_per_epoch']}, {s['files']} files, {s['quarantined']['pages']} pages quarantined")

    def state_dict(self) -> dict:
        pos = self.position
        t, e, j = self._place
        if t < 0:
            e, j, off = decode_position(pos, self._base_pos, self._base_epoch, self.per_epoch)
            start = encode_position(self._base_pos, self._base_epoch, self.per_epoch, e, 0, 0)
        else:
            off, start = pos - self._block_position(self._place), self._piece_start(t)
        st = {"version": STATE_VERSION, "source": self.name, "mode": self.mode, "seed": self.seed,
              "partition": self.partition, "num_partitions": self.num_partitions, "position": pos,
              "epoch": e, "epoch_start": start, "base_epoch": self._base_epoch, "base_position": self._base_pos,
              "buffer_rows": self.buffer_rows, "page_reads": self.page_reads, "order": "blocks",
              "files": len(self.files.paths), "block_files": self.blocks.block_files, "block": j, "offset": off}
        if self._prefix:
            st["prefix"] = [p.to_json() for p in self._prefix]
        return st

    def load_state_dict(self, st: dict) -> None:
        """Resume exactly where ``st`` was taken; another (partition, num_partitions) only at an epoch boundary."""
        if st.get("version") != STATE_VERSION or st.get("order") != "blocks":
            raise ValueError(f"stream state version {st.get('version')} (order {st.get('order', 'pages')!r}) is not "
                             f"a block-order state of version {STATE_VERSION}: source {self.name!r} has "
                             f"{len(self.files.paths)} files and is read block by block (sources[].lazy_index_files); "
                             "a state saved in the whole source's page order resumes with lazy_index_files: 0")
        for k, mine in (("source", self.name), ("mode", self.mode), ("seed", self.seed),
                        ("buffer_rows", self.buffer_rows), ("page_reads", self.page_reads),
                        ("files", len(self.files.paths)), ("block_files", self.blocks.block_files)):
            if st.get(k) != mine:
                raise ValueError(f"stream state is for {k}={st.get(k)!r}, this stream has {mine!r}")
        if (st["partition"], st["num_partitions"]) == (self.partition, self.num_partitions):
            try:
                prefix = tuple(Piece.parse(p) for p in st.get("prefix", []))
            except RepartitionError as e:
                raise ValueError(f"stream state: {e}") from None
            self._check_prefix(prefix)
            self._prefix = prefix
            self._base_epoch, self._base_pos = int(st["base_epoch"]), int(st["base_position"])
            self.seek(int(st["position"]))
            return
        if st["position"] != st["epoch_start"] or st.get("prefix"):
            raise ValueError("the number of partitions can only change at an epoch boundary "
                             f"(state is {st['position'] - st['epoch_start']} slots into epoch {st['epoch']})")
        self.start_epoch(int(st["epoch"]), int(st["position"]))

    def close(self) -> None:
        for f in self._ahead.values():
            f.add_done_callback(_close_result)
        self._ahead.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._cur is not None:
            self._cur.close()
            self._cur = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _close_result(fut: Future) -> None:
    """Close the stream a dropped look-ahead built (its reader's files)."""
    try:
        s = fut.result()
    except Exception:  # noqa: BLE001 - a block nobody reads: its error does not matter
        return
    if s is not None:
        s.close()

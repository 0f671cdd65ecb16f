"""The planner's loader windows: each replica's unconsumed read-ahead samples (ReplicaWindow) and the
columnar store that holds every window's columns for a step's gather, consumption and compaction (WindowStore)."""

from __future__ import annotations

from array import array
from typing import Any, NoReturn

import numpy as np

from mixplane.errors import MixplaneError
from mixplane.planner import selectloop
from mixplane.protocol import WindowCursor, window_full
from mixplane.planner.cursors import WindowCursors, window_cursor


class WindowError(MixplaneError, ValueError):
    """Metadata from a loader that contradicts the window (out of order, duplicate, bad sizes)."""

FIELDS = ("pos", "key", "tokens", "patches", "done")
_I64 = np.dtype(np.int64)

class ReplicaWindow:
    """The planner's view of one loader replica's unconsumed read-ahead samples, in stream order.

    Inside a StepPlanner the arrays are views of the planner's columnar store of every window
    (`WindowStore`): a step gathers, compacts and writes consumption back once for all windows, and
    `add` (one LOADER_META) detaches only its own window until the next step gathers it again. What
    `add` takes is kept as pending chunks (in the store's staging area), joined to the arrays only when
    they are read; the store's gather reads them where they are staged."""

    _i: int  # its index among the store's windows (set by the store)

    def __init__(self, source: int, replica: int, min_samples: int, min_tokens: int = 0, max_samples: int | None = None):
        self.source = source
        self.replica = replica
        self.min_samples = min_samples
        self.min_tokens = min_tokens
        self.capacity = max_samples if max_samples is not None else min_samples
        # pos, key, tokens, patches, done (tokens already delivered of each sample): see the properties
        self._cols: list[np.ndarray] | None = [np.zeros(0, np.int64) for _ in FIELDS]  # None: a slice of _home
        self._home: Any = None  # the WindowStore whose block holds this window's samples at [_lo, _lo + _base_n)
        self._lo = self._base_n = 0
        self._pending: list[np.ndarray] = []  # chunks `add` took (len(FIELDS) x n), not yet joined to the arrays
        self._n = 0  # samples held, pending chunks included
        self.low = 0  # every position below is fully consumed
        self.next_pos = 0  # first position not yet received
        self.skip: set[int] = set()  # consumed positions in [low, next); replaced, never changed in place
        self.skip_hi = -1  # no skip entry above this restored one: later adds need no membership test
        self.restored_done: dict[int, int] = {}
        self.dry = False
        self.listing: list[list[str]] | None = None  # live source: the file segments its positions count over
        self.unconsumed = 0  # tokens left, as of the last add / compact / restore (the planner's writes between
        #                     select and compact are not counted until compact recounts)
        self.stored: Any = None  # the WindowStore whose views the arrays are (None: this window holds its own)

    def __len__(self) -> int:
        return self._n

    def _base(self) -> list[np.ndarray]:
        """The arrays without the pending chunks (views of the store's block are made when first read; after
        the store's compaction, until its next gather, read-only copies without the consumed samples)."""
        if self._cols is None:
            home = self._home
            lo, hi, block = self._lo, self._lo + self._base_n, home.block
            self._cols = [block[i, lo:hi] for i in range(len(FIELDS))]
            if home.gone is not None:
                keep = ~home.gone[lo:hi]
                self._cols = [c[keep] for c in self._cols]
                for c in self._cols:  # a write would not reach the store's columns: refused, not lost
                    c.flags.writeable = False
        return self._cols

    def _col(self, i: int) -> np.ndarray:
        if self._pending:
            self._join()
        return self._base()[i]

    def _set(self, i: int, value: np.ndarray) -> None:
        cols = list(self._base()) if not self._pending else self._join()
        cols[i] = value
        self._cols, self._home, self.stored = cols, None, None  # its own arrays now
        if i == 0:
            self._n = len(value)

    def _join(self) -> list[np.ndarray]:
        """Append the pending chunks to the arrays (which are then this window's own)."""
        parts = list(zip(*self._pending))
        self._cols = [np.concatenate([c, *p]) for c, p in zip(self._base(), parts)]
        self._pending, self._home = [], None
        return self._cols

    pos = property(lambda self: self._col(0), lambda self, v: self._set(0, v))
    key = property(lambda self: self._col(1), lambda self, v: self._set(1, v))
    tokens = property(lambda self: self._col(2), lambda self, v: self._set(2, v))
    patches = property(lambda self: self._col(3), lambda self, v: self._set(3, v))
    done = property(lambda self: self._col(4), lambda self, v: self._set(4, v))

    @property
    def unconsumed_tokens(self) -> int:
        return self.unconsumed

    @property
    def ready(self) -> bool:
        """Full: the loader has announced the shortest stream prefix meeting both minimums (or the cap)."""
        return window_full(self._n, self.unconsumed, self.min_samples, self.min_tokens, self.capacity) or self.dry

    def add(self, pos: np.ndarray, key: np.ndarray, tokens: np.ndarray, patches: np.ndarray) -> None:
        """Take one LOADER_META: the stream's next samples; WindowError for anything that contradicts the
        window. The planner takes ~1,000 a step: 1-D int64 arrays (what the wire decodes) are checked and
        copied in one compiled pass; anything else is checked and converted step by step, as before."""
        if (type(pos) is type(key) is type(tokens) is type(patches) is np.ndarray
                and pos.dtype == key.dtype == tokens.dtype == patches.dtype == _I64
                and pos.ndim == key.ndim == tokens.ndim == patches.ndim == 1):
            n = len(pos)
            if n == 0:
                return
            if not (len(key) == len(tokens) == len(patches) == n):
                self._refuse("metadata arrays differ in length")
            home = self._home
            chunk = np.empty((len(FIELDS), n), np.int64) if home is None else home.stage(n)
            bad, before_last, last, last_pos = selectloop.take_meta(pos, key, tokens, patches, self.next_pos, chunk)
            if bad:
                self._refuse(f"positions out of order (got {int(pos[0])}, expected >= {self.next_pos})" if bad == 1
                             else "a sample has no tokens")
            if (self.restored_done or self._n + n > self.capacity  # right after a restore, or refused
                    or (self.skip_hi >= 0 and self.skip and self.skip_hi >= int(pos[0]))):
                self._add_checked(chunk[0], chunk[2], before_last, chunk, home is not None)
                return
            before_last += self.unconsumed
            if window_full(self._n + n - 1, before_last, self.min_samples, self.min_tokens, self.capacity):
                self._refuse(f"samples announced beyond a full window (from position {int(pos[0])})")
            self._keep(chunk, home is not None)
            self._n += n
            self.unconsumed = before_last + last
            self.next_pos = last_pos + 1
            self.dry = False
            self.stored = None
            return
        pos = np.asarray(pos, np.int64)
        if pos.ndim != 1 or np.ndim(key) != 1 or np.ndim(tokens) != 1 or np.ndim(patches) != 1:
            # a 2-D key or patches array of the right length would be kept and fail every later step's gather
            self._refuse("metadata arrays must be one-dimensional")
        n = len(pos)
        if n == 0:
            return
        if not (len(key) == len(tokens) == len(patches) == n):
            self._refuse("metadata arrays differ in length")
        if int(pos[0]) < self.next_pos or (n > 1 and bool((pos[1:] <= pos[:-1]).any())):
            self._refuse(f"positions out of order (got {int(pos[0])}, expected >= {self.next_pos})")
        toks = np.asarray(tokens, np.int64)
        if int(toks.min()) <= 0:
            self._refuse("a sample has no tokens")
        self._add_checked(pos, toks, int(toks[:-1].sum()), None, False, key, patches)

    def _add_checked(self, pos: np.ndarray, toks: np.ndarray, before_last: int, chunk: np.ndarray | None,
                     in_stage: bool, key: Any = None, patches: Any = None) -> None:
        """The rest of `add` for positions in order and samples with tokens: the checks against a restored
        cursor and the window's bounds, then the samples join the window (`chunk`: already copied, in_stage:
        into the store's staging area; else made from pos, key, toks, patches)."""
        n = len(pos)
        p0 = int(pos[0])
        # consumed positions at or above next_pos can only come from a restored cursor (compaction skips
        # positions already received), so only those need a membership test
        if self.skip and self.skip_hi >= p0:
            bad = [p for p in pos.tolist() if p in self.skip]
            if bad:
                self._refuse(f"position {bad[0]} was already consumed")
        if self._n + n > self.capacity:
            self._refuse(f"window overflow ({self._n + n} > {self.capacity})")
        done = None
        last = int(toks[n - 1])
        if self.restored_done:  # partial progress restored from a cursor (only right after a resume)
            done = np.array([self.restored_done.get(p, 0) for p in pos.tolist()], dtype=np.int64)
            left = toks - done
            before_last = int(left[:-1].sum())
            last = int(left[-1])
        before_last += self.unconsumed
        if window_full(self._n + n - 1, before_last, self.min_samples, self.min_tokens, self.capacity):
            self._refuse(f"samples announced beyond a full window (from position {p0})")
        if done is not None:
            for p in pos.tolist():
                self.restored_done.pop(p, None)
        if chunk is None:
            chunk = np.stack([pos, np.array(key, np.int64), toks, np.array(patches, np.int64), np.zeros(n, np.int64)])
        if done is not None:
            chunk[4] = done
        self._keep(chunk, in_stage)
        self._n += n
        self.unconsumed = before_last + last
        self.next_pos = int(pos[n - 1]) + 1
        self.dry = False
        self.stored = None

    def _keep(self, chunk: np.ndarray, in_stage: bool) -> None:
        """Hold a chunk `add` took: a window of a store keeps it in the store's staging area (in_stage: the
        compiled path wrote it there already)."""
        home = self._home
        if home is not None:
            n = chunk.shape[1]
            if not in_stage:
                view = home.stage(n)
                view[:] = chunk
                chunk = view
            at = home._staged
            home._staged = at + n
            home._log.extend((self._i, at, n))
        self._pending.append(chunk)

    def _refuse(self, what: str) -> NoReturn:
        raise WindowError(f"source {self.source} replica {self.replica}: {what}")

    def compact(self) -> np.ndarray:
        """Drop fully consumed samples; returns their positions."""
        full = self.done >= self.tokens
        gone = self.pos[full]
        if len(gone):
            keep = ~full
            for name in ("pos", "key", "tokens", "patches", "done"):
                setattr(self, name, getattr(self, name)[keep])
            self.stored = None
        self.unconsumed = int((self.tokens - self.done).sum())
        self._advance(int(self.pos[0]) if len(self.pos) else self.next_pos, gone)
        return gone

    def _advance(self, new_low: int, gone: Any) -> None:
        """Move the low mark to `new_low` and record the consumed positions `gone` above it as skipped."""
        if new_low != self.low:
            if self.skip:
                self.skip = {p for p in self.skip if p >= new_low}
            self.low = new_low
        if len(gone):  # a new set (a cursor taken before may hold the old one: skip sets never change in place)
            self.skip = self.skip | {p for p in gone.tolist() if p >= new_low}

    def cursor(self) -> dict[str, Any]:
        """Consumption state: enough for a loader to re-emit exactly the unconsumed samples."""
        nz = np.flatnonzero(self.done > 0)
        return self._cursor(self.pos[nz].tolist(), self.done[nz].tolist())

    def _cursor(self, partial_pos: list[int], partial_done: list[int]) -> dict[str, Any]:
        """The cursor, given the positions with partial progress and that progress (in stream order)."""
        return window_cursor(self.low, self.next_pos, self.skip, self.restored_done, self.listing, partial_pos, partial_done)

    @staticmethod
    def parse_cursor(cur: Any) -> tuple[int, set[int], dict[int, int]]:
        """(low, skip, partial) of a window cursor (protocol.WindowCursor.parse); ValueError naming what is wrong."""
        c = WindowCursor.parse(cur)
        return c.low, set(c.skip), dict(c.partial)

    def restore(self, cur: dict[str, Any]) -> None:
        low, skip, done = self.parse_cursor(cur)
        listing = WindowCursor.parse(cur).listing
        self.__init__(self.source, self.replica, self.min_samples, self.min_tokens, self.capacity)  # type: ignore[misc]
        self.listing = None if listing is None else [list(seg) for seg in listing]
        self.low = self.next_pos = low
        self.skip = skip
        self.skip_hi = max(skip, default=-1)
        self.restored_done = done


class WindowStore:
    """Every window's samples in one set of columns (window by window, each in stream order), so that a
    step gathers, writes consumption back, compacts and takes cursors with a few vectorised passes
    instead of a Python call per window. The windows' arrays are views of these columns; a window
    that took new samples since (`add`: one LOADER_META, staged here) is no longer `stored` and the
    next `sync` gathers all of them again (one compiled pass).

    Each column lives in one of two buffers kept across steps: a gather writes into the other one (fresh
    multi-MB arrays every step cost more in page faults than the copies themselves), so a window's arrays
    stay valid until the planner's next step, not beyond. A compaction moves nothing: it marks the samples
    that left their windows (`gone`), and the next gather leaves them out while it merges what the windows
    took since (one copy of the columns a step, not two)."""

    def __init__(self, windows: list[ReplicaWindow]):
        self.windows = windows
        w = len(windows)
        self.source = np.array([x.source for x in windows], np.int64)
        self.replica = np.array([x.replica for x in windows], np.int64)
        self.ids = [(x.source, x.replica) for x in windows]
        self.base = np.zeros(w + 1, np.int64)  # window i's samples are [base[i], base[i + 1]) of the block
        self.gone: np.ndarray | None = None  # the last compaction's consumed samples (over the block), until a gather
        self.held = np.zeros(w, np.int64)  # each window's samples in the block (without the gone ones)
        self._bufs = [np.zeros((6, 0), np.int64), np.zeros((6, 0), np.int64)]  # rows: FIELDS, then the window
        self._side = 0
        # what the windows took since the last gather: staged here by `add` (kept across steps: thousands of
        # small arrays allocated and freed each step cost page faults), each chunk listed (window, column, n)
        self._stage = np.zeros((len(FIELDS), 0), np.int64)
        self._staged = 0
        self._log = array("q")
        for i, x in enumerate(windows):
            x._i = i
        self._adopt(self._bufs[0][:, :0])
        self.fresh = False

    def stage(self, n: int) -> np.ndarray:
        """(5, n) of free staging area for a window's `add` to write into (ReplicaWindow._keep takes it)."""
        at = self._staged
        if at + n > self._stage.shape[1]:  # a larger area; the chunks so far move with it
            grown = np.empty((len(FIELDS), 2 * (at + n) + 256), np.int64)
            grown[:, :at] = self._stage[:, :at]
            self._stage = grown
        return self._stage[:, at:at + n]

    def _spare(self, n: int) -> np.ndarray:
        """(6, n) of the buffer that does not hold the columns now (it will)."""
        self._side = side = 1 - self._side
        buf = self._bufs[side]
        if buf.shape[1] < n:
            buf = self._bufs[side] = np.empty((6, n + n // 4 + 1024), np.int64)
        return buf[:, :n]

    def _adopt(self, block: np.ndarray) -> None:
        self.block = block
        self.cols: dict[str, np.ndarray] = {f: block[i] for i, f in enumerate(FIELDS)}
        self.win = block[5]  # window of every sample

    def sync(self, *, drop: bool = True) -> None:
        """Gather the windows into the columns unless every window is still a view of them and nothing
        compacted is left to drop (drop=False: for a reader that leaves the `gone` samples out itself)."""
        ws = self.windows
        if (self.gone is None or not drop) and self.fresh and all(w.stored is self for w in ws):
            return
        lens = np.fromiter((w._n for w in ws), np.int64, len(ws))
        fast = self.fresh and all(w._home is self for w in ws)
        if fast:  # every window is still its slice of the block plus the chunks it staged since
            log = np.frombuffer(self._log, np.int64).reshape(-1, 3)
            log = log[np.argsort(log[:, 0], kind="stable")]  # by window, each window's in the order taken
            fast = np.array_equal(np.bincount(log[:, 0], log[:, 2], len(ws)), lens - self.held)  # (else: a bug)
        if fast:  # one compiled merge
            block = self._spare(int(lens.sum()))
            selectloop.gather(self.block, self.base, self.gone, self._stage, log, block)
        else:  # windows with arrays of their own (restored, compacted on their own): join them
            block = self._spare(int(lens.sum()))
            for i in range(len(FIELDS)):
                if ws:
                    np.concatenate([a for w in ws for a in (w._base()[i], *(c[i] for c in w._pending))], out=block[i])
            block[5] = np.repeat(np.arange(len(ws), dtype=np.int64), lens)
        np.cumsum(lens, out=self.base[1:])
        self.held = lens
        self.gone = None
        self._staged = 0
        self._log = array("q")
        self._adopt(block)
        self._view()

    def _view(self) -> None:
        """Point every window's arrays at its slice of the columns."""
        for w, lo, n in zip(self.windows, self.base.tolist(), self.held.tolist()):
            w._cols = None
            w._home = w.stored = self
            w._lo = lo
            w._base_n = w._n = n
            if w._pending:
                w._pending = []
        self.fresh = True

    def compact(self) -> np.ndarray:
        """ReplicaWindow.compact for every window at once (one compiled pass over the columns, which marks
        the consumed samples `gone` and moves nothing); returns that mask (the samples that left their
        windows: the pieces that retire them)."""
        ws = self.windows
        if not (self.fresh and all(w.stored is self for w in ws)):
            # a window that took samples since the last gather holds them outside the block: compacting the block
            # would move its low mark past them (its next_pos has moved); gathering now would shift the indices
            # the caller's `full` lookups use. Only StepPlanner.plan compacts, right after select.
            raise RuntimeError("window store: compact after windows changed since the last gather")
        if self.gone is not None:  # compacted before and not gathered since: drop those first
            self.sync()
        nxt = np.fromiter((w.next_pos for w in ws), np.int64, len(ws))
        full, held, unc, low, a_win, a_pos = selectloop.settle(self.block, self.base, nxt)
        self.gone, self.held = full, held
        # ReplicaWindow._advance for every window: low marks and unconsumed tokens from the pass; skips only
        # where there are any (consumed positions above the new low mark: taken out of order, few per window)
        for w, n, lo, left in zip(ws, held.tolist(), low.tolist(), unc.tolist()):
            w._cols = None  # the arrays leave out the gone samples when next read
            w._n = n
            w.unconsumed = left
            if lo != w.low:
                if w.skip:
                    w.skip = {p for p in w.skip if p >= lo}
                w.low = lo
        if len(a_win):  # window by window (the pass lists them in column order), every position >= its low mark
            cut = (np.flatnonzero(a_win[1:] != a_win[:-1]) + 1).tolist()
            pos = a_pos.tolist()
            for wi, a, b in zip(a_win[[0, *cut]].tolist(), [0, *cut], [*cut, len(pos)]):
                ws[wi].skip = ws[wi].skip.union(pos[a:b])  # a new set: WindowCursors may hold the old one
        return full

    def cursors(self) -> "WindowCursors":
        """StepPlanner.cursor's window entries as of now (built when read)."""
        return WindowCursors(self)

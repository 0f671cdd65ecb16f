"""A loader replica's read-ahead window: what it has announced to the planner and not yet handed off.

Shared by the loader server and by offline replay (`mixplane replay`, journal checks), so both
announce exactly the same samples for the same cursor: read in order from the deterministic
stream, skip what the cursor says was consumed, and stop at the shortest prefix that satisfies
`protocol.window_full`.

Under ``overlong_doc: split`` (:mod:`loader.split`) a stream row owns SPLIT_SLOTS window positions,
one per piece of its document; the pieces after the first wait in ``staged`` as a `PendingDoc` and
are tokenized one at a time, only when the window (or its read-ahead) needs the next one.

A window over a dry live source *waits*: while the stream's next listing of its storage is not
due (`SourceStream.seconds_to_rescan`), `full` is true and the loader's poll loop sleeps on its
sockets instead of asking the stream again; `complete` is the shared predicate alone.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from mixplane.loader.buckets import Bucket, BucketJoiner
from mixplane.loader.split import PendingDoc, piece_key, row_of, window_pos
from mixplane.loader.workers import TransformPipeline
from mixplane.protocol import WindowCursor, window_full

if TYPE_CHECKING:  # the window reads any stream and transform of these shapes; no import at run time
    from mixplane.loader.stream import SourceStream
    from mixplane.loader.transforms import Transform

CHUNK = 64  # most samples read and transformed at a time
MIN_CHUNK = 8  # fewest (amortises the per-read cost of the stream and the tokenizer call)
FIRST_CHUNK = 16  # before the source's tokens per sample are known
COVER_LIMIT = 1 << 16  # retired positions remembered for warm seeks before they are given up


@dataclass
class Buffered:
    pos: int
    key: int
    tokens: np.ndarray
    patches: np.ndarray | None
    npatches: int = 0
    done: int = 0  # tokens already planned
    grid: tuple[int, int] | None = None  # image_text: (h_patches, w_patches) of the sample's image


@dataclass
class Announcement:
    pos: np.ndarray
    key: np.ndarray
    tokens: np.ndarray
    patches: np.ndarray

    def __len__(self) -> int:
        return len(self.pos)


class LoaderWindow:
    def __init__(self, stream: SourceStream, transform: Transform, bounds: tuple[int, int, int],
                 on_read: Callable[[int, int, float], None] | None = None, read_timeout: float | None = None,
                 drop_longer_than: int | None = None, workers: int = 1, bucket: tuple[str, int] | None = None):
        self.stream = stream
        # sources[].workers: later chunks of the stream transformed on worker threads, handed out in order
        self.pipeline = TransformPipeline(stream, transform, workers)
        # pack_by (spec.pack_bucket: column, most tokens of a bucket): adjacent rows of one value are one document,
        # announced at its first row's piece-0 position (loader.buckets)
        self.bucket_column = bucket[0] if bucket is not None else None
        self.joiner = BucketJoiner(bucket[1]) if bucket is not None else None
        self.read_timeout = read_timeout  # live sources: give control back while dry
        self.stalled = False
        self.transform = transform
        self.min_samples, self.min_tokens, self.max_samples = bounds
        self.buffer: dict[int, Buffered] = {}  # announced, not yet fully consumed
        self.staged: deque[Buffered | PendingDoc] = deque()  # read and transformed, not yet announced
        self.unconsumed_tokens = 0
        self.skip: set[int] = set()
        self.partial: dict[int, int] = {}
        self.on_read = on_read
        # batch.overlong == 'drop' (spec.overlong_limit): longer samples are never announced, like empty ones
        self.drop_longer_than = drop_longer_than
        self.dropped_overlong = 0  # and documents over their source's max_doc_bytes / max_doc_tokens dropped
        self.cut_overlong = 0  # documents over those bounds cut to their first piece (overlong_doc: truncate)
        # overlong_doc: split — the transform's splitter makes the pieces; positions are per piece
        self.splitter = getattr(transform, "splitter", None)
        tq, where = getattr(transform, "quarantine", None), getattr(stream, "where_key", None)
        if tq is not None and where is not None and getattr(tq, "locate", False) is None:
            tq.locate = where  # a quarantined sample's record names its file and row
        self.split_overlong = 0  # documents delivered as several pieces
        self.low = 0  # the last seek's position: pieces of its row below it were consumed
        # read-ahead beyond the window (invisible to the planner): refills after a step are then
        # announced at once instead of waiting for the tokenizer, so loaders overlap with planning
        self.read_ahead_tokens = self.min_tokens
        self.staged_tokens = 0
        # tokens per sample read so far: a read asks for about what is missing, not a fixed count, so a
        # source of book-length documents does not tokenize a million tokens to top up a window of 64k
        self._read_samples = 0
        self._read_tokens = 0
        # what was read since the last cold seek (warm seeks): every position from _cover_from on, except
        # the ones skipped as consumed (_cover_skip)
        self._cover_from: int | None = None
        self._cover_skip: set[int] = set()
        self.warm_seeks = 0
        self.warm_samples = 0  # samples a warm seek kept instead of reading them again

    @property
    def complete(self) -> bool:
        """The shared predicate (`protocol.window_full`): the planner's window of this replica is full."""
        return window_full(len(self.buffer), self.unconsumed_tokens, self.min_samples, self.min_tokens, self.max_samples)

    @property
    def waiting(self) -> bool:
        """A dry live source whose next listing is not due yet: nothing new can be read before then."""
        if not self.stalled:
            return False
        due_in = getattr(self.stream, "seconds_to_rescan", None)
        return due_in is not None and due_in() > 0

    @property
    def full(self) -> bool:
        """Nothing to announce now: the window is complete, or its live source is dry and waiting."""
        return self.complete or self.waiting

    def seek(self, cursor: dict[str, Any] | WindowCursor) -> None:
        """Start over from a planner cursor: low position, consumed positions, partial progress.
        The cursor is validated (protocol.WindowCursor.parse, ValueError) before anything changes.

        Warm when it can be: samples already read and transformed at or after the cursor's low position
        are kept (unannounced, their progress taken from the cursor) instead of being read and tokenized
        again — a shadow loader's read-ahead becomes the promoted primary's window, and a restarted
        loader's replay is not read twice."""
        c = cursor if isinstance(cursor, WindowCursor) else WindowCursor.parse(cursor)
        if self._warm_seek(c):
            return
        self._cover_from, self._cover_skip = c.low, set(c.skip)
        self.buffer.clear()
        self.staged.clear()
        self.staged_tokens = 0
        self.unconsumed_tokens = 0
        self.stalled = False
        self.skip = set(c.skip)
        self.partial = dict(c.partial)
        self.low = c.low
        self.pipeline.reset()  # chunks taken ahead are of the old position
        restore = getattr(self.stream, "restore_listing", None)
        if c.listing is not None and restore is not None:  # a live source: count positions over that listing
            restore(c.listing)
        if self.joiner is not None:
            self.joiner.reset()
        self.stream.seek(row_of(c.low) if self.splitter is not None or self.joiner is not None else c.low)

    def _warm_seek(self, c: WindowCursor) -> bool:
        """Seek by keeping what was read: possible when every position from ``c.low`` up to the stream's
        next one was read since the last cold seek, and nothing then skipped is still unconsumed at `c`."""
        if self._cover_from is None or self.splitter is not None or self.joiner is not None:
            # split documents, buckets: positions are pieces of rows, always cold
            return False
        here = self.position  # streams of tests may not say where they stand
        if not isinstance(here, int) or not self._cover_from <= c.low <= here:
            return False
        if any(p >= c.low and p not in c.skip for p in self._cover_skip):
            return False  # a sample this window skipped (consumed then) is wanted again: read it afresh
        held = [*self.buffer.values(), *self.staged]
        kept = sorted((b for b in held if isinstance(b, Buffered) and b.pos >= c.low and b.pos not in c.skip),
                      key=lambda b: b.pos)
        for b in kept:
            b.done = int(c.partial.get(b.pos, 0))
        self.buffer.clear()
        self.staged = deque(kept)
        self.staged_tokens = sum(len(b.tokens) for b in kept)
        self.low = c.low
        self.unconsumed_tokens = 0
        self.stalled = False
        self.skip = {p for p in c.skip if p >= here}
        self.partial = {p: d for p, d in c.partial.items() if p >= here}
        self._cover_from, self._cover_skip = c.low, set(c.skip)
        self.warm_seeks += 1
        self.warm_samples += len(kept)
        return True

    @property
    def position(self) -> int | None:
        """The stream position after the rows this window has read (chunks its workers took ahead not counted)."""
        if not isinstance(getattr(self.stream, "position", None), int):
            return None
        return self.pipeline.position

    def close(self) -> None:
        """Stop the worker threads (the stream is its owner's to close)."""
        self.pipeline.close()

    def chunk_for(self, tokens: int, samples: int = 0) -> int:
        """Samples to read for about `tokens` more tokens (and at least `samples` more samples)."""
        if self._read_samples == 0 or self._read_tokens == 0:
            n = FIRST_CHUNK
        else:
            n = -(-max(tokens, 0) * self._read_samples // self._read_tokens)
        return int(min(CHUNK, max(MIN_CHUNK, n, samples)))

    def _read(self, n: int = CHUNK) -> None:
        t0 = time.perf_counter()
        raw, transformed = self.pipeline.next(n, timeout=self.read_timeout)
        self.stalled = transformed is None
        if transformed is None:
            return
        out = transformed
        self._read_samples += len(raw)
        self._read_tokens += int(out.ntokens.sum())
        if self.joiner is not None:
            self._join(raw, out)
        else:
            self._stage_rows(raw, out)
        if self.on_read is not None:
            self.on_read(len(raw), int(out.ntokens.sum()), time.perf_counter() - t0)

    def _join(self, raw, out) -> None:
        """pack_by: the read's rows into the joiner; every bucket they complete is staged (loader.buckets)."""
        assert self.joiner is not None and self.bucket_column is not None
        values = raw.columns[self.bucket_column].to_pylist()
        for i, row in enumerate(raw.positions.tolist()):
            done = self.joiner.push(row, int(raw.keys[i]), values[i], out.tokens[i])
            if done is not None:
                b = self._admit_bucket(done)
                if b is not None:
                    self.staged_tokens += len(b.tokens)
                    self.staged.append(b)

    def _admit_bucket(self, g: Bucket) -> Buffered | None:
        """A complete bucket as a staged sample at its first row's piece-0 position, or None when it was consumed
        before the cursor or holds no tokens."""
        p = window_pos(g.row, 0)
        if p in self.skip or p < self.low:
            self.skip.discard(p)
            return None
        if g.tokens <= 0:
            return None
        return Buffered(p, g.key, g.joined(), None, 0, self.partial.pop(p, 0))

    def _stage_rows(self, raw, out) -> None:
        split = self.splitter is not None
        for i, row in enumerate(raw.positions):
            p = window_pos(int(row), 0) if split else int(row)
            rest = out.rest.get(i) if out.rest else None
            b = self._admit(p, i, raw, out, rest is None)
            if b is not None:
                self.staged_tokens += len(b.tokens)
                self.staged.append(b)
            if rest is not None:  # its other pieces follow its first, before the next row
                self.split_overlong += 1
                self.staged.append(rest)

    def _admit(self, p: int, i: int, raw, out, whole: bool) -> Buffered | None:
        """Row ``i`` of a read as a staged sample at position ``p``, or None when it was consumed
        before the cursor, is empty, or is too long (counted)."""
        if p in self.skip or p < self.low:  # consumed before the cursor was taken
            self.skip.discard(p)
            return None
        over = whole and out.overlong is not None and bool(out.overlong[i])
        if out.ntokens[i] <= 0:  # empty documents carry nothing to train on
            self.dropped_overlong += over
            return None
        self.cut_overlong += over
        if self.drop_longer_than is not None and out.ntokens[i] > self.drop_longer_than:
            self.dropped_overlong += 1
            return None
        return Buffered(p, int(raw.keys[i]), out.tokens[i], out.patches[i] if out.patches is not None else None,
                        int(out.npatches[i]), self.partial.pop(p, 0),
                        (int(out.image_grid[i][0]), int(out.image_grid[i][1])) if out.image_grid is not None else None)

    def _next_piece(self, at: int) -> None:
        """Replace the split document at ``staged[at]`` by its next piece followed by the rest (if any).
        Pieces the cursor says were consumed are passed over without tokenizing them."""
        assert self.splitter is not None
        t0 = time.perf_counter()
        doc = self.staged[at]
        assert isinstance(doc, PendingDoc)
        ntok = 0
        while True:
            end, last, cut = self.splitter.advance(doc)
            p = doc.pos
            consumed = p in self.skip or p < self.low
            tokens = None
            if consumed:
                self.skip.discard(p)
            else:
                tokens = self.splitter.tokens(doc, end, last)
                if self.drop_longer_than is not None and len(tokens) > self.drop_longer_than:
                    self.dropped_overlong += 1  # batch.overlong: drop applies to every piece
                    tokens = None
            piece = doc.piece
            doc.offset, doc.piece = end, doc.piece + 1
            if last:
                del self.staged[at]
                self.cut_overlong += cut
            if tokens is not None and len(tokens):
                ntok = len(tokens)
                self.staged_tokens += ntok
                self.staged.insert(at, Buffered(p, piece_key(doc.key, piece), tokens, None, 0, self.partial.pop(p, 0)))
                break
            if last:
                break
        if self.on_read is not None:
            self.on_read(0, ntok, time.perf_counter() - t0)

    def _stage_next(self) -> Buffered | None:
        """Pop the next staged sample (making the next piece of a split document first); None if nothing is staged."""
        while self.staged:
            if isinstance(self.staged[0], PendingDoc):
                self._next_piece(0)
                continue
            b = self.staged.popleft()
            assert isinstance(b, Buffered)
            self.staged_tokens -= len(b.tokens)
            return b
        return None

    def fill(self) -> Announcement:
        """Announce staged samples one by one until the window is exactly complete (or its live source is dry)."""
        new: list[Buffered] = []
        while not self.complete:
            b = self._stage_next()
            if b is None:
                self._read(self.chunk_for(self.min_tokens - self.unconsumed_tokens, self.min_samples - len(self.buffer)))
                if self.stalled:  # a dry live source: announce what there is, try again later
                    break
                continue
            self.buffer[b.pos] = b
            self.unconsumed_tokens += len(b.tokens) - b.done
            new.append(b)
        return Announcement(np.array([b.pos for b in new], np.int64), np.array([b.key for b in new], np.int64),
                            np.array([len(b.tokens) for b in new], np.int32), np.array([b.npatches for b in new], np.int32))

    def ensure(self, positions: list[int]) -> None:
        """Replay after a restart: move samples into the buffer, reading the stream forward and announcing
        nothing, until every one of `positions` is there (or the stream has passed them / stays dry)."""
        want = {int(p) for p in positions} - self.buffer.keys()
        if not want:
            return
        last = max(want)
        while want:
            b = self._stage_next()
            if b is None:
                self._read(CHUNK)
                if self.stalled:
                    return
                continue
            self.buffer[b.pos] = b
            self.unconsumed_tokens += len(b.tokens) - b.done
            want.discard(b.pos)
            if b.pos >= last:
                return

    @property
    def wants_read_ahead(self) -> bool:
        return self.staged_tokens < self.read_ahead_tokens and not self.stalled

    def read_ahead(self) -> bool:
        """Read and transform one more chunk beyond the window, if the read-ahead budget allows."""
        if not self.wants_read_ahead:
            return False
        for at, b in enumerate(self.staged):  # the next piece of a split document comes first
            if isinstance(b, PendingDoc):
                self._next_piece(at)
                return True
        self._read(self.chunk_for(self.read_ahead_tokens - self.staged_tokens))
        return not self.stalled

    def span(self, pos: int, start: int, length: int) -> tuple[int, np.ndarray]:
        """(key, tokens[start : start + length + 1]) of a planned span; the extra token labels the last one."""
        b = self.buffer.get(pos)
        if b is None:
            raise KeyError(f"planned sample at position {pos} is not in the window")
        end = start + length
        if end > b.done:
            self.unconsumed_tokens -= end - b.done
            b.done = end
        return b.key, b.tokens[start : end + 1]

    def retire(self, pos: int) -> None:
        b = self.buffer.pop(pos, None)
        if b is not None:
            self.unconsumed_tokens -= len(b.tokens) - b.done
        if self._cover_from is not None:  # no longer held: a warm seek to a cursor wanting it must read it again
            self._cover_skip.add(int(pos))
            if len(self._cover_skip) > COVER_LIMIT:  # a long-running primary: warm seeks are for shadows and replays
                self._cover_from = None
                self._cover_skip = set()

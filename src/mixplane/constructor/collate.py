"""Materialise one data-parallel rank's batch from a step layout and the planned token spans.

Output (numpy; the client wraps the buffers as torch tensors without copying):

    input_ids     int64 [rows, seq_len]   packed rows; padding = pad_id
    labels        int64 [rows, seq_len]   next token of the same document, -100 elsewhere
    position_ids  int64 [rows, seq_len]   restart at 0 for every piece (and padding)
    source_ids    int32 [rows, seq_len]   source index of each token, -1 for padding
    cu_seqlens    int32 [n + 1]           FlashAttention varlen boundaries over the flattened rows
    cu_seqlens_mb int64 [microbatches+1]  where each microbatch's boundaries start in cu_seqlens
    segment_*     one entry per piece: source, key (sample id), start (token offset in the sample),
                  len, row, offset (first position in its row) — which document span sits where
                  (per-document metrics, debugging, audits; multimodal fusion reads the offsets)

A row never mixes documents in attention: every piece is its own segment in cu_seqlens, and the
padding tail of a row is a segment of its own. Labels never cross a document boundary; a piece
of a split document is labelled with the document's true next token when the loader sent it.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import numpy as np

from mixplane.errors import MixplaneError
from mixplane.layout import StepLayout, segment_offsets
from mixplane.parallelism import hybrid_rank_batch

IGNORE_INDEX = -100
_ADDRESS = np.dtype("V24")  # (source, key, start) as three int64 in one opaque item: sorts and compares exactly


class MissingPayload(MixplaneError, KeyError):
    """A planned span whose tokens did not arrive; names step, source and sample."""


def _addresses(source: np.ndarray | int, keys: np.ndarray, starts: np.ndarray) -> np.ndarray:
    keys = np.asarray(keys)
    out = np.empty((len(keys), 3), dtype=np.int64)
    out[:, 0] = source
    out[:, 1] = keys
    out[:, 2] = starts
    return out.view(_ADDRESS).reshape(-1)


def _fits(value: int, dtype: np.dtype) -> bool:
    return dtype.kind in "iu" and np.iinfo(dtype).min <= value <= np.iinfo(dtype).max


class _Block:
    """The spans of one message as sent: span i is values[offsets[i]:offsets[i + 1]]."""

    __slots__ = ("source", "keys", "starts", "offsets", "values")

    def __init__(self, source: int, keys: np.ndarray, starts: np.ndarray, offsets: np.ndarray, values: np.ndarray):
        self.source, self.keys, self.starts, self.offsets, self.values = source, keys, starts, offsets, values

    @property
    def payload(self) -> np.ndarray:
        return self.values[self.offsets[0]:self.offsets[-1]]


class SpanStore:
    """Token spans received for one step, addressed by (source, key, start).

    Each :meth:`add` keeps one message's spans as one block (values + offsets; nothing per span).
    Lookups go through one sorted index of every block's addresses, rebuilt only after blocks were
    added. As with a dict, a span added later replaces an earlier one with the same address. A span
    is located in :meth:`values`, the concatenation of every block's payload, so a whole batch is
    gathered with one index.
    """

    def __init__(self) -> None:
        self._blocks: list[_Block] = []
        self._index: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # sorted addresses, begin, length
        self._buffer: np.ndarray | None = None  # values() and free slots after them (see _gather_buffer)

    @classmethod
    def empty(cls) -> "SpanStore":
        return cls()

    def add(self, source: int, keys: np.ndarray, starts: np.ndarray, offsets: np.ndarray, values: np.ndarray) -> int:
        """Add one message's spans (span i = values[offsets[i]:offsets[i + 1]]); returns how many."""
        keys = np.asarray(keys)
        if len(keys):
            self._blocks.append(_Block(int(source), keys, np.asarray(starts), np.asarray(offsets, dtype=np.int64),
                                       np.asarray(values)))
            self._index = self._buffer = None
        return len(keys)

    def put(self, source: int, key: int, start: int, tokens: np.ndarray) -> None:
        """Add one span."""
        tokens = np.asarray(tokens)
        self.add(source, np.array([key], np.int64), np.array([start], np.int64), np.array([0, len(tokens)], np.int64),
                 tokens)

    def _built(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._index is None:
            if self._blocks:
                sizes = [int(b.offsets[-1] - b.offsets[0]) for b in self._blocks]
                base = np.cumsum([0] + sizes[:-1])
                addr = np.concatenate([_addresses(b.source, b.keys, b.starts) for b in self._blocks])
                begin = np.concatenate([b.offsets[:-1] - b.offsets[0] + base[i] for i, b in enumerate(self._blocks)])
                length = np.concatenate([np.diff(b.offsets) for b in self._blocks])
                order = np.argsort(addr, kind="stable")  # equal addresses stay in the order they were added
                self._index = (addr[order], begin[order], length[order])
            else:
                self._index = (np.zeros(0, _ADDRESS), np.zeros(0, np.int64), np.zeros(0, np.int64))
        return self._index

    def locate(self, source: np.ndarray | int, keys: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where each addressed span sits in :meth:`values`: (begin, length), length -1 when it is not here."""
        addr, begin, length = self._built()
        q = _addresses(np.asarray(source, dtype=np.int64), keys, starts)
        if not len(addr):
            return np.zeros(len(q), np.int64), np.full(len(q), -1, np.int64)
        i = np.searchsorted(addr, q, side="right") - 1  # the last added of equal addresses
        j = np.maximum(i, 0)
        found = (i >= 0) & (addr[j] == q)
        return np.where(found, begin[j], 0), np.where(found, length[j], -1)

    def contains(self, source: np.ndarray | int, keys: np.ndarray, starts: np.ndarray) -> np.ndarray:
        return self.locate(source, keys, starts)[1] >= 0

    def values(self) -> np.ndarray:
        """Every block's payload, concatenated in the order they were added (the positions :meth:`locate` gives)."""
        return self._gather_buffer(0)[: self._size()]

    def _size(self) -> int:
        return sum(int(b.offsets[-1] - b.offsets[0]) for b in self._blocks)

    def _gather_buffer(self, tail: int, fill: tuple[int, ...] = ()) -> np.ndarray:
        """:meth:`values` followed by at least `tail` free slots a caller may write filler into (wide
        enough for the values in `fill`). Made once per step, shared by every rank built from this
        store; the blocks then point into it, so the received messages are not kept twice."""
        buf = self._buffer
        if buf is None or len(buf) - self._size() < tail or not all(_fits(v, buf.dtype) for v in fill):
            dtype = np.result_type(*[b.values.dtype for b in self._blocks]) if self._blocks else np.dtype(np.int64)
            if not all(_fits(v, dtype) for v in fill):
                dtype = np.dtype(np.int64)
            buf = np.empty(self._size() + tail, dtype)
            pos = 0
            for b in self._blocks:
                n = int(b.offsets[-1] - b.offsets[0])
                buf[pos:pos + n] = b.payload
                b.offsets, b.values = b.offsets - b.offsets[0] + pos, buf
                pos += n
            self._buffer = buf
        return buf

    def get(self, address: tuple[int, int, int]) -> np.ndarray | None:
        s, k, t = address
        begin, length = self.locate(int(s), np.array([k], np.int64), np.array([t], np.int64))
        if length[0] < 0:
            return None
        return self.values()[int(begin[0]):int(begin[0] + length[0])]

    def __contains__(self, address: object) -> bool:
        return isinstance(address, tuple) and len(address) == 3 and self.get(address) is not None

    def __len__(self) -> int:
        """Distinct addresses held."""
        addr = self._built()[0]
        return int(len(addr) and 1 + np.count_nonzero(addr[1:] != addr[:-1]))

    @property
    def spans(self) -> "SpanMapping":
        """Dict-like view {(source, key, start): tokens}, one span at a time (tools, tests, replay)."""
        return SpanMapping(self)


class SpanMapping(MutableMapping):
    """``store.spans[(source, key, start)] = tokens`` adds one span; reads look it up."""

    def __init__(self, store: SpanStore):
        self._store = store

    def __getitem__(self, address: tuple[int, int, int]) -> np.ndarray:
        tok = self._store.get(address)
        if tok is None:
            raise KeyError(address)
        return tok

    def __setitem__(self, address: tuple[int, int, int], tokens: np.ndarray) -> None:
        self._store.put(int(address[0]), int(address[1]), int(address[2]), tokens)

    def __delitem__(self, address: tuple[int, int, int]) -> None:
        raise TypeError("spans cannot be removed from a SpanStore")

    def __contains__(self, address: object) -> bool:
        return address in self._store

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        addr = self._store._built()[0]
        if len(addr):
            keep = np.append(addr[1:] != addr[:-1], True)
            for s, k, t in addr[keep].view(np.int64).reshape(-1, 3).tolist():
                yield (s, k, t)

    def __len__(self) -> int:
        return len(self._store)


def materialize_rank(layout: StepLayout, dp_local: int, spans: SpanStore, pad_id: int = 0) -> dict[str, np.ndarray]:
    """The batch of the dp rank with index `dp_local` in this (sub-)layout.

    Vectorised: every piece's tokens are gathered with one index into the store's values. A piece of
    n tokens needs at least n stored tokens; when the loader sent more (the document's next token),
    token n labels the piece's last position, else that label is ignored (-100).
    """
    S = layout.seq_len
    R = layout.rows_per_rank
    first_row = dp_local * R
    sel = (layout.seg_row >= first_row) & (layout.seg_row < first_row + R)
    rows = layout.seg_row[sel].astype(np.int64) - first_row
    src = layout.seg_source[sel]
    keys = layout.seg_key[sel]
    starts = layout.seg_start[sel]
    lens = layout.seg_len[sel].astype(np.int64)
    if np.any(lens <= 0):
        raise ValueError(f"step {layout.step}: empty or negative segment")
    offs = segment_offsets(rows, lens)

    begin, avail = spans.locate(src, keys, starts)
    short = avail < lens
    if short.any():
        i = int(np.argmax(short))
        what = "missing" if avail[i] < 0 else f"{int(avail[i])} < {int(lens[i])} tokens"
        raise MissingPayload(f"step {layout.step}: tokens of source {int(src[i])} sample {int(keys[i])} at offset "
                             f"{int(starts[i])} ({what})")

    # Every position of the flattened [R, S] batch lies in one cu_seqlens segment: a piece, or a row's
    # padding tail. A piece reads values[begin:begin + len]; a padding tail reads filler written after
    # the values. One index, repeat(base - start, len) + position in the segment, gathers it all.
    buf = spans._gather_buffer(S + 1, (pad_id, IGNORE_INDEX))
    nv = spans._size()
    fill = np.bincount(rows, weights=lens, minlength=R).astype(np.int64)
    pad_rows = np.flatnonzero(fill < S)
    piece_at = rows * S + offs
    at = np.concatenate([piece_at, pad_rows * S + fill[pad_rows]])
    order = np.argsort(at, kind="stable")
    at = at[order]
    size = np.concatenate([lens, S - fill[pad_rows]])[order]
    base = np.concatenate([begin, np.full(len(pad_rows), nv, np.int64)])[order]
    cu = np.append(at, R * S)  # the segments tile the rows: their starts, then the end
    # positions restart at 0 in every segment: ones, minus each segment's length at the next start, summed
    position_ids: np.ndarray = np.ones(R * S, np.int64)
    position_ids[at[1:]] = 1 - size[:-1]
    position_ids[0] = 0
    np.cumsum(position_ids, out=position_ids)
    index = np.repeat(base, size)
    index += position_ids
    buf[nv:] = pad_id
    input_ids = buf[index].astype(np.int64).reshape(R, S)
    # labels: the next token; at a piece's last position that is the extra token the loader sent, if any
    buf[nv:] = IGNORE_INDEX
    index += 1
    labels = buf[index].astype(np.int64)
    labels[(piece_at + lens - 1)[avail == lens]] = IGNORE_INDEX
    labels = labels.reshape(R, S)
    source_ids = np.repeat(np.concatenate([src, np.full(len(pad_rows), -1, src.dtype)])[order].astype(np.int32),
                           size).reshape(R, S)
    position_ids = position_ids.reshape(R, S)
    mb_bounds = np.arange(layout.microbatches + 1, dtype=np.int64) * layout.rows_per_microbatch * S
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "source_ids": source_ids,
        "cu_seqlens": cu.astype(np.int32),
        "cu_seqlens_mb": np.searchsorted(cu, mb_bounds).astype(np.int64),
        "segment_source": src.astype(np.int32),
        "segment_key": keys.astype(np.int64),
        "segment_start": starts.astype(np.int64),
        "segment_len": lens,
        "segment_row": rows,
        "segment_offset": offs,
    }


def hybrid_view(layout: StepLayout, dp_local: int, batch: dict[str, np.ndarray], cp_rank: int,
                pad_id: int = 0) -> dict[str, Any]:
    """What CP rank `cp_rank` of the dp rank with index `dp_local` receives of a hybrid DP x CP layout: its parts of
    the CP groups it belongs to (:func:`mixplane.parallelism.hybrid_rank_batch`), from the replica's batch
    (:func:`materialize_rank` of the same layout and dp rank)."""
    if not layout.hybrid_cp:
        raise ValueError(f"step {layout.step}: not a hybrid DP x CP layout")
    R = layout.rows_per_rank
    sel = (layout.seg_row >= dp_local * R) & (layout.seg_row < (dp_local + 1) * R)  # materialize_rank's segments
    return hybrid_rank_batch(batch, layout.seg_cp_first[sel], layout.seg_cp_size[sel], cp_rank, pad_id)

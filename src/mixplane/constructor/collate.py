"""Materialise one data-parallel rank's batch from a step layout and the planned token spans.

Output (numpy; the client wraps the buffers as torch tensors without copying):

    input_ids     int64 [rows, seq_len]   packed rows; padding = pad_id
    labels        int64 [rows, seq_len]   next token of the same document, -100 elsewhere
    position_ids  int64 [rows, seq_len]   restart at 0 for every piece (and padding)
    source_ids    int32 [rows, seq_len]   source index of each token, -1 for padding
    cu_seqlens    int32 [n + 1]           FlashAttention varlen boundaries over the flattened rows
    cu_seqlens_mb int64 [microbatches+1]  where each microbatch's boundaries start in cu_seqlens
    segment_*     one entry per piece: source, key (sample id), start (token offset in the sample),
                  len, row — which document span sits where (per-document metrics, debugging, audits)

A row never mixes documents in attention: every piece is its own segment in cu_seqlens, and the
padding tail of a row is a segment of its own. Labels never cross a document boundary; a piece
of a split document is labelled with the document's true next token when the loader sent it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mixplane.layout import StepLayout

IGNORE_INDEX = -100


class MissingPayload(KeyError):
    """A planned span whose tokens did not arrive; names step, source and sample."""


@dataclass
class SpanStore:
    """Token spans received for one step, addressed by (source, key, start)."""

    spans: dict[tuple[int, int, int], np.ndarray]

    @classmethod
    def empty(cls) -> "SpanStore":
        return cls({})

    def add(self, source: int, keys: np.ndarray, starts: np.ndarray, offsets: np.ndarray, values: np.ndarray) -> int:
        n = len(keys)
        for i in range(n):
            self.spans[(source, int(keys[i]), int(starts[i]))] = values[offsets[i] : offsets[i + 1]]
        return n

    def __len__(self) -> int:
        return len(self.spans)


def materialize_rank(layout: StepLayout, dp_local: int, spans: SpanStore, pad_id: int = 0) -> dict[str, np.ndarray]:
    """The batch of the dp rank with index `dp_local` in this (sub-)layout."""
    S = layout.seq_len
    rpr = layout.rows_per_rank
    R = rpr
    first_row = dp_local * rpr
    sel = (layout.seg_row >= first_row) & (layout.seg_row < first_row + rpr)
    rows = layout.seg_row[sel].astype(np.int64) - first_row
    src = layout.seg_source[sel]
    keys = layout.seg_key[sel]
    starts = layout.seg_start[sel]
    lens = layout.seg_len[sel].astype(np.int64)

    input_ids = np.full((R, S), pad_id, dtype=np.int64)
    labels = np.full((R, S), IGNORE_INDEX, dtype=np.int64)
    position_ids = np.zeros((R, S), dtype=np.int64)
    source_ids = np.full((R, S), -1, dtype=np.int32)
    flat_in = input_ids.reshape(-1)
    flat_lab = labels.reshape(-1)
    flat_src = source_ids.reshape(-1)

    # offset of each segment inside its row: running sum within the row
    offs = np.zeros(len(rows), dtype=np.int64)
    if len(rows):
        csum = np.cumsum(lens)
        row_start_idx = np.searchsorted(rows, rows, side="left")
        offs = csum - lens - np.where(row_start_idx > 0, csum[row_start_idx - 1], 0)
    for i in range(len(rows)):
        k = (int(src[i]), int(keys[i]), int(starts[i]))
        tok = spans.spans.get(k)
        n = int(lens[i])
        if tok is None or len(tok) < n:
            raise MissingPayload(f"step {layout.step}: tokens of source {k[0]} sample {k[1]} at offset {k[2]} "
                                 f"({'missing' if tok is None else f'{len(tok)} < {n} tokens'})")
        base = int(rows[i]) * S + int(offs[i])
        flat_in[base : base + n] = tok[:n]
        flat_lab[base : base + n - 1] = tok[1:n]
        if len(tok) > n:  # the loader sent the document's next token: label the last position with it
            flat_lab[base + n - 1] = tok[n]
        flat_src[base : base + n] = src[i]
        position_ids.reshape(-1)[base : base + n] = np.arange(n)

    # cu_seqlens: every piece, plus each row's padding tail, over the flattened [R, S]
    fill = np.bincount(rows, weights=lens, minlength=R).astype(np.int64) if len(rows) else np.zeros(R, np.int64)
    bounds = [np.int64(0)]
    ends = (rows * S + offs + lens) if len(rows) else np.zeros(0, np.int64)
    pad_ends = np.arange(1, R + 1, dtype=np.int64) * S
    has_pad = fill < S
    all_ends = np.concatenate([ends, pad_ends[has_pad]])
    pad_rows = np.arange(R)[has_pad]
    pad_start = pad_rows * S + fill[has_pad]
    # padding positions restart at 0 too
    for r, ps in zip(pad_rows, pad_start):
        position_ids.reshape(-1)[ps : (r + 1) * S] = np.arange((r + 1) * S - ps)
    cu = np.unique(np.concatenate([np.array(bounds, dtype=np.int64), all_ends]))
    cu_seqlens = cu.astype(np.int32)
    mb_rows = layout.rows_per_microbatch
    mb_bounds = np.arange(layout.microbatches + 1, dtype=np.int64) * mb_rows * S
    cu_mb = np.searchsorted(cu, mb_bounds).astype(np.int64)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "source_ids": source_ids,
        "cu_seqlens": cu_seqlens,
        "cu_seqlens_mb": cu_mb,
        "segment_source": src.astype(np.int32),
        "segment_key": keys.astype(np.int64),
        "segment_start": starts.astype(np.int64),
        "segment_len": lens.astype(np.int64),
        "segment_row": rows.astype(np.int64),
    }

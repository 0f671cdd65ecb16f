"""``pack_by``: consecutive stream rows with the same value of a metadata column become one document.

A source with ``pack_by: repo`` (files ordered by ``mixplane prep depsort``: by repository, then dependency
order) is read in file order (``shuffle: sequential``); the rows of one repository are adjacent in the stream, and
this joiner concatenates their tokens, in stream order, into one document (each row keeps its own EOS). The
planner packs that document like any other (pieces of at most seq_len, in order), so a repository's files stay
together and in order inside the trainer's rows, while the mixture's per-step guarantee is untouched: a bucket
is one more sample of its source.

A bucket ends where the value changes, where the pass (epoch) changes, at a null value (a null row is a bucket of
its own), or before the row that would take it past ``max_tokens`` (the source's max_doc_tokens): then that row
begins the next one. Whether a row joins the open bucket depends only on the rows from the bucket's first row on,
so reading again from a bucket's first row forms the same buckets: the window announces a bucket at the window
position of its first row's piece 0 (``split.window_pos``) and seeks to that row (``split.row_of``), exactly as
for split documents. A bucket is known complete only when the next row arrives (or the pass ends), so the window
reads one row past it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mixplane.samples import key_epoch


@dataclass
class Bucket:
    row: int  # stream position of its first row
    key: int  # its first row's key (the pass is the key's epoch)
    parts: list[np.ndarray] = field(default_factory=list)  # the rows' tokens, in stream order
    tokens: int = 0
    rows: int = 0

    def joined(self) -> np.ndarray:
        return self.parts[0] if len(self.parts) == 1 else np.concatenate(self.parts)


class BucketJoiner:
    """Rows in, complete buckets out (see the module docstring); pure, no I/O."""

    def __init__(self, max_tokens: int):
        self.max_tokens = int(max_tokens)
        self.open: Bucket | None = None
        self._value: Any = None
        self._epoch = -1

    def reset(self) -> None:
        """Forget the open bucket (a seek: reading starts again at a bucket's first row)."""
        self.open, self._value, self._epoch = None, None, -1

    def push(self, row: int, key: int, value: Any, tokens: np.ndarray) -> Bucket | None:
        """Add one row; returns the bucket it closed, if it began a new one."""
        epoch = int(key_epoch(key))
        b = self.open
        if (b is not None and value is not None and value == self._value and epoch == self._epoch
                and b.tokens + len(tokens) <= self.max_tokens):
            b.parts.append(tokens)
            b.tokens += len(tokens)
            b.rows += 1
            return None
        self.open = Bucket(int(row), int(key), [tokens], len(tokens), 1)
        self._value, self._epoch = value, epoch
        return b

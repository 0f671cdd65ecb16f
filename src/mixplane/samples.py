"""Sample keys and ragged arrays of the Source Loaders.

A sample is named by (source, key), the key unique per (epoch, row) of its source (:func:`make_key`),
so a repeat is detectable. :class:`Ragged` holds a batch of variable-length samples (token ids,
patch pixels) as one flat buffer plus offsets; the loader sends those buffers as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

EPOCH_SHIFT = 40
ROW_MASK = (1 << EPOCH_SHIFT) - 1
PIECE_SHIFT = 51  # piece keys of split documents: -((piece << PIECE_SHIFT) | key); keys stay below 2^51 for epochs < 2^11


def make_key(epoch: int | np.ndarray, row: int | np.ndarray) -> int | np.ndarray:
    """Sample keys are unique per (epoch, row) within one source, so a repeat is detectable."""
    return (np.asarray(epoch, dtype=np.int64) << EPOCH_SHIFT) | np.asarray(row, dtype=np.int64)


def key_epoch(key: int | np.ndarray) -> int | np.ndarray:
    return np.asarray(key, dtype=np.int64) >> EPOCH_SHIFT


def sample_pass(key: int | np.ndarray) -> int | np.ndarray:
    """The pass (epoch) of any sample key, a later piece of a split document (a negative key) included."""
    k = np.asarray(key, dtype=np.int64)
    return np.where(k >= 0, k, -k & ((1 << PIECE_SHIFT) - 1)) >> EPOCH_SHIFT


def key_row(key: int | np.ndarray) -> int | np.ndarray:
    return np.asarray(key, dtype=np.int64) & ROW_MASK


@dataclass
class Ragged:
    """A batch of variable-length 1-D arrays stored as one flat buffer plus offsets (no per-item objects)."""

    values: np.ndarray
    offsets: np.ndarray  # int64, len = n + 1, offsets[0] == 0

    def __post_init__(self) -> None:
        self.offsets = np.ascontiguousarray(self.offsets, dtype=np.int64)
        if len(self.offsets) == 0 or self.offsets[0] != 0 or self.offsets[-1] != len(self.values):
            raise ValueError("Ragged offsets do not cover the values buffer")
        if np.any(np.diff(self.offsets) < 0):
            raise ValueError("Ragged offsets are not monotonic")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @classmethod
    def from_arrays(cls, arrays: list[np.ndarray], dtype=np.int32) -> "Ragged":
        lens = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        values = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype=dtype)
        return cls(values, offsets)

    def take(self, idx: np.ndarray) -> "Ragged":
        idx = np.asarray(idx, dtype=np.int64)
        starts = self.offsets[idx]
        lens = self.offsets[idx + 1] - starts
        offsets = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        if len(idx) == 0:
            return Ragged(self.values[:0].copy(), offsets)
        # gather without a Python loop: repeat starts and add a running index
        gather = np.repeat(starts - offsets[:-1], lens) + np.arange(offsets[-1], dtype=np.int64)
        return Ragged(self.values[gather], offsets)

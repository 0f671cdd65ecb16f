"""The plan of one training step, as flat arrays: which token span of which sample lands where.

The planner produces a :class:`StepLayout`; constructors materialise it without further
decisions, so a layout (plus the samples' tokens) fully determines every rank's batch. That
is what makes `mixplane replay` and exact resume possible.

Rows: the step has ``dp * microbatches * rows_per_microbatch`` packed rows of ``seq_len``
tokens. Global row id = (dp_rank * microbatches + microbatch) * rows_per_microbatch + r.
Segments are listed row by row, in the order they sit in the row; a row's unused tail is padding.
Images (VLM) are listed separately with the encoder rank that encodes them.

Hybrid DP x CP layouts (``hybrid_cp`` > 0, the backbone's cp): every segment also names its context-parallel
group inside its row's DP replica -- ``seg_cp_first`` (the group's first CP rank) and ``seg_cp_size`` (k, a power
of two; 1 = the sequence stays whole on one rank). Rows then only carry the segments to their replica's
constructor; each CP rank receives the segments of the groups it belongs to, every one cut over its group
(``mixplane.parallelism.hybrid_rank_batch``). Other layouts have both arrays empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

SEGMENT_ARRAYS = ("seg_row", "seg_source", "seg_key", "seg_start", "seg_len")
IMAGE_ARRAYS = ("img_source", "img_key", "img_rank", "img_patches")
HYBRID_ARRAYS = ("seg_cp_first", "seg_cp_size")  # per segment, hybrid DP x CP layouts only
_DTYPES = {"seg_cp_first": np.int16, "seg_cp_size": np.int16, "seg_row": np.int32, "seg_source": np.int16, "seg_key": np.int64, "seg_start": np.int32,
           "seg_len": np.int32, "img_source": np.int16, "img_key": np.int64, "img_rank": np.int32,
           "img_patches": np.int32}


def _empty(name: str) -> np.ndarray:
    return np.zeros(0, dtype=_DTYPES[name])


@dataclass
class StepLayout:
    step: int
    seq_len: int
    dp: int
    microbatches: int
    rows_per_microbatch: int
    phase: int = 0
    lr_scale: float = 1.0
    generation: int = 0
    seg_row: np.ndarray = field(default_factory=lambda: _empty("seg_row"))
    seg_source: np.ndarray = field(default_factory=lambda: _empty("seg_source"))
    seg_key: np.ndarray = field(default_factory=lambda: _empty("seg_key"))
    seg_start: np.ndarray = field(default_factory=lambda: _empty("seg_start"))
    seg_len: np.ndarray = field(default_factory=lambda: _empty("seg_len"))
    img_source: np.ndarray = field(default_factory=lambda: _empty("img_source"))
    img_key: np.ndarray = field(default_factory=lambda: _empty("img_key"))
    img_rank: np.ndarray = field(default_factory=lambda: _empty("img_rank"))
    img_patches: np.ndarray = field(default_factory=lambda: _empty("img_patches"))
    hybrid_cp: int = 0  # the backbone's cp when segments carry their CP group (seg_cp_first / seg_cp_size)
    seg_cp_first: np.ndarray = field(default_factory=lambda: _empty("seg_cp_first"))
    seg_cp_size: np.ndarray = field(default_factory=lambda: _empty("seg_cp_size"))

    def __post_init__(self) -> None:
        for name in SEGMENT_ARRAYS + IMAGE_ARRAYS + HYBRID_ARRAYS:
            setattr(self, name, np.ascontiguousarray(getattr(self, name), dtype=_DTYPES[name]))

    @property
    def rows(self) -> int:
        return self.dp * self.microbatches * self.rows_per_microbatch

    @property
    def rows_per_rank(self) -> int:
        return self.microbatches * self.rows_per_microbatch

    def row_fill(self) -> np.ndarray:
        """Tokens used in each row."""
        return np.bincount(self.seg_row, weights=self.seg_len, minlength=self.rows).astype(np.int64)

    def validate(self) -> None:
        """Structural invariants every consumer relies on; raises ValueError naming the step."""
        n = len(self.seg_row)
        if any(len(getattr(self, a)) != n for a in SEGMENT_ARRAYS):
            raise ValueError(f"step {self.step}: segment arrays differ in length")
        if n and (self.seg_row.min() < 0 or self.seg_row.max() >= self.rows):
            raise ValueError(f"step {self.step}: segment row out of range")
        if n and np.any(np.diff(self.seg_row) < 0):
            raise ValueError(f"step {self.step}: segments are not ordered by row")
        if np.any(self.seg_len <= 0) or np.any(self.seg_start < 0):
            raise ValueError(f"step {self.step}: empty or negative segment")
        if np.any(self.row_fill() > self.seq_len):
            raise ValueError(f"step {self.step}: a row holds more than seq_len={self.seq_len} tokens")
        check_hybrid(self.step, self.hybrid_cp, n, self.seg_cp_first, self.seg_cp_size)

    def select_ranks(self, dp_ranks: list[int] | np.ndarray) -> "StepLayout":
        """The part of the layout a constructor needs (rows of these dp ranks, renumbered densely)."""
        dp_ranks = np.asarray(sorted(set(int(d) for d in dp_ranks)), dtype=np.int64)
        rpr = self.rows_per_rank
        seg_rank = self.seg_row // rpr
        keep = np.isin(seg_rank, dp_ranks)
        remap = np.full(self.dp, -1, dtype=np.int64)
        remap[dp_ranks] = np.arange(len(dp_ranks))
        new_row = remap[seg_rank[keep]] * rpr + self.seg_row[keep] % rpr
        out = StepLayout(self.step, self.seq_len, len(dp_ranks), self.microbatches, self.rows_per_microbatch,
                         self.phase, self.lr_scale, self.generation, new_row, self.seg_source[keep],
                         self.seg_key[keep], self.seg_start[keep], self.seg_len[keep],
                         self.img_source, self.img_key, self.img_rank, self.img_patches, self.hybrid_cp,
                         self.seg_cp_first[keep] if self.hybrid_cp else self.seg_cp_first,
                         self.seg_cp_size[keep] if self.hybrid_cp else self.seg_cp_size)
        return out

    def meta(self) -> dict[str, Any]:
        out = {"step": self.step, "seq_len": self.seq_len, "dp": self.dp, "microbatches": self.microbatches,
               "rows_per_microbatch": self.rows_per_microbatch, "phase": self.phase,
               "lr_scale": self.lr_scale, "generation": self.generation}
        if self.hybrid_cp:  # only hybrid layouts name it: every other layout's meta (and digest) is unchanged
            out["hybrid_cp"] = self.hybrid_cp
        return out

    def array_names(self) -> tuple[str, ...]:
        return SEGMENT_ARRAYS + IMAGE_ARRAYS + (HYBRID_ARRAYS if self.hybrid_cp else ())

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in self.array_names()}

    @classmethod
    def from_parts(cls, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> "StepLayout":
        """Rebuild from wire parts; raises ValueError (naming the field) on anything inconsistent."""
        try:
            kw = {k: meta[k] for k in ("step", "seq_len", "dp", "microbatches", "rows_per_microbatch")}
        except KeyError as e:
            raise ValueError(f"layout: missing field {e.args[0]!r}") from None
        for k, v in kw.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if k == "step" else 1):
                raise ValueError(f"layout: field {k!r} is invalid ({v!r})")
        for k in ("phase", "generation"):
            if not isinstance(meta.get(k, 0), int):
                raise ValueError(f"layout: field {k!r} is invalid")
        lr = meta.get("lr_scale", 1.0)
        if not isinstance(lr, (int, float)) or not lr > 0:
            raise ValueError("layout: field 'lr_scale' is invalid")
        hybrid = meta.get("hybrid_cp", 0)
        if not isinstance(hybrid, int) or isinstance(hybrid, bool) or hybrid < 0:
            raise ValueError("layout: field 'hybrid_cp' is invalid")
        parts: dict[str, Any] = {}
        for name in SEGMENT_ARRAYS + IMAGE_ARRAYS + (HYBRID_ARRAYS if hybrid else ()):
            a = arrays.get(name)
            if a is None:
                raise ValueError(f"layout: missing array {name!r}")
            if a.ndim != 1 or a.dtype != np.dtype(_DTYPES[name]):
                raise ValueError(f"layout: array {name!r} has dtype {a.dtype} / ndim {a.ndim}")
            parts[name] = a
        out = cls(**kw, phase=meta.get("phase", 0), lr_scale=float(lr), generation=meta.get("generation", 0),
                  hybrid_cp=hybrid, **parts)
        out.validate()
        return out


def check_hybrid(step: int, cp: int, n: int, first: np.ndarray, size: np.ndarray) -> None:
    """A hybrid layout's CP groups: one per segment, k a power of two, aligned (first a multiple of k), inside
    the replica's cp ranks; a layout that is not hybrid has none. Raises ValueError naming the step."""
    if not cp:
        if len(first) or len(size):
            raise ValueError(f"step {step}: seg_cp_first / seg_cp_size given but the layout is not hybrid_cp")
        return
    if cp & (cp - 1):
        raise ValueError(f"step {step}: hybrid_cp {cp} is not a power of two")
    if len(first) != n or len(size) != n:
        raise ValueError(f"step {step}: hybrid layout: {len(first)} seg_cp_first and {len(size)} seg_cp_size "
                         f"for {n} segments")
    k = size.astype(np.int64)
    f = first.astype(np.int64)
    bad = (k < 1) | (k & (k - 1) != 0) | (f < 0) | (f % np.maximum(k, 1) != 0) | (f + k > cp)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"step {step}: segment {i}: CP group of {int(k[i])} ranks from cp rank {int(f[i])} is not an "
                         f"aligned power-of-two group of the {cp} CP ranks")


def segment_offsets(rows: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Offset of each segment inside its row, for segments listed row by row in the order they sit
    there: the running sum of the lengths before it in the same row (int64)."""
    rows = np.asarray(rows)
    lens = np.asarray(lens, dtype=np.int64)
    if len(rows) != len(lens):
        raise ValueError(f"segment_offsets: {len(rows)} rows but {len(lens)} lengths")
    if not len(rows):
        return np.zeros(0, dtype=np.int64)
    if np.any(rows[1:] < rows[:-1]):
        raise ValueError("segment_offsets: segments are not ordered by row")
    before = np.cumsum(lens) - lens  # tokens of all earlier segments
    return before - before[np.searchsorted(rows, rows, side="left")]


def layout_digest(layout: StepLayout) -> str:
    """A short fingerprint of what a step contains, journaled so replays can prove they match."""
    import hashlib

    h = hashlib.sha1()
    h.update(repr(sorted(layout.meta().items())).encode())
    for name in layout.array_names():
        h.update(np.ascontiguousarray(getattr(layout, name)).data)  # the buffer itself: no copy
    return h.hexdigest()[:16]

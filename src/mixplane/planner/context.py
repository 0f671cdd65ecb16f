"""What a planning strategy sees of one step: the pieces chosen (Pieces) and the step's context (PlanContext),
with mixing run lazily when the strategy first asks for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from mixplane.layout import StepLayout
from mixplane.mixing import MixturePoint
from mixplane.spec import DataMixtureSpec
from mixplane.topology import ClientPlaceTree


@dataclass
class Pieces:
    """Token spans chosen for one step, with the packed row (bin) each landed in."""

    bin: np.ndarray
    source: np.ndarray
    key: np.ndarray
    start: np.ndarray
    length: np.ndarray
    patches: np.ndarray  # encoder patches carried by the piece (first piece of an image sample)
    replica: np.ndarray
    pos: np.ndarray

    def __len__(self) -> int:
        return len(self.bin)

    def take(self, idx: np.ndarray) -> "Pieces":
        return Pieces(*(getattr(self, f)[idx] for f in ("bin", "source", "key", "start", "length", "patches", "replica", "pos")))


class PlanContext:
    """Everything a strategy may look at for one step (metadata only).

    Mixing is lazy: `pieces` (or `mix()`) runs the planner's deterministic stratified selection the
    first time it is needed, so a strategy's `DGraph.mix(schedule)` decides *how* the step is mixed.
    Calling `mix` again rolls the selection back and re-mixes (e.g. with some candidates excluded).
    """

    def __init__(self, spec: DataMixtureSpec, step: int, point: MixturePoint, pieces: Pieces | None = None,
                 rows: int = 0, seq_len: int = 0, dp: int = 1, microbatches: int = 1, rows_per_microbatch: int = 1,
                 options: dict[str, Any] | None = None, *, tree: ClientPlaceTree | None = None,
                 mixer: Callable[[Any, Any], tuple[Pieces, MixturePoint]] | None = None,
                 buffer: Callable[[], dict[str, Any]] | None = None):
        self.spec = spec
        self.step = step
        self.point = point
        self._pieces = pieces
        self.rows = rows
        self.seq_len = seq_len
        self.dp = dp
        self.microbatches = microbatches
        self.rows_per_microbatch = rows_per_microbatch
        self.options = dict(options or {})
        self.tree = tree if tree is not None else ClientPlaceTree.from_spec(spec)
        self._mixer = mixer
        self._buffer = buffer
        self.broadcast: list[str] = list(self.tree.broadcast)  # a place_tree override broadcasts as broadcast_at does
        self.stats: dict[str, Any] = {}
        # build_layout's own pairing for the layout it built: (layout, piece of every segment, piece of every
        # image); the coverage check verifies it instead of searching for one
        self.built: tuple[StepLayout, np.ndarray, np.ndarray] | None = None

    @property
    def mixed(self) -> bool:
        return self._pieces is not None

    @property
    def pieces(self) -> Pieces:
        if self._pieces is None:
            self.mix()
        return self._pieces  # type: ignore[return-value]

    def mix(self, schedule: Any = None, *, exclude: Any = None) -> Pieces:
        """Select the step's pieces (stratified by the schedule's weights at this step)."""
        if self._mixer is None:
            if self._pieces is None:
                raise RuntimeError(f"step {self.step}: this context has no mixer and no pieces")
            if schedule is not None or exclude:
                raise RuntimeError(f"step {self.step}: this context was built with fixed pieces; it cannot re-mix")
            return self._pieces
        self._pieces, self.point = self._mixer(schedule, exclude)
        return self._pieces

    def summary_buffer(self) -> dict[str, Any]:
        return self._buffer() if self._buffer is not None else {}


Strategy = Callable[[PlanContext], StepLayout]

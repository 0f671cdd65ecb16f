"""The planner's pure core: loader windows, per-step mixing and packing, and the resumable cursor.

Each Source Loader replica exposes a *window*: the metadata of the first `window` samples of its
deterministic stream that are not yet fully consumed. A step is planned only when every window is
full, and planning depends only on window contents and the planner's own state, so the plan of
step s is a pure function of (spec generation, seed, s, cursor) — the cursor being the windows'
consumption state plus the sampler's counters. That is what the journal stores and what the
client's `state_dict()` carries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from mixplane.constructor.packing import OnlinePacker
from mixplane.layout import StepLayout
from mixplane.mixing import DeficitSampler, MixturePoint, MixtureSchedule
from mixplane.spec import DataMixtureSpec


class WindowError(ValueError):
    """Metadata from a loader that contradicts the window (out of order, duplicate, bad sizes)."""


def window_full(samples: int, unconsumed_tokens: int, min_samples: int, min_tokens: int, max_samples: int) -> bool:
    """The one predicate loaders and planner share, so both agree on a window's exact content."""
    return samples >= max_samples or (samples >= min_samples and unconsumed_tokens >= min_tokens)


class ReplicaWindow:
    """The planner's view of one loader replica's unconsumed read-ahead samples, in stream order."""

    def __init__(self, source: int, replica: int, min_samples: int, min_tokens: int = 0, max_samples: int | None = None):
        self.source = source
        self.replica = replica
        self.min_samples = min_samples
        self.min_tokens = min_tokens
        self.capacity = max_samples if max_samples is not None else min_samples
        self.pos = np.zeros(0, np.int64)
        self.key = np.zeros(0, np.int64)
        self.tokens = np.zeros(0, np.int64)
        self.patches = np.zeros(0, np.int64)
        self.done = np.zeros(0, np.int64)  # tokens already delivered of each sample
        self.low = 0  # every position below is fully consumed
        self.next_pos = 0  # first position not yet received
        self.skip: set[int] = set()  # consumed positions in [low, next) (restored from a cursor)
        self.restored_done: dict[int, int] = {}
        self.dry = False

    def __len__(self) -> int:
        return len(self.pos)

    @property
    def unconsumed_tokens(self) -> int:
        return int((self.tokens - self.done).sum())

    @property
    def ready(self) -> bool:
        """Full: the loader has announced the shortest stream prefix meeting both minimums (or the cap)."""
        return window_full(len(self.pos), self.unconsumed_tokens, self.min_samples, self.min_tokens, self.capacity) or self.dry

    def add(self, pos: np.ndarray, key: np.ndarray, tokens: np.ndarray, patches: np.ndarray) -> None:
        pos = np.asarray(pos, np.int64)
        if len(pos) == 0:
            return
        if not (len(key) == len(tokens) == len(patches) == len(pos)):
            raise WindowError(f"source {self.source} replica {self.replica}: metadata arrays differ in length")
        if pos[0] < self.next_pos or np.any(np.diff(pos) <= 0):
            raise WindowError(f"source {self.source} replica {self.replica}: positions out of order (got {int(pos[0])}, expected >= {self.next_pos})")
        if np.any(np.asarray(tokens) <= 0):
            raise WindowError(f"source {self.source} replica {self.replica}: a sample has no tokens")
        bad = [int(p) for p in pos if int(p) in self.skip]
        if bad:
            raise WindowError(f"source {self.source} replica {self.replica}: position {bad[0]} was already consumed")
        if len(self.pos) + len(pos) > self.capacity:
            raise WindowError(f"source {self.source} replica {self.replica}: window overflow ({len(self.pos) + len(pos)} > {self.capacity})")
        done = np.array([self.restored_done.get(int(p), 0) for p in pos], dtype=np.int64)
        toks = np.asarray(tokens, np.int64)
        before_last = self.unconsumed_tokens + int((toks[:-1] - done[:-1]).sum())
        if window_full(len(self.pos) + len(pos) - 1, before_last, self.min_samples, self.min_tokens, self.capacity):
            raise WindowError(f"source {self.source} replica {self.replica}: samples announced beyond a full window (from position {int(pos[0])})")
        for p in pos:
            self.restored_done.pop(int(p), None)
        self.pos = np.concatenate([self.pos, pos])
        self.key = np.concatenate([self.key, np.asarray(key, np.int64)])
        self.tokens = np.concatenate([self.tokens, np.asarray(tokens, np.int64)])
        self.patches = np.concatenate([self.patches, np.asarray(patches, np.int64)])
        self.done = np.concatenate([self.done, done])
        self.next_pos = int(pos[-1]) + 1
        self.dry = False

    def compact(self) -> np.ndarray:
        """Drop fully consumed samples; returns their positions."""
        full = self.done >= self.tokens
        gone = self.pos[full]
        if len(gone):
            keep = ~full
            for name in ("pos", "key", "tokens", "patches", "done"):
                setattr(self, name, getattr(self, name)[keep])
        new_low = int(self.pos[0]) if len(self.pos) else self.next_pos
        if new_low != self.low:
            self.skip = {p for p in self.skip if p >= new_low}
            self.low = new_low
        self.skip.update(int(p) for p in gone if p >= self.low)
        return gone

    def cursor(self) -> dict[str, Any]:
        """Consumption state: enough for a loader to re-emit exactly the unconsumed samples."""
        skip = sorted(self.skip)
        return {"low": self.low, "next": self.next_pos, "skip": skip,
                "partial": {str(int(p)): int(d) for p, d in zip(self.pos, self.done) if d > 0}}

    def restore(self, cur: dict[str, Any]) -> None:
        self.__init__(self.source, self.replica, self.min_samples, self.min_tokens, self.capacity)  # type: ignore[misc]
        self.low = self.next_pos = int(cur["low"])
        self.skip = {int(p) for p in cur.get("skip", [])}
        self.restored_done = {int(p): int(d) for p, d in cur.get("partial", {}).items()}


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


@dataclass
class PlanContext:
    """Everything a strategy may look at for one step (metadata only)."""

    spec: DataMixtureSpec
    step: int
    point: MixturePoint
    pieces: Pieces
    rows: int
    seq_len: int
    dp: int
    microbatches: int
    rows_per_microbatch: int
    options: dict[str, Any] = field(default_factory=dict)


Strategy = Callable[[PlanContext], StepLayout]


def layout_from_rows(ctx: PlanContext, row_of_bin: np.ndarray) -> StepLayout:
    """Turn packed bins into a layout, given the global row each bin goes to (a permutation)."""
    p = ctx.pieces
    rows = np.asarray(row_of_bin, np.int64)[p.bin] if len(p) else np.zeros(0, np.int64)
    order = np.lexsort((np.arange(len(p)), rows))
    img = p.patches[order] > 0
    return StepLayout(
        step=ctx.step, seq_len=ctx.seq_len, dp=ctx.dp, microbatches=ctx.microbatches,
        rows_per_microbatch=ctx.rows_per_microbatch, phase=ctx.point.phase, lr_scale=ctx.point.lr_scale,
        generation=ctx.point.generation, seg_row=rows[order], seg_source=p.source[order], seg_key=p.key[order],
        seg_start=p.start[order], seg_len=p.length[order],
        img_source=p.source[order][img], img_key=p.key[order][img],
        img_rank=(rows[order][img] // (ctx.microbatches * ctx.rows_per_microbatch)),
        img_patches=p.patches[order][img],
    )


def vanilla_strategy(ctx: PlanContext) -> StepLayout:
    """No balancing: bin b is row b (rank b // rows_per_rank)."""
    return layout_from_rows(ctx, np.arange(ctx.rows))


@dataclass
class StepPlan:
    layout: StepLayout
    pieces: Pieces  # in layout order is not required; carries replica/pos for loader instructions
    cursor_before: dict[str, Any]
    tokens_by_source: np.ndarray
    samples_by_source: np.ndarray


class StepPlanner:
    """Plans steps in order from full windows; holds the sampler and the windows."""

    def __init__(self, spec: DataMixtureSpec, strategy: Strategy | None = None, generation: int = 0):
        self.spec = spec
        self.schedule = MixtureSchedule(spec, generation)
        self.n_sources = len(spec.sources)
        self.sampler = DeficitSampler(self.n_sources)
        self.strategy = strategy or vanilla_strategy
        self.windows: list[ReplicaWindow] = []
        for si, s in enumerate(spec.sources):
            lo, tokens, hi = spec.window_bounds(si)
            for r in range(s.replicas):
                self.windows.append(ReplicaWindow(si, r, lo, tokens, hi))
        self.next_step = 0
        bb = spec.topology.backbone()[1]
        self.dp = bb.dp
        self.unit_samples = spec.mixture.unit == "samples"

    def window(self, source: int, replica: int) -> ReplicaWindow:
        for w in self.windows:
            if w.source == source and w.replica == replica:
                return w
        raise KeyError(f"no window for source {source} replica {replica}")

    @property
    def ready(self) -> bool:
        return all(w.ready for w in self.windows)

    def waiting_for(self) -> list[ReplicaWindow]:
        return [w for w in self.windows if not w.ready]

    # -- cursor -------------------------------------------------------------------------
    def cursor(self) -> dict[str, Any]:
        return {
            "step": self.next_step,
            "sampler": self.sampler.state_dict(),
            "schedule": self.schedule.state_dict(),
            "windows": [{"source": w.source, "replica": w.replica, **w.cursor()} for w in self.windows],
        }

    def restore(self, cur: dict[str, Any]) -> None:
        self.next_step = int(cur["step"])
        self.sampler.load_state_dict(cur["sampler"])
        self.schedule.load_state_dict(cur["schedule"])
        by_id = {(int(c["source"]), int(c["replica"])): c for c in cur["windows"]}
        if set(by_id) != {(w.source, w.replica) for w in self.windows}:
            raise ValueError("cursor was made for a different set of sources / loader replicas")
        for w in self.windows:
            w.restore(by_id[(w.source, w.replica)])

    # -- planning -----------------------------------------------------------------------
    def select(self, step: int, point: MixturePoint) -> Pieces:
        """Mix and pack: choose token spans by deficit and place them best-fit into the step's rows."""
        spec = self.spec
        S = spec.batch.seq_len
        R = spec.rows_per_step
        packer = OnlinePacker(R, S, spec.batch.packing)
        truncate = spec.batch.overlong == "truncate"
        self.sampler.enter(point)
        # candidates per source: (window index, entry index) in stream-position order
        cands: list[list[tuple[int, int]]] = [[] for _ in range(self.n_sources)]
        for wi, w in enumerate(self.windows):
            for ei in range(len(w)):
                cands[w.source].append((int(w.pos[ei]), w.replica, wi, ei))  # type: ignore[arg-type]
        for c in cands:
            c.sort()
        ptr = np.zeros(self.n_sources, dtype=np.int64)
        counts = np.array([len(c) for c in cands], dtype=np.int64)
        out: dict[str, list[int]] = {k: [] for k in ("bin", "source", "key", "start", "length", "patches", "replica", "pos")}
        unit = 1.0 if self.unit_samples else 0.0
        while packer.largest_gap > 0:
            eligible = ptr < counts
            src = self.sampler.pick(point.probs, eligible, unit)
            if src < 0:
                break
            _, _, wi, ei = cands[src][ptr[src]]  # type: ignore[misc]
            w = self.windows[wi]
            remaining = int(w.tokens[ei] - w.done[ei])
            piece = min(remaining, S)
            row = packer.place(piece)
            if row < 0:
                ptr[src] += 1  # does not fit this step; stays in the window for the next
                continue
            start = int(w.done[ei])
            first_piece = start == 0
            out["bin"].append(row)
            out["source"].append(src)
            out["key"].append(int(w.key[ei]))
            out["start"].append(start)
            out["length"].append(piece)
            out["patches"].append(int(w.patches[ei]) if first_piece else 0)
            out["replica"].append(w.replica)
            out["pos"].append(int(w.pos[ei]))
            w.done[ei] = w.tokens[ei] if truncate else start + piece
            if w.done[ei] >= w.tokens[ei]:
                ptr[src] += 1
            self.sampler.record(src, 1.0 if self.unit_samples else piece)
            if self.unit_samples and not first_piece:
                self.sampler.record(src, -1.0)  # a sample counts once, at its first piece
        dt = {"bin": np.int64, "source": np.int16, "key": np.int64, "start": np.int64, "length": np.int64,
              "patches": np.int64, "replica": np.int64, "pos": np.int64}
        return Pieces(**{k: np.asarray(v, dtype=dt[k]) for k, v in out.items()})

    def plan(self) -> StepPlan:
        """Plan `next_step`; all windows must be ready."""
        if not self.ready:
            waiting = ", ".join(f"{self.spec.sources[w.source].name}/{w.replica}" for w in self.waiting_for())
            raise RuntimeError(f"step {self.next_step}: windows not full yet ({waiting})")
        cursor = self.cursor()
        step = self.next_step
        point = self.schedule.at(step)
        pieces = self.select(step, point)
        bb = self.spec.topology.backbone()[1]
        ctx = PlanContext(self.spec, step, point, pieces, self.spec.rows_per_step, self.spec.batch.seq_len,
                          bb.dp, self.spec.batch.microbatches, self.spec.rows_per_microbatch,
                          dict(self.spec.strategy.options))
        layout = self.strategy(ctx)
        layout.validate()
        for w in self.windows:
            w.compact()
        self.next_step += 1
        tok = np.bincount(pieces.source.astype(np.int64), weights=pieces.length, minlength=self.n_sources)
        first = pieces.start == 0
        smp = np.bincount(pieces.source[first].astype(np.int64), minlength=self.n_sources)
        return StepPlan(layout, pieces, cursor, tok, smp)

"""The step planner: per-step mixing and packing over the loader windows, strategies, live updates and the cursor.

Each Source Loader replica exposes a *window* (planner/windows.py): the metadata of the first `window` samples of
its deterministic stream that are not yet fully consumed. A step is planned only when every window is full, and
planning depends only on window contents and the planner's own state, so the plan of step s is a pure function
of (spec generation, seed, s, cursor) — the cursor (planner/cursors.py) being the windows' consumption state
plus the sampler's counters. That is what the journal stores and what the client's `state_dict()` carries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mixplane.errors import MixplaneError
from mixplane.planner import layoutloop, selectloop
from mixplane.layout import StepLayout
from mixplane.mixing import (DeficitSampler, MixturePoint, MixtureSchedule, Segment, SourcesExhausted, apply_temperature,
                             check_update_id, slack, spec_with_mixture)
from mixplane.protocol import ListingPin, parse_listing_pins
from mixplane.samples import sample_pass
from mixplane.repartition import RepartitionError, parse_partitioning, parse_record
from mixplane.spec import DataMixtureSpec, SpecError, epoch_caps
from mixplane.topology import ClientPlaceTree
from mixplane.planner.context import Pieces, PlanContext, Strategy
from mixplane.planner.cursors import PlannerCursor
from mixplane.planner.dgraph import vanilla_strategy
from mixplane.planner.windows import ReplicaWindow, WindowStore


class RowsShortError(MixplaneError, RuntimeError):
    """A source weighted by rows per step (mixture.rows) could not begin all of its documents in a step."""


class CoverageError(MixplaneError, RuntimeError):
    """A strategy's layout does not place every selected piece exactly once."""


def check_coverage(layout: StepLayout, pieces: Pieces, built: tuple[StepLayout, np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Every selected piece lands in the layout exactly once, whole; every image exactly once.
    Returns the piece of every layout segment (routing uses it to find each span's loader).
    `built`: (layout, piece of every segment, piece of every image) claimed by whoever built the layout
    (PlanContext.built); verified in a few vectorised passes, and only if it fails is a pairing searched."""
    step = layout.step
    if len(layout.seg_row) != len(pieces):
        raise CoverageError(f"step {step}: the layout has {len(layout.seg_row)} segments for {len(pieces)} selected pieces")
    if built is not None and built[0] is layout and _pairs(layout, pieces, built[1], built[2]):
        return built[1]
    piece_of_seg, _ = selectloop.match((layout.seg_source, layout.seg_key, layout.seg_start, layout.seg_len),
                                       (pieces.source, pieces.key, pieces.start, pieces.length))
    img = pieces.patches > 0
    n_img = int(img.sum())
    if len(layout.img_key) != n_img:
        raise CoverageError(f"step {step}: the layout lists {len(layout.img_key)} images for {n_img} selected")
    zero = np.zeros(n_img, np.int64)
    img_ok, _ = selectloop.match((layout.img_source, layout.img_key, zero, layout.img_patches),
                                 (pieces.source[img], pieces.key[img], zero, pieces.patches[img]))
    if piece_of_seg is None or img_ok is None:
        _coverage_error(layout, pieces)
    return piece_of_seg  # type: ignore[return-value]


def _pairs(layout: StepLayout, pieces: Pieces, seg_piece: np.ndarray, img_piece: np.ndarray) -> bool:
    """Whether segment i is piece seg_piece[i] and image j the image piece img_piece[j], one to one (then
    the layout covers the selection exactly)."""
    n = len(pieces)
    n_img = int(np.count_nonzero(pieces.patches > 0))
    seg = (layout.seg_source, layout.seg_key, layout.seg_start, layout.seg_len)
    img = (layout.img_source, layout.img_key, layout.img_patches)
    if len(seg_piece) != n or len(img_piece) != n_img or any(len(a) != n for a in seg) or any(len(a) != n_img for a in img):
        return False
    return selectloop.pairs(seg, img, (pieces.source, pieces.key, pieces.start, pieces.length, pieces.patches),
                            np.asarray(seg_piece), np.asarray(img_piece))


def _coverage_error(layout: StepLayout, pieces: Pieces) -> None:
    """The first difference, in a canonical order (the slow path: only when the check failed)."""
    def canon(src, key, start, length):
        o = np.lexsort((length, start, key, src))
        return np.stack([np.asarray(src, np.int64)[o], np.asarray(key, np.int64)[o],
                         np.asarray(start, np.int64)[o], np.asarray(length, np.int64)[o]])

    step = layout.step
    a = canon(layout.seg_source, layout.seg_key, layout.seg_start, layout.seg_len)
    b = canon(pieces.source, pieces.key, pieces.start, pieces.length)
    if not np.array_equal(a, b):
        bad = np.nonzero((a != b).any(axis=0))[0][0]
        raise CoverageError(f"step {step}: the layout does not match the selection (first difference: source "
                            f"{b[0, bad]} key {b[1, bad]} start {b[2, bad]})")
    raise CoverageError(f"step {step}: the layout's images do not match the selected images")


@dataclass
class StepPlan:
    layout: StepLayout
    pieces: Pieces  # in layout order is not required; carries replica/pos for loader instructions
    _cursor_before: "dict[str, Any] | PlannerCursor"  # read as cursor_before (built when first read)
    tokens_by_source: np.ndarray
    samples_by_source: np.ndarray
    broadcast: tuple[str, ...] = ()  # axes the trainer broadcasts along (only coordinate 0 fetches)
    stats: dict[str, Any] = field(default_factory=dict)  # what balancing did (imbalance before / after)
    piece_of_seg: np.ndarray | None = None  # the piece each layout segment is (from the coverage check)
    retired: np.ndarray | None = None  # uint8 per piece: StepPlanner.retired(pieces), found while compacting
    seg_of_img: np.ndarray | None = None  # routing.image_segments (the segment carrying each image), if known
    ended: tuple[str, ...] = ()  # sources that ended in this step (their last pass delivered; journaled)

    @property
    def cursor_before(self) -> dict[str, Any]:
        """The planner's cursor before this step (StepPlanner.cursor() then)."""
        if isinstance(self._cursor_before, PlannerCursor):
            self._cursor_before = self._cursor_before.build()
        return self._cursor_before


UPDATES_KEPT = 1024  # applied mixture updates (and acknowledged update ids) a planner remembers


def _number(name: str, x: Any) -> float:
    """A number of a request (ValueError naming it otherwise: bool, text, an integer too large for a float)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ValueError(f"{name}: expected a number, got {x!r:.40}")
    try:
        return float(x)
    except OverflowError:
        raise ValueError(f"{name}: {str(x)[:20]}... is too large") from None


class StepPlanner:
    """Plans steps in order from full windows; holds the sampler and the windows."""

    def __init__(self, spec: DataMixtureSpec, strategy: Strategy | None = None, generation: int = 0):
        self.spec = spec
        self.generation = generation
        self.schedule = MixtureSchedule(spec, generation)
        self.n_sources = len(spec.sources)
        self.sampler = DeficitSampler(self.n_sources)
        self.strategy = strategy or vanilla_strategy
        # re-partitioned sources (mixplane.repartition): source index -> the records applied, oldest first
        self.partitioning: dict[int, list[dict[str, Any]]] = {}
        # static sources: the listing and read order the run's positions count over (set by the planner server
        # from the first loader's HELLO or a cursor's; restored with a cursor that names them)
        self.listings: dict[int, ListingPin] = {}
        self.windows: list[ReplicaWindow] = []
        for si, s in enumerate(spec.sources):
            lo, tokens, hi = spec.window_bounds(si)
            for r in range(s.replicas):
                self.windows.append(ReplicaWindow(si, r, lo, tokens, hi))
        self._by_id = {(w.source, w.replica): w for w in self.windows}
        self.store = WindowStore(self.windows)
        self._taken: tuple[Pieces, np.ndarray] | None = None  # the last select's pieces and their store indices
        self.next_step = 0
        self.tree = ClientPlaceTree.from_spec(spec)
        self.dp = self.tree.backbone.dp
        self.unit_samples = spec.mixture.unit == "samples"
        self._replicated = any(s.replicas > 1 for s in spec.sources)  # candidates() must merge replicas
        self._spec_replicas = [s.replicas for s in spec.sources]
        # sources' ends (docs/mixtures.md): passes each may be read (None: no end), rows per step of rows sources
        self._caps = epoch_caps(spec)
        self._quota = np.array([spec.mixture.rows.get(s.name, 0) for s in spec.sources], np.int64)
        self._ended_now: list[int] = []  # sources the last select ended
        # runtime mixture updates: the events applied, by generation (a rewind applies the newer ones again), and
        # the acknowledged update ids (update_id -> {update_id, generation, effective_step}), oldest first
        self.update_log: dict[int, dict[str, Any]] = {}
        self.acked: dict[str, dict[str, Any]] = {}

    def window(self, source: int, replica: int) -> ReplicaWindow:
        try:
            return self._by_id[(source, replica)]
        except KeyError:
            raise KeyError(f"no window for source {source} replica {replica}") from None

    @property
    def ready(self) -> bool:
        return not self.waiting_for()

    def waiting_for(self) -> list[ReplicaWindow]:
        """Windows the next step waits for: a source with no weight at that step is not drawn from,
        so its window (e.g. a dry live source switched off) need not be full."""
        try:
            probs = self.schedule.at(self.next_step).probs
        except SourcesExhausted:
            return []  # nothing to wait for: plan() says why
        need = (probs > 0) | ((self._quota > 0) & self.schedule.live_mask(self.next_step))
        return [w for w in self.windows if need[w.source] and not w.ready]

    def summary_buffer(self) -> dict[str, Any]:
        """Per source: unconsumed samples, their remaining tokens and patches in the windows."""
        out: dict[str, Any] = {}
        for w in self.windows:
            name = self.spec.sources[w.source].name
            d = out.setdefault(name, {"samples": 0, "tokens": 0, "patches": 0, "replicas": 0})
            d["samples"] += len(w)
            d["tokens"] += int((w.tokens - w.done).sum())
            d["patches"] += int(w.patches[w.done == 0].sum())
            d["replicas"] += 1
        return out

    def retired(self, pieces: Pieces) -> np.ndarray:
        """uint8 per piece: its sample left its window with the last plan (fully consumed), so the loader
        may drop it after sending. One vectorised pass over all windows (was one mask per window)."""
        n = len(pieces)
        if n == 0:
            return np.zeros(0, np.uint8)
        first = np.zeros(self.n_sources, np.int64)  # windows are listed source by source, replicas in order
        np.cumsum([s.replicas for s in self.spec.sources[:-1]], out=first[1:])
        wi = first[pieces.source.astype(np.int64)] + pieces.replica
        low = np.array([w.low for w in self.windows], np.int64)
        out = pieces.pos < low[wi]
        # consumed positions above a low mark (few windows have any): matched window by window, as positions may
        # use all 63 bits (a source read block by block: 2^30 slots a block), so no (window, position) packing
        for i, sk in ((i, w.skip) for i, w in enumerate(self.windows) if w.skip):
            m = np.flatnonzero(wi == i)
            if len(m):
                out[m] |= np.isin(pieces.pos[m], np.fromiter(sk, np.int64, len(sk)))
        return out.astype(np.uint8)

    # -- runtime changes ----------------------------------------------------------------
    def update_mixture(self, weights: dict[str, float], effective_step: int, generation: int,
                       lr_scale: float | None = None, temperature: float | None = None, *,
                       update_id: str | None = None) -> dict[str, Any]:
        """New weights from `effective_step` on (a new spec generation) until the next scheduled boundary;
        returns the journal event. Steps already planned cannot change: effective_step must be >= next_step."""
        rows = self.spec.mixture.rows
        shared = sorted(n for n, w in weights.items() if n in rows and w != 0)
        if shared:
            raise ValueError(f"weights.{shared[0]}: source {shared[0]!r} is weighted by rows (mixture.rows.{shared[0]}); "
                             "it takes no share weight")
        planned_through = self.next_step - 1
        seg = self.schedule.update(weights, effective_step, generation, lr_scale,
                                   planned_through=planned_through, temperature=temperature)
        self.generation = max(self.generation, generation)
        event = {"event": "update", "generation": generation, "effective_step": int(effective_step),
                 "planned_through": planned_through, "weights": {k: float(v) for k, v in weights.items()},
                 "lr_scale": lr_scale, "temperature": temperature, "segment": seg.to_json()}
        return self._applied(event, update_id)

    def adopt_mixture(self, mixture: Any, effective_step: int | None, generation: int, *,
                      update_id: str | None = None) -> dict[str, Any]:
        """A whole mixture section (weights, temperature, phases, anneal and their lr_scale: the JSON of the
        spec's `mixture`) in force from `effective_step` (None: the first step not planned) as generation
        `generation`: from that step on the schedule is MixtureSchedule of the spec with this mixture, later
        phases at their own steps (MixtureSchedule.rebase). Returns the journal event. ValueError (SpecError
        naming the field, or a step already planned) and nothing changes when it cannot be adopted."""
        step = self.next_step if effective_step is None else int(effective_step)
        new = spec_with_mixture(self.spec, mixture)
        planned_through = self.next_step - 1
        segs = self.schedule.rebase(new, step, generation, planned_through=planned_through)
        self.generation = max(self.generation, generation)
        event = {"event": "update", "generation": generation, "effective_step": step,
                 "planned_through": planned_through, "mixture": new.mixture.model_dump(mode="json"),
                 "segments": [g.to_json() for g in segs]}
        return self._applied(event, update_id)

    def apply_update(self, meta: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """An UPDATE_MIXTURE request (``mixture`` + ``update_id`` [+ ``effective_step``]: see
        mixing.mixture_update_meta; or the weights form ``weights`` [+ ``lr_scale``, ``temperature``,
        ``effective_step``, ``update_id``]) as the next generation. Returns (the journal event, False), or for
        an update id applied before (the acknowledgment it got: update_id, generation, effective_step; True)
        without changing anything. ValueError naming what is wrong otherwise (nothing changes)."""
        uid = meta.get("update_id")
        if uid is not None:
            check_update_id(uid)
            if uid in self.acked:
                return dict(self.acked[uid]), True
        step = meta.get("effective_step")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise ValueError(f"effective_step must be an integer, got {step!r:.40}")
        if step is not None and step < 0:
            raise ValueError(f"effective_step must be >= 0, got {step}")
        generation = self.generation + 1
        if "mixture" in meta:
            extra = sorted({"weights", "lr_scale", "temperature"} & set(meta))
            if extra:
                raise ValueError(f"an update carries the whole `mixture` or `weights`, not both (also got {', '.join(extra)})")
            try:
                return self.adopt_mixture(meta["mixture"], step, generation, update_id=uid), False
            except SpecError as e:
                raise ValueError("; ".join(str(p) for p in e.problems)) from None
        weights = meta.get("weights")
        if not isinstance(weights, dict):
            raise ValueError("an update carries `mixture` (the spec's whole mixture section) or `weights` (by source)")
        parsed = {str(k): _number(f"weights.{k}", v) for k, v in weights.items()}
        extras = [None if meta.get(name) is None else _number(name, meta[name]) for name in ("lr_scale", "temperature")]
        return self.update_mixture(parsed, self.next_step if step is None else step, generation, extras[0], extras[1],
                                   update_id=uid), False

    def apply_event(self, event: dict[str, Any]) -> dict[str, Any]:
        """Apply a journaled update event again (replay, recovery) where it was applied first: same generation,
        effective step and result; returns the event as journaled now."""
        return self._reapply(event)

    def _reapply(self, event: dict[str, Any], *, rewind: bool = False) -> dict[str, Any]:
        uid = event.get("update_id")
        step, gen = int(event["effective_step"]), int(event["generation"])
        if "mixture" in event:
            try:
                return self.adopt_mixture(event["mixture"], step, gen, update_id=uid)
            except SpecError as e:
                raise ValueError("; ".join(str(p) for p in e.problems)) from None
        weights, lr, temp = event["weights"], event.get("lr_scale"), event.get("temperature")
        if event.get("segment") is not None and rewind:
            # a rewind: the segment as it was made (the full weights), not the weights relative to another schedule
            seg = Segment.from_json(event["segment"])
            weights, lr, temp = dict(zip(self.spec.source_names(), seg.weights)), seg.lr_scale, seg.temperature
        return self.update_mixture({str(k): float(v) for k, v in weights.items()}, step, gen, lr, temp, update_id=uid)

    def _applied(self, event: dict[str, Any], update_id: str | None) -> dict[str, Any]:
        gen = int(event["generation"])
        if update_id is not None:
            event["update_id"] = update_id
            self.acked.pop(update_id, None)
            self.acked[update_id] = {"update_id": update_id, "generation": gen, "effective_step": int(event["effective_step"])}
            while len(self.acked) > UPDATES_KEPT:
                del self.acked[next(iter(self.acked))]
        self.update_log.pop(gen, None)
        self.update_log[gen] = event
        while len(self.update_log) > UPDATES_KEPT:
            del self.update_log[next(iter(self.update_log))]
        return event

    def remember_updates(self, events: list[dict[str, Any]]) -> None:
        """Updates a predecessor applied (journal records, oldest first): their ids stay acknowledged and a
        later rewind keeps the ones newer than its cursor; nothing is applied here (see apply_event)."""
        for ev in events:
            gen, uid = int(ev["generation"]), ev.get("update_id")
            self.update_log.pop(gen, None)
            self.update_log[gen] = dict(ev)
            if isinstance(uid, str):
                self.acked.pop(uid, None)
                self.acked[uid] = {"update_id": uid, "generation": gen, "effective_step": int(ev["effective_step"])}
        while len(self.update_log) > UPDATES_KEPT:
            del self.update_log[next(iter(self.update_log))]
        while len(self.acked) > UPDATES_KEPT:
            del self.acked[next(iter(self.acked))]

    def recent_updates(self, n: int = 32) -> list[dict[str, Any]]:
        """The last `n` acknowledged update ids: {update_id, generation, effective_step}, oldest first."""
        return [dict(a) for a in list(self.acked.values())[-n:]]

    def reconfigure(self, spec: DataMixtureSpec, generation: int) -> None:
        """Adopt a new spec generation's topology / batch / strategy options from next_step on (elastic
        resharding); the windows, sampler and schedule carry over. Sources and replicas must not change."""
        if [(s.name, s.replicas) for s in spec.sources] != [(s.name, s.replicas) for s in self.spec.sources]:
            raise ValueError("reconfigure cannot change sources or loader replicas; start a new planner")
        self.spec = spec
        self.tree = ClientPlaceTree.from_spec(spec)
        self.dp = self.tree.backbone.dp
        self.generation = max(self.generation, generation)

    # -- re-partitioning (mixplane.repartition) ----------------------------------------------
    def partitions(self, source: int) -> int:
        """The partitions (loader replicas, windows) source `source` has now."""
        recs = self.partitioning.get(source)
        return int(recs[-1]["partitions"]) if recs else int(self._spec_replicas[source])

    def _counts(self, partitioning: dict[int, list[dict[str, Any]]]) -> list[int]:
        return [int(partitioning[si][-1]["partitions"]) if partitioning.get(si) else int(n)
                for si, n in enumerate(self._spec_replicas)]

    def _partitioning_json(self) -> dict[str, list[dict[str, Any]]] | None:
        return {str(si): list(recs) for si, recs in sorted(self.partitioning.items())} if self.partitioning else None

    def repartition(self, source: int, partitions: int) -> dict[str, Any]:
        """Re-partition source `source` into `partitions` from `next_step` on: the record (journaled; what the
        loaders and replay build the new partitions' layouts from) of the old windows' cursors. Samples a window
        holds but the steps so far did not consume are read again by the new partitions; a sample partly
        delivered counts as read (the rest of it is not delivered). RepartitionError naming the field."""
        names = [s.name for s in self.spec.sources]
        if not 0 <= int(source) < self.n_sources:
            raise RepartitionError(f"source: no source {source} (the mixture has {self.n_sources})")
        src = self.spec.sources[source]
        if src.live:
            raise RepartitionError(f"source {src.name!r}: a live source is read by one partition; it cannot be "
                                   "re-partitioned")
        if self._caps[source] is not None:
            # the remainders of the old partitions are read one after another: a partition past its last pass
            # would come before another's rows still in it, and the pass cap decides from stream order
            raise RepartitionError(f"source {src.name!r}: a source with a limit on its passes (max_epochs, "
                                   "oversample: false) cannot be re-partitioned")
        old = self.partitions(source)
        self.store.sync(drop=False)
        cursors = []
        for r in range(old):
            c = self.window(source, r).cursor()
            consumed = {int(p) for p in c["skip"]} | {int(p) for p in c["partial"]}
            cursors.append([int(c["low"]), sorted(p for p in consumed if p >= int(c["low"]))])
        record = {"source": int(source), "name": src.name, "step": self.next_step, "from": old,
                  "partitions": int(partitions), "cursors": cursors}
        record = parse_record(record, old, names)  # range checks (partitions in [1, MAX], not the same count)
        self.apply_repartition(record)
        return record

    def apply_repartition(self, record: dict[str, Any]) -> None:
        """Apply a re-partition record (a journaled one in replay and recovery) at `next_step`."""
        si = int(record["source"])
        rec = parse_record(record, self.partitions(si) if 0 <= si < self.n_sources else 0,
                           [s.name for s in self.spec.sources])
        if int(rec["step"]) != self.next_step:
            raise RepartitionError(f"source {rec['name']!r}: re-partition recorded at step {rec['step']}, the planner "
                                   f"is at step {self.next_step}")
        self.partitioning = {**self.partitioning, si: [*self.partitioning.get(si, []), rec]}
        self._rebuild_windows({si})

    def _rebuild_windows(self, fresh: set[int]) -> None:
        """Windows for the partition counts now: new (empty, cursor 0) for the sources in `fresh`, the others kept
        with what they hold."""
        self.store.sync()
        kept: list[ReplicaWindow] = []
        ws: list[ReplicaWindow] = []
        for si in range(self.n_sources):
            lo, tokens, hi = self.spec.window_bounds(si)
            for r in range(self.partitions(si)):
                w = self._by_id.get((si, r))
                if si in fresh or w is None:
                    w = ReplicaWindow(si, r, lo, tokens, hi)
                else:
                    kept.append(w)
                ws.append(w)
        for w in kept:  # their arrays become their own (the old store's block is not written again)
            w.pos = w.pos.copy()
        self.windows = ws
        self._by_id = {(w.source, w.replica): w for w in ws}
        self.store = WindowStore(ws)
        self._taken = None
        self._replicated = any(n > 1 for n in self._counts(self.partitioning))

    # -- cursor -------------------------------------------------------------------------
    def cursor(self) -> dict[str, Any]:
        return self.cursor_later().build()

    def cursor_later(self) -> PlannerCursor:
        """The cursor as of now, built when read (StepPlan.cursor_before)."""
        self.store.sync(drop=False)  # right after a step: no copy (the next step's gather drops the consumed)
        return PlannerCursor(self.next_step, self.sampler.state_dict(), self.schedule.state_dict(), self.store.cursors(),
                             self._partitioning_json(),
                             {str(si): p.text() for si, p in sorted(self.listings.items())} if self.listings else None)

    def restore(self, cur: dict[str, Any], *, keep_updates: bool = False) -> list[dict[str, Any]]:
        """Rewind to a cursor. Everything is validated before anything changes (ValueError otherwise).

        keep_updates: runtime mixture updates that are newer than the cursor and take effect at or after
        its step stay in force (a rewind of the data must not undo an operator's change of the mixture);
        they are returned as journal events."""
        try:
            step = int(cur["step"])
            by_id = {(int(c["source"]), int(c["replica"])): c for c in cur["windows"]}
            sampler_state, schedule_state = cur["sampler"], cur["schedule"]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"cursor is malformed ({e})") from None
        if step < 0:
            raise ValueError(f"cursor step {step} is negative")
        try:
            partitioning = parse_partitioning(cur.get("partitioning"), self._spec_replicas,
                                              [s.name for s in self.spec.sources])
        except RepartitionError as e:
            raise ValueError(f"cursor: {e}") from None
        listings = parse_listing_pins(cur.get("listings"), self.n_sources)  # ValueError naming it
        counts = self._counts(partitioning)
        if set(by_id) != {(si, r) for si, n in enumerate(counts) for r in range(n)}:
            raise ValueError("cursor was made for a different set of sources / loader replicas")
        for key in by_id:
            ReplicaWindow.parse_cursor(by_id[key])
        sampler = DeficitSampler(self.n_sources)
        schedule = MixtureSchedule(self.spec)
        try:
            sampler.load_state_dict(sampler_state)
            schedule.load_state_dict(schedule_state)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"cursor's mixture state is malformed ({e})") from None
        kept: list[dict[str, Any]] = []
        if keep_updates:  # applied again, in the order they were applied, on the cursor's schedule
            gen = max(seg.generation for seg in schedule.segments)
            newer = [ev for g, ev in sorted(self.update_log.items()) if g > gen and int(ev["effective_step"]) >= step]
            live, self.schedule, next_step = self.schedule, schedule, self.next_step
            try:
                self.next_step = step
                for ev in newer:
                    kept.append(self._reapply(ev, rewind=True))
            except (KeyError, TypeError, ValueError) as e:
                self.schedule = live
                raise ValueError(f"a runtime update newer than the cursor cannot be kept ({e})") from None
            finally:
                self.next_step = next_step
        # all valid: commit
        self.next_step = step
        self.sampler = sampler
        self.schedule = schedule
        if listings:  # a cursor without them (an older one) keeps the run's pins
            self.listings = {**self.listings, **listings}
        if partitioning != self.partitioning:  # a cursor from before (or after) a re-partition: its windows
            self.partitioning = partitioning
            self._rebuild_windows(set(range(self.n_sources)))
        for w in self.windows:
            w.restore(by_id[(w.source, w.replica)])
        return kept

    # -- planning -----------------------------------------------------------------------
    def _snapshot(self) -> tuple[dict[str, Any], np.ndarray]:
        self.store.sync()
        return self.sampler.state_dict(), self.store.cols["done"].copy()

    def _rollback(self, snap: tuple[dict[str, Any], np.ndarray]) -> None:
        self.sampler.load_state_dict(snap[0])
        self.store.sync()
        done = self.store.cols["done"]
        if len(done) != len(snap[1]):
            raise RuntimeError("the windows took new samples since the snapshot; it cannot be restored")
        done[:] = snap[1]  # in place: the windows' arrays are views of it

    def candidates(self, exclude: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every window sample as (window index, entry index) grouped by source, each source's in
        (stream position, replica) order, and the per-source offsets into them ([n_sources + 1]).
        `exclude`: (source, key) pairs left out."""
        ws = [w for w in self.windows if len(w)]
        n = self.n_sources
        if not ws:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(n + 1, np.int64)
        lens = np.array([len(w) for w in ws], np.int64)
        wi = np.repeat(np.array([i for i, w in enumerate(self.windows) if len(w)], np.int64), lens)
        first = np.repeat(np.cumsum(lens) - lens, lens)
        ei = np.arange(len(wi), dtype=np.int64) - first
        src = np.repeat(np.array([w.source for w in ws], np.int64), lens)
        rep = np.repeat(np.array([w.replica for w in ws], np.int64), lens)
        o = None
        if self._replicated:
            pos = np.concatenate([w.pos for w in ws])
            o = np.lexsort((rep, pos, src))
            wi, ei, src = wi[o], ei[o], src[o]
        # else: windows are listed by source and each holds its stream in order: already sorted
        if exclude:
            excl = {(int(a), int(b)) for a, b in exclude}
            key = np.concatenate([w.key for w in ws])
            if o is not None:
                key = key[o]
            keep = np.array([(s, k) not in excl for s, k in zip(src.tolist(), key.tolist())], dtype=bool)
            wi, ei, src = wi[keep], ei[keep], src[keep]
        offsets = np.searchsorted(src, np.arange(n + 1)).astype(np.int64)
        return wi, ei, offsets

    def _eligible(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(allowed, final) for the store's samples as gathered now: `allowed` marks the samples within their
        source's passes (None: all are), `final[i]` says every window of source i reaches past them (none of
        its rows to come is allowed: when it has delivered these it ends). The rule for passes: spec.epoch_caps."""
        if all(c is None for c in self._caps):
            return None, None
        st = self.store
        cap = np.array([np.iinfo(np.int64).max if c is None else c for c in self._caps], np.int64)
        allowed = sample_pass(st.cols["key"]) < cap[st.source[st.win]]
        if allowed.all():
            return None, None
        beyond = np.bincount(st.win[~allowed], minlength=len(st.windows)) > 0  # windows that reach past the end
        per_source = np.bincount(st.source, minlength=self.n_sources)
        final = np.bincount(st.source, weights=beyond, minlength=self.n_sources).astype(np.int64) == per_source
        return allowed, final

    def _ends_at_start(self, step: int, probs: np.ndarray) -> list[int]:
        """Sources that take part in `step` (a share weight or rows) but have nothing left in their passes: they end
        before it (their last row went in an earlier step, before the window showed the end)."""
        self.store.sync()
        allowed, final = self._eligible()
        if allowed is None or final is None:
            return []
        st = self.store
        left = np.bincount(st.source[st.win[allowed]], minlength=self.n_sources)
        take = (probs > 0) | ((self._quota > 0) & self.schedule.live_mask(step))
        return [i for i in range(self.n_sources) if take[i] and final[i] and left[i] == 0]

    def select(self, step: int, point: MixturePoint, exclude: Any = None) -> Pieces:
        """Mix and pack: choose token spans by deficit and place them best-fit into the step's rows.

        The source picked next is the mixing sampler's (`DeficitSampler.pick` with sizes and
        fallback=False, run incrementally by `EDFQueue`): the released source furthest behind its
        share; its oldest window sample that still fits somewhere is placed. When no source is
        released the step ends. `exclude`: (source, key) pairs that must not be picked this step.
        The pick-and-place loop is compiled (`selectloop`); this method gathers the candidates and
        writes the consumption back into the windows.
        """
        spec = self.spec
        S = spec.batch.seq_len
        R = spec.rows_per_step
        self.sampler.enter(point)
        st = self.store
        st.sync()
        cols = st.cols
        all_tok, all_done = cols["tokens"], cols["done"]
        flat: np.ndarray | None = None
        elig, final = self._eligible()
        ends = None
        if not self._replicated and not exclude:
            # one window per source, listed by source, each in stream order: the columns are the candidates,
            # and the loop writes the consumption straight into them (the windows' views)
            c_tok, c_done, off = all_tok, all_done, st.base
            if elig is not None:  # a capped window's allowed samples are a prefix of it (epochs only grow)
                ends = off[:-1] + np.bincount(st.win[elig], minlength=len(off) - 1).astype(np.int64)
                if not np.array_equal(elig, np.arange(len(elig)) < ends[st.win]):  # (they are: a guard)
                    raise RuntimeError(f"step {step}: a window holds a sample of an allowed pass after one past its "
                                       "source's last pass")
        else:
            cwi, cei, off = self.candidates(exclude)
            flat = st.base[cwi] + cei  # index into the columns
            if elig is not None:
                flat = flat[elig[flat]]
                off = np.searchsorted(st.source[st.win[flat]], np.arange(self.n_sources + 1)).astype(np.int64)
            if exclude:  # a re-mix leaving samples out: a source cannot end in it (it ends at its next step)
                final = np.zeros(self.n_sources, bool)
            c_tok, c_done = all_tok[flat], all_done[flat]
        # scale of "one sample": 1, or (tokens) the largest piece among the segment's candidates so far
        if self.unit_samples:
            L = 1.0
        else:
            L = max(self.sampler.unit_max, float(min(S, selectloop.spans(all_tok, all_done, S)[0])) if len(all_tok) else 1.0)
            self.sampler.unit_max = L
        delta = slack(int((np.asarray(point.probs) > 0).sum())) * L  # as EDFQueue / DeficitSampler.pick
        realized = self.sampler.realized.astype(np.float64, copy=True)
        live = self.schedule.live_mask(step)
        quota = np.where(live, self._quota, 0)
        outcome: dict[str, np.ndarray] = {}
        o_cand, o_bin, o_start, o_len = selectloop.run(
            c_tok, c_done, off, point.probs, realized, L, delta, delta + 1e-9 * L, unit_samples=self.unit_samples,
            truncate=spec.batch.overlong == "truncate", seq_len=S, rows=R, policy=spec.batch.packing,
            ends=ends, final=final, quota=quota if quota.any() else None, outcome=outcome)
        ended = np.flatnonzero(outcome["ended"]).tolist()
        short = [(i, int(outcome["short"][i])) for i in np.flatnonzero(quota).tolist()
                 if outcome["short"][i] > 0 and i not in ended]
        if short:
            i, k = short[0]
            name = spec.sources[i].name
            raise RowsShortError(f"step {step}: source {name!r} is weighted by {int(quota[i])} rows per step "
                                 f"(mixture.rows.{name}) but only {int(quota[i]) - k} of its documents began: the "
                                 "others do not fit into the step's rows beside what came first")
        self.sampler.realized[:] = realized
        self._ended_now = ended
        if any(point.probs[i] > 0 for i in ended):  # the loop reset the counters where the first one ended
            self.sampler.segment_start = step
        if flat is None:
            at = o_cand
        else:
            at = flat[o_cand]
            all_done[at] = c_done[o_cand]  # a piece's last write is its sample's final state
        w_at = st.win[at]
        src = st.source[w_at].astype(np.int16)
        patches = np.where(o_start == 0, cols["patches"][at], 0).astype(np.int64)
        pieces = Pieces(o_bin, src, cols["key"][at], o_start, o_len, patches, st.replica[w_at], cols["pos"][at])
        self._taken = (pieces, at)
        return pieces

    def _point_for(self, schedule: Any, step: int, default: MixturePoint) -> MixturePoint:
        if schedule is None:
            return default
        if hasattr(schedule, "at"):
            pt = schedule.at(step)
            if not self.schedule.ended:
                return pt
            # another schedule (a strategy's) knows nothing of the sources that ended: none of them is drawn from
            probs = np.asarray(pt.probs, np.float64)
            live = self.schedule.live_mask(step)
            ends = [e for i, n in enumerate(self.schedule.names)
                    if (e := self.schedule.ended.get(n)) is not None and e <= step and probs[i] > 0]
            if not ends:
                return pt
            kept = np.where(live, probs, 0.0)
            if kept.sum() <= 0:
                raise SourcesExhausted(f"step {step}: every source the strategy's schedule weighs has ended")
            return MixturePoint(kept / kept.sum(), pt.phase, pt.lr_scale, pt.generation, max(pt.segment_start, *ends))
        if isinstance(schedule, dict):  # weights by source name for this step only
            names = self.spec.source_names()
            unknown = sorted(set(schedule) - set(names))
            if unknown:
                raise ValueError(f"step {step}: mix weights name unknown source(s) {', '.join(unknown)}")
            w = np.array([float(schedule.get(nm, 0.0)) for nm in names])
            w = np.where(self.schedule.live_mask(step) & (self._quota == 0), w, 0.0)  # no ended nor rows source
            seg = self.schedule.segment_at(step)
            probs = apply_temperature(w, self.schedule.temperature if seg.temperature is None else seg.temperature)
            return MixturePoint(probs, default.phase, default.lr_scale, default.generation, default.segment_start)
        raise TypeError(f"step {step}: mix() takes a MixtureSchedule, an object with .at(step), or a weights dict")

    def plan(self) -> StepPlan:
        """Plan `next_step`; all windows must be ready."""
        if not self.ready:
            waiting = ", ".join(f"{self.spec.sources[w.source].name}/{w.replica}" for w in self.waiting_for())
            raise RuntimeError(f"step {self.next_step}: windows not full yet ({waiting})")
        cursor = self.cursor_later()
        step = self.next_step
        ended_before = self.schedule.ended
        point = self.schedule.at(step)
        at_start = self._ends_at_start(step, point.probs)
        if at_start:
            for i in at_start:
                self.schedule.end_source(self.spec.sources[i].name, step)
            try:
                point = self.schedule.at(step)
            except SourcesExhausted:
                self.schedule.ended = ended_before
                raise
        snap = self._snapshot()
        state = {"mixed": False}

        def mixer(schedule: Any, exclude: Any) -> tuple[Pieces, MixturePoint]:
            if state["mixed"]:
                self._rollback(snap)
            pt = self._point_for(schedule, step, point)
            pieces = self.select(step, pt, exclude)
            state["mixed"] = True
            return pieces, pt

        spec = self.spec
        ctx = PlanContext(spec, step, point, None, spec.rows_per_step, spec.batch.seq_len, self.dp,
                          spec.batch.microbatches, spec.rows_per_microbatch, dict(spec.strategy.options),
                          tree=self.tree, mixer=mixer, buffer=self.summary_buffer)
        try:
            layout = self.strategy(ctx)
            pieces = ctx.pieces
            if not isinstance(layout, StepLayout):
                raise TypeError(f"step {step}: the strategy returned {type(layout).__name__}, not a StepLayout")
            layoutloop.validate(layout)  # StepLayout.validate, compiled
            piece_of_seg = check_coverage(layout, pieces, ctx.built)
        except BaseException:  # re-raised: a plan that failed (or was interrupted) leaves the planner as it was
            self._rollback(snap)
            self.schedule.ended = ended_before
            raise
        seg_of_img = None
        if ctx.built is not None and piece_of_seg is ctx.built[1] and len(layout.img_key):
            seg_of_piece = np.empty(len(piece_of_seg), np.int64)  # the builder's pairing, inverted
            seg_of_piece[piece_of_seg] = np.arange(len(piece_of_seg), dtype=np.int64)
            seg_of_img = seg_of_piece[ctx.built[2]]
        taken, self._taken = self._taken, None
        full = self.store.compact()
        # a piece retires its sample iff the sample left its window now (select's own pieces: no search)
        retired = full[taken[1]].astype(np.uint8) if taken is not None and taken[0] is pieces else self.retired(pieces)
        self.next_step += 1
        tok = np.bincount(pieces.source.astype(np.int64), weights=pieces.length, minlength=self.n_sources)
        first = pieces.start == 0
        smp = np.bincount(pieces.source[first].astype(np.int64), minlength=self.n_sources)
        names = [self.spec.sources[i].name for i in [*at_start, *self._ended_now]]
        for i in self._ended_now:
            self.schedule.end_source(self.spec.sources[i].name, step)
        self._ended_now = []
        return StepPlan(layout, pieces, cursor, tok, smp, tuple(ctx.broadcast), ctx.stats, piece_of_seg, retired, seg_of_img,
                        ended=tuple(names))

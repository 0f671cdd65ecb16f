"""Mixture semantics: which weights hold at a step, and a deterministic sampler that realises them.

Weights follow KempnerForge's mixing docs: base weights, temperature (p_i ∝ w_i^(1/T)), phases with
`start_step` / `lr_scale` and the `anneal` shortcut (one final phase). In a phase and in the anneal
a source not named falls back to its base weight; a source is dropped only by an explicit 0.
Unlike KempnerForge, changes take effect at their step, not at an epoch boundary. A live update of
the whole mixture (a new spec generation: `mixture_update_meta` builds the UPDATE_MIXTURE request,
`MixtureSchedule.rebase` adopts it) makes the schedule from its effective step on that of the new
spec — temperature, phases, anneal as written. A weights-only runtime update (`update`) is a segment
of the same schedule that lasts until the next scheduled boundary: later spec phases (and the anneal)
still start at their steps, with their weights as written, so resume lands in the right phase.
Batches carry the phase index; an update is identified by its generation.

The sampler is stratified, not random (see DeficitSampler): it schedules sources earliest-
deadline-first against their target shares of what has been placed in the current segment.

Guarantee (tested in tests/unit/test_mixing_exact.py). Within a segment let T be the units placed
so far (samples, or tokens when `unit: tokens`), r_i what source i contributed and p_i its target
share. Whenever every source with p_i > 0 has a candidate that fits, after every pick and hence at
every step boundary

    | r_i - p_i * T | < L        (L = 1 sample; for tokens, the largest sample piece seen)

so the realised mix never drifts: every prefix of a segment is within one sample of its target,
per source. (The simpler "largest deficit first" rule is not enough: it can fall 1.08 samples
behind with a few sources, 1.4 in tokens.) A new segment (phase, anneal, runtime update) starts
its own accounting at its start step.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mixplane.errors import MixplaneError
from mixplane.spec import (AnnealSpec, DataMixtureSpec, MixtureSpec, PhaseSpec, Problem, SpecError,
                           effective_base_weights, parse_spec)


class SourcesExhausted(MixplaneError, ValueError):
    """No source with a share weight is left: every one has ended (max_epochs, oversample: false)."""


def apply_temperature(weights: np.ndarray, temperature: float) -> np.ndarray:
    """Normalised probabilities; T > 1 flattens (in log space, as KempnerForge does)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.sum() <= 0:
        raise ValueError("weights must have a positive sum")
    if temperature == 1.0:
        return w / w.sum()
    out = np.zeros_like(w)
    pos = w > 0
    logw = np.log(w[pos]) / temperature
    scaled = np.exp(logw - logw.max())
    out[pos] = scaled / scaled.sum()
    return out


@dataclass(frozen=True)
class Segment:
    """A stretch of steps with fixed weights: a spec phase or a runtime update."""

    start_step: int
    weights: tuple[float, ...]  # raw weights by source index (before temperature)
    lr_scale: float
    phase: int  # id delivered with each batch
    generation: int  # spec generation that introduced this segment
    name: str = ""
    temperature: float | None = None  # None: the schedule's temperature

    def to_json(self) -> dict[str, Any]:
        d = {"start_step": self.start_step, "weights": list(self.weights), "lr_scale": self.lr_scale,
             "phase": self.phase, "generation": self.generation, "name": self.name}
        if self.temperature is not None:
            d["temperature"] = self.temperature
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Segment":
        t = d.get("temperature")
        return cls(int(d["start_step"]), tuple(float(x) for x in d["weights"]), float(d["lr_scale"]),
                   int(d["phase"]), int(d["generation"]), str(d.get("name", "")), None if t is None else float(t))


@dataclass(frozen=True)
class MixturePoint:
    """What holds at one step."""

    probs: np.ndarray
    phase: int
    lr_scale: float
    generation: int
    segment_start: int


def phase_weights(names: list[str], base: dict[str, float], named: dict[str, float]) -> tuple[float, ...]:
    """A phase's (or the anneal's) raw weights: named sources as given, the rest at their base weight
    (KempnerForge: "falls back to its original weight"; zeroing a source takes an explicit 0)."""
    return tuple(float(named.get(n, base[n])) for n in names)


def insert_segment(segments: list[Segment], seg: Segment) -> list[Segment]:
    """`segments` with `seg` in force from its start step until the next later segment (one starting
    at the same step is replaced); later segments are kept, so scheduled phases survive updates."""
    before = [s for s in segments if s.start_step < seg.start_step]
    after = [s for s in segments if s.start_step > seg.start_step]
    return before + [seg] + after


class MixtureSchedule:
    """Step -> mixture; built from the spec, extended by runtime updates."""

    def __init__(self, spec: DataMixtureSpec, generation: int = 0):
        self.names = spec.source_names()
        self.temperature = spec.mixture.temperature
        base = effective_base_weights(spec)
        self.base = tuple(base[n] for n in self.names)
        segs = [Segment(0, self.base, 1.0, 0, generation, "base")]
        m = spec.mixture
        phases: list[PhaseSpec | AnnealSpec] = list(m.phases)
        if m.anneal is not None:
            phases = [m.anneal]
        for i, ph in enumerate(phases):
            w = phase_weights(self.names, base, ph.weights)
            name = "anneal" if m.anneal is not None else f"phase{i + 1}"
            if ph.start_step == 0:
                segs[0] = Segment(0, w, ph.lr_scale, 0, generation, name)
            else:
                segs.append(Segment(ph.start_step, w, ph.lr_scale, len(segs), generation, name))
        self.segments: list[Segment] = segs
        # sources that reached their end (max_epochs, oversample: false): name -> the step they ended in. From
        # that step on they have no weight and the others share theirs (`at`); the planner records them
        # (`end_source`) and the cursor carries them (state_dict), so resume and replay end them alike.
        self.ended: dict[str, int] = {}

    def end_source(self, name: str, step: int) -> None:
        """Source `name` delivered its last row in step `step` (or had none left at its start)."""
        if name not in self.names:
            raise ValueError(f"unknown source {name!r}")
        self.ended = {**self.ended, name: int(step)}

    def live_mask(self, step: int) -> np.ndarray:
        """True for every source that has not ended by `step`."""
        return np.array([not (n in self.ended and self.ended[n] <= step) for n in self.names], bool)

    def segment_at(self, step: int) -> Segment:
        cur = self.segments[0]
        for s in self.segments:
            if s.start_step <= step:
                cur = s
            else:
                break
        return cur

    def at(self, step: int) -> MixturePoint:
        """The mixture at `step`: the segment's weights without the sources ended by then (renormalised over the
        rest); its accounting starts at the segment's start or at the latest end of a source, whichever is later
        (an end resets the sampler's counters, as a new segment does). ValueError when no weight is left."""
        s = self.segment_at(step)
        t = self.temperature if s.temperature is None else s.temperature
        w = np.array(s.weights)
        start = s.start_step
        if self.ended:
            live = self.live_mask(step)
            # an end resets the counters of the segment it happened in (a source without weight there never ends)
            ends = [e for i, (n, e) in enumerate((n, self.ended.get(n)) for n in self.names)
                    if e is not None and s.start_step <= e <= step and s.weights[i] > 0]
            start = max([start, *ends])
            w = np.where(live, w, 0.0)
            if w.sum() <= 0:
                gone = ", ".join(f"{n} (step {e})" for n, e in sorted(self.ended.items(), key=lambda x: x[1]))
                raise SourcesExhausted(f"step {step}: every source with a share weight has ended: {gone}")
        return MixturePoint(apply_temperature(w, t), s.phase, s.lr_scale, s.generation, start)

    def update(self, weights: dict[str, float], effective_step: int, generation: int,
               lr_scale: float | None = None, *, planned_through: int = -1,
               temperature: float | None = None) -> Segment:
        """A runtime change from `effective_step` until the next scheduled boundary.

        Sources not named keep the weight in force at effective_step. Later segments (spec phases, the
        anneal, other updates) still start at their steps with their own weights: an operator's live
        tweak must not erase the curriculum. The segment keeps the spec phase id in force (batches
        report the spec's phase); its generation identifies the update. Steps already planned cannot
        change, so effective_step must lie after `planned_through`.
        """
        if effective_step <= planned_through:
            raise ValueError(f"effective_step {effective_step} is already planned (planned through step {planned_through})")
        unknown = sorted(set(weights) - set(self.names))
        if unknown:
            raise ValueError(f"unknown source(s) {', '.join(unknown)}")
        if any(not (w >= 0) or math.isinf(w) for w in weights.values()):
            raise ValueError("weights must be finite and >= 0")
        if lr_scale is not None and not (float(lr_scale) > 0 and math.isfinite(float(lr_scale))):
            raise ValueError(f"lr_scale must be > 0, got {lr_scale}")
        if temperature is not None and not (float(temperature) > 0 and math.isfinite(float(temperature))):
            raise ValueError(f"temperature must be > 0, got {temperature}")
        cur = self.segment_at(effective_step)
        w = tuple(float(weights.get(n, cur.weights[i])) for i, n in enumerate(self.names))
        if sum(w) <= 0:
            raise ValueError("weights must have a positive sum")
        seg = Segment(effective_step, w, cur.lr_scale if lr_scale is None else float(lr_scale),
                      cur.phase, generation, f"update{generation}",
                      cur.temperature if temperature is None else float(temperature))
        self.segments = insert_segment(self.segments, seg)
        return seg

    def rebase(self, spec: DataMixtureSpec, effective_step: int, generation: int, *,
               planned_through: int = -1) -> list[Segment]:
        """Adopt a new spec generation's mixture (weights, temperature, phases, anneal) from effective_step
        on; what held before stays. The new spec's phases that start later keep their own start steps."""
        if effective_step <= planned_through:
            raise ValueError(f"effective_step {effective_step} is already planned (planned through step {planned_through})")
        if spec.source_names() != self.names:
            raise ValueError("a new generation cannot add, remove or reorder sources")
        new = MixtureSchedule(spec, generation)
        first_phase = max(s.phase for s in self.segments) + 1
        head = [s for s in self.segments if s.start_step < effective_step]
        at = new.segment_at(effective_step)
        tail = [at] + [s for s in new.segments if s.start_step > effective_step]
        out = []
        for i, s in enumerate(tail):
            out.append(Segment(effective_step if i == 0 else s.start_step, s.weights, s.lr_scale, first_phase + i,
                               generation, f"gen{generation}:{s.name}", new.temperature))
        self.segments = head + out
        return out

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"segments": [s.to_json() for s in self.segments], "temperature": self.temperature}
        if self.ended:
            out["ended"] = dict(self.ended)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        segments = [Segment.from_json(d) for d in state["segments"]]
        if not segments or any(len(x.weights) != len(self.names) for x in segments):
            raise ValueError(f"schedule state does not have weights for the {len(self.names)} sources")
        ended = state.get("ended") or {}
        if not isinstance(ended, dict) or any(n not in self.names or isinstance(e, bool) or not isinstance(e, int)
                                              or e < 0 for n, e in ended.items()):
            raise ValueError(f"schedule state: `ended` must map source names to steps, got {ended!r:.80}")
        self.segments = segments
        self.ended = {str(n): int(e) for n, e in ended.items()}
        if "temperature" in state:
            self.temperature = float(state["temperature"])


# ---- live updates: the UPDATE_MIXTURE message of a whole mixture -------------------------------
MAX_UPDATE_ID = 256  # characters of an update id


def check_update_id(update_id: Any) -> str:
    """An update id: a non-empty string of at most MAX_UPDATE_ID printable characters (ValueError otherwise)."""
    if not isinstance(update_id, str) or not update_id or len(update_id) > MAX_UPDATE_ID or not update_id.isprintable():
        raise ValueError(f"update_id must be a non-empty printable string of at most {MAX_UPDATE_ID} characters, "
                         f"got {update_id!r:.80}")
    return update_id


def mixture_update_meta(spec_or_mixture: DataMixtureSpec | MixtureSpec | Mapping[str, Any], update_id: str,
                        effective_step: int | None = None) -> dict[str, Any]:
    """The UPDATE_MIXTURE request that makes a running planner adopt a whole mixture section (weights,
    temperature, phases, anneal with their lr_scale) from a step on, as a new generation; one builder for
    `mixplane update --mixture` and the operator (a `kubectl patch` of spec.mixture).

    ``{"mixture": <the spec's mixture section, model_dump(mode="json")>, "update_id": str[, "effective_step": int]}``.
    Without effective_step the planner takes the first step it has not planned; a step already planned is
    refused (ERROR naming the planned-through step). The planner acknowledges an update id once: the same id
    again is answered with the same generation and effective step and `"duplicate": true`, and changes nothing
    (also after a planner restart). A mapping is checked against the mixture model (pydantic's ValueError);
    the planner validates the rest (sources named, weights, temperature, phases) against its spec."""
    if isinstance(spec_or_mixture, DataMixtureSpec):
        mixture = spec_or_mixture.mixture
    elif isinstance(spec_or_mixture, MixtureSpec):
        mixture = spec_or_mixture
    elif isinstance(spec_or_mixture, Mapping):
        mixture = MixtureSpec.model_validate(dict(spec_or_mixture))
    else:
        raise TypeError(f"expected a DataMixtureSpec, a MixtureSpec or a mapping, got {type(spec_or_mixture).__name__}")
    meta: dict[str, Any] = {"mixture": mixture.model_dump(mode="json"), "update_id": check_update_id(update_id)}
    if effective_step is not None:
        if isinstance(effective_step, bool) or not isinstance(effective_step, int) or effective_step < 0:
            raise ValueError(f"effective_step must be an integer >= 0, got {effective_step!r}")
        meta["effective_step"] = int(effective_step)
    return meta


def spec_with_mixture(spec: DataMixtureSpec, mixture: Any) -> DataMixtureSpec:
    """`spec` with its mixture section replaced by `mixture` (a JSON mapping), validated as a whole spec:
    SpecError with one problem per broken rule, named by field (``mixture.weights.x: unknown source 'x'``).
    A running mixture keeps its sources (no weight may name another), its `seed` and its `unit`."""
    if not isinstance(mixture, Mapping):
        raise SpecError([Problem("mixture", f"expected a mapping, got {type(mixture).__name__}")], "update")
    doc = spec.model_dump(mode="json")
    doc["mixture"] = dict(mixture)
    new = parse_spec(doc, origin="update")
    problems = [Problem(f"mixture.{k}", f"cannot change in a running mixture ({getattr(spec.mixture, k)!r} -> "
                                        f"{getattr(new.mixture, k)!r}); start a new run")
                for k in ("seed", "unit", "rows") if getattr(new.mixture, k) != getattr(spec.mixture, k)]
    if problems:
        raise SpecError(problems, "update")
    return new


def slack(n_active: int) -> float:
    """Tijdeman's bound 1 - 1/(2n - 2) for n competing sources (the chairman assignment problem)."""
    return 1.0 - 1.0 / (2 * n_active - 2) if n_active > 1 else 0.5


@dataclass
class DeficitSampler:
    """Deterministic stratified sampling: earliest-deadline-first over the sources' target windows.

    `realized[i]` counts what source i contributed in the current segment (tokens or samples).
    Source i's next sample of size l is *released* when taking it keeps i at most delta * L ahead
    of its target (r_i + l <= p_i (T + l) + delta L), and its *deadline* is where it would fall
    delta * L behind ((r_i + delta L) / p_i). Among released sources the earliest deadline goes
    first (Tijdeman 1980: with delta = 1 - 1/(2n-2) and unit sizes, |r_i - p_i T| <= delta < 1
    at every T). L is 1 for `unit: samples` and, for tokens, the largest sample piece seen among
    the candidates of the segment so far (`unit_max`), so deviations stay below one sample.
    """

    num_sources: int
    segment_start: int = -1
    realized: np.ndarray = field(default_factory=lambda: np.zeros(0))
    unit_max: float = 0.0

    def __post_init__(self) -> None:
        if len(self.realized) != self.num_sources:
            self.realized = np.zeros(self.num_sources, dtype=np.float64)

    def enter(self, point: MixturePoint) -> None:
        """Reset the accounting when a new segment begins (targets are per segment)."""
        if point.segment_start != self.segment_start:
            self.segment_start = point.segment_start
            self.realized[:] = 0.0
            self.unit_max = 0.0

    def pick(self, probs: np.ndarray, eligible: np.ndarray, unit: float = 1.0, *,
             sizes: np.ndarray | None = None, scale: float | None = None, fallback: bool = True) -> int:
        """Index of the next source, or -1 if none is eligible (the reference rule; the planner's
        select() runs the sizes form incrementally through `EDFQueue`, which a property test checks
        against this method pick for pick).

        sizes given (what each source's next sample adds; the planner knows them): the EDF rule with
        L = scale (default: the largest size seen in the segment). Else unit > 0: samples of `unit`
        each, Tijdeman's rule (within 1 - 1/(2k-2) units). Else (unit == 0, sizes unknown until
        after the pick): the largest deficit (ahead by less than one document).
        fallback=False: -1 when no eligible source is released (the planner then ends the step
        rather than let a source run ahead); True: the largest deficit among the eligible.
        """
        probs = np.asarray(probs, dtype=np.float64)
        mask = np.asarray(eligible, dtype=bool) & (probs > 0)
        if not mask.any():
            return -1
        r = self.realized
        T = float(r.sum())
        if sizes is None and unit <= 0:
            return int(np.argmax(np.where(mask, probs * T - r, -np.inf)))
        if sizes is None:
            l = np.full(probs.shape, float(unit))
            L = float(unit)
        else:
            l = np.broadcast_to(np.asarray(sizes, dtype=np.float64), probs.shape)
            L = float(scale if scale is not None else max(self.unit_max, float(l[mask].max()), 1e-12))
            self.unit_max = max(self.unit_max, L)
        delta = slack(int((probs > 0).sum())) * L
        released = mask & (r + l - probs * (T + l) <= delta + 1e-9 * L)
        if released.any():
            with np.errstate(divide="ignore", over="ignore"):
                inv_p = np.where(probs > 0, 1.0 / np.where(probs > 0, probs, 1.0), 0.0)
                deadline = np.where(released, (r + delta) * inv_p, np.inf)
            return int(np.argmin(deadline))  # ties -> lowest index: deterministic
        if not fallback:
            return -1
        return int(np.argmax(np.where(mask, probs * (T + l) - r, -np.inf)))

    def record(self, source: int, amount: float) -> None:
        self.realized[source] += amount

    def deviation(self, probs: np.ndarray) -> np.ndarray:
        """r_i - p_i * T for the current segment (positive: ahead of target)."""
        return self.realized - np.asarray(probs) * self.realized.sum()

    def state_dict(self) -> dict[str, Any]:
        return {"segment_start": self.segment_start, "realized": self.realized.tolist(), "unit_max": self.unit_max}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        realized = np.asarray(state["realized"], dtype=np.float64)
        if realized.shape != (self.num_sources,) or not np.all(np.isfinite(realized)):
            raise ValueError(f"sampler state has {realized.size} counters for {self.num_sources} sources")
        self.segment_start = int(state["segment_start"])
        self.realized = realized
        self.unit_max = float(state.get("unit_max", 0.0))


class EDFQueue:
    """`DeficitSampler.pick(probs, eligible, sizes=..., scale=L, fallback=False)`, incrementally.

    The planner picks once per placed piece (tens of thousands of times a step) among up to
    thousands of sources; re-evaluating every source per pick is O(sources) each time. Here a
    source's state changes only when it is picked or its next size changes, and the total T only
    grows, so a source that is released stays released until it changes: released sources wait in
    a heap by deadline, the others in a heap by the (approximate) T at which they will be released,
    and the exact release test is the one `pick` evaluates, so the picks are the same, ties included
    (lowest index). `realized` / `total` are the segment's counters, updated by `record`.
    """

    def __init__(self, probs: np.ndarray, realized: np.ndarray, scale: float):
        self.probs = [float(x) for x in probs]
        self.inv_p = [1.0 / x if x > 0 else 0.0 for x in self.probs]
        self.realized = [float(x) for x in realized]
        self.total = float(np.asarray(realized, dtype=np.float64).sum())
        self.scale = float(scale)
        self.delta = slack(sum(1 for x in self.probs if x > 0)) * self.scale
        self.limit = self.delta + 1e-9 * self.scale
        n = len(self.probs)
        self.size = [0.0] * n
        self.version = [0] * n
        self.active = [False] * n
        self.count = 0
        self._ready: list[tuple[float, int, int]] = []  # (deadline, source, version)
        self._wait: list[tuple[float, int, int]] = []  # (approximate release total, source, version)
        self._near: list[int] = []  # popped from _wait, not yet released by the exact test

    def _released(self, i: int) -> bool:
        li = self.size[i]
        return self.realized[i] + li - self.probs[i] * (self.total + li) <= self.limit

    def set(self, i: int, size: float) -> None:
        """Source i is eligible and its next piece adds `size` (its probability must be > 0)."""
        self.version[i] += 1
        if not self.active[i]:
            self.active[i] = True
            self.count += 1
        self.size[i] = size
        v = self.version[i]
        if self._released(i):
            heapq.heappush(self._ready, ((self.realized[i] + self.delta) * self.inv_p[i], i, v))
        else:
            at = (self.realized[i] + size - self.limit) * self.inv_p[i] - size
            heapq.heappush(self._wait, (at, i, v))

    def still_released(self, i: int, size: float) -> bool:
        """Source i (released, unchanged since) gets next size `size`: if it is still released, record the
        size and return True (its queue entry stays valid: the deadline does not depend on the size, so
        pick() would return i again); else False and nothing changes (call `set`)."""
        li = self.size[i]
        self.size[i] = size
        if self._released(i):
            return True
        self.size[i] = li
        return False

    def remove(self, i: int) -> None:
        """Source i has no candidate left this step."""
        if self.active[i]:
            self.active[i] = False
            self.count -= 1
            self.version[i] += 1

    def record(self, i: int, amount: float) -> None:
        self.realized[i] += amount
        self.total += amount

    def pick(self) -> int:
        """The eligible released source with the earliest deadline (lowest index on ties), or -1."""
        T = self.total
        wait, ready, version = self._wait, self._ready, self.version
        if self._near:
            near, self._near = self._near, []
            for i in near:
                if self.active[i] and self._released(i):
                    heapq.heappush(ready, ((self.realized[i] + self.delta) * self.inv_p[i], i, version[i]))
                elif self.active[i]:
                    self._near.append(i)
        if wait:
            # the heap key is approximate; the exact test decides (T >= 0; rounding is far below the margin)
            margin = T + 1e-9 * (T + self.scale + 1.0)
            while wait and wait[0][0] <= margin:
                _, i, v = heapq.heappop(wait)
                if v != version[i]:
                    continue
                if self._released(i):
                    heapq.heappush(ready, ((self.realized[i] + self.delta) * self.inv_p[i], i, v))
                else:
                    self._near.append(i)
        while ready:
            _, i, v = ready[0]
            if v == version[i]:
                return i
            heapq.heappop(ready)
        return -1

"""Mixture semantics: which weights hold at a step, and a deterministic sampler that realises them.

Weights follow KempnerForge: base weights, temperature (p_i ∝ w_i^(1/T)), phases with
`start_step` / `lr_scale` (a source not named in a phase keeps its base weight), and the
`anneal` shortcut (one final phase; sources it does not name drop to 0). Unlike KempnerForge,
changes take effect at their step, not at an epoch boundary, and runtime updates (a new spec
generation) are segments of the same schedule, so resume lands in the right phase.

The sampler is stratified, not random: at each pick it chooses the source that is furthest
behind its target share of what has been placed in the current segment, so realised counts
never drift from the targets by more than one sample (of tokens or of samples).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mixplane.spec import DataMixtureSpec, effective_base_weights


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

    def to_json(self) -> dict[str, Any]:
        return {"start_step": self.start_step, "weights": list(self.weights), "lr_scale": self.lr_scale,
                "phase": self.phase, "generation": self.generation, "name": self.name}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Segment":
        return cls(int(d["start_step"]), tuple(float(x) for x in d["weights"]), float(d["lr_scale"]),
                   int(d["phase"]), int(d["generation"]), str(d.get("name", "")))


@dataclass(frozen=True)
class MixturePoint:
    """What holds at one step."""

    probs: np.ndarray
    phase: int
    lr_scale: float
    generation: int
    segment_start: int


class MixtureSchedule:
    """Step -> mixture; built from the spec, extended by runtime updates."""

    def __init__(self, spec: DataMixtureSpec, generation: int = 0):
        self.names = spec.source_names()
        self.temperature = spec.mixture.temperature
        base = effective_base_weights(spec)
        self.base = tuple(base[n] for n in self.names)
        segs = [Segment(0, self.base, 1.0, 0, generation, "base")]
        m = spec.mixture
        phases = list(m.phases)
        anneal_weights = None
        if m.anneal is not None:
            anneal_weights = {n: float(m.anneal.weights.get(n, 0.0)) for n in self.names}
            phases = [m.anneal]
        for i, ph in enumerate(phases):
            if anneal_weights is not None:
                w = tuple(anneal_weights[n] for n in self.names)
                name = "anneal"
            else:
                w = tuple(float(ph.weights.get(n, base[n])) for n in self.names)
                name = f"phase{i + 1}"
            if ph.start_step == 0:
                segs[0] = Segment(0, w, ph.lr_scale, 0, generation, name)
            else:
                segs.append(Segment(ph.start_step, w, ph.lr_scale, len(segs), generation, name))
        self.segments: list[Segment] = segs

    def segment_at(self, step: int) -> Segment:
        cur = self.segments[0]
        for s in self.segments:
            if s.start_step <= step:
                cur = s
            else:
                break
        return cur

    def at(self, step: int) -> MixturePoint:
        s = self.segment_at(step)
        return MixturePoint(apply_temperature(np.array(s.weights), self.temperature), s.phase, s.lr_scale,
                            s.generation, s.start_step)

    def update(self, weights: dict[str, float], effective_step: int, generation: int,
               lr_scale: float | None = None, *, planned_through: int = -1) -> Segment:
        """A runtime change from `effective_step` on; later segments of the old schedule are replaced.

        Steps already planned cannot change, so effective_step must lie after `planned_through`.
        """
        if effective_step <= planned_through:
            raise ValueError(f"effective_step {effective_step} is already planned (planned through step {planned_through})")
        unknown = sorted(set(weights) - set(self.names))
        if unknown:
            raise ValueError(f"unknown source(s) {', '.join(unknown)}")
        if any(not (w >= 0) or math.isinf(w) for w in weights.values()):
            raise ValueError("weights must be finite and >= 0")
        cur = self.segment_at(effective_step)
        w = tuple(float(weights.get(n, cur.weights[i])) for i, n in enumerate(self.names))
        if sum(w) <= 0:
            raise ValueError("weights must have a positive sum")
        seg = Segment(effective_step, w, cur.lr_scale if lr_scale is None else float(lr_scale),
                      max(s.phase for s in self.segments) + 1, generation, f"update{generation}")
        self.segments = [s for s in self.segments if s.start_step < effective_step] + [seg]
        return seg

    def state_dict(self) -> dict[str, Any]:
        return {"segments": [s.to_json() for s in self.segments]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.segments = [Segment.from_json(d) for d in state["segments"]]


@dataclass
class DeficitSampler:
    """Deterministic stratified sampling: pick the source most behind its target.

    `realized[i]` counts what source i contributed in the current segment (tokens or samples);
    after placing total T, source i's target is p_i * T (see `pick` for the guarantees).
    """

    num_sources: int
    segment_start: int = -1
    realized: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def __post_init__(self) -> None:
        if len(self.realized) != self.num_sources:
            self.realized = np.zeros(self.num_sources, dtype=np.float64)

    def enter(self, point: MixturePoint) -> None:
        """Reset the accounting when a new segment begins (targets are per segment)."""
        if point.segment_start != self.segment_start:
            self.segment_start = point.segment_start
            self.realized[:] = 0.0

    def pick(self, probs: np.ndarray, eligible: np.ndarray, unit: float = 1.0) -> int:
        """Index of the next source, or -1 if none is eligible.

        unit=1 (counting samples): Tijdeman's earliest-deadline rule, which keeps every source
        within 1 - 1/(2k-2) < 1 sample of its target after every pick. unit=0 (counting tokens,
        sizes unknown in advance): the largest deficit, so a source overshoots by less than one
        document and falls behind by less than k-1 documents.
        """
        mask = eligible & (probs > 0)
        if not mask.any():
            return -1
        total = self.realized.sum()
        if unit > 0:
            k = int((probs > 0).sum())
            if k == 1:
                return int(np.argmax(mask))
            c = 1.0 / (2 * k - 2)
            n = total / unit + 1.0
            s = self.realized / unit
            need = probs * n - s
            released = mask & (need >= c - 1e-12)
            cand = released if released.any() else mask
            with np.errstate(divide="ignore", over="ignore"):
                deadline = np.where(cand, (s + 1.0 - c) / np.where(probs > 0, probs, 1.0), np.inf)
            return int(np.argmin(deadline))  # ties -> lowest index: deterministic
        deficit = np.where(mask, probs * total - self.realized, -np.inf)
        return int(np.argmax(deficit))

    def record(self, source: int, amount: float) -> None:
        self.realized[source] += amount

    def state_dict(self) -> dict[str, Any]:
        return {"segment_start": self.segment_start, "realized": self.realized.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.segment_start = int(state["segment_start"])
        self.realized = np.asarray(state["realized"], dtype=np.float64)

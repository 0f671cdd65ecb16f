"""Adaptive mixture weights from per-source losses, the method alone: pure, no I/O.

The method is DoReMi's domain-weight update (Xie et al., 2023, "DoReMi: Optimizing Data Mixtures Speeds Up Language
Model Pretraining", Algorithm 1): exponentiated-gradient ascent on each source's excess loss over a reference,

    λ_i = max(L_i − L_ref,i, 0)
    α'_i = w_i · exp(η λ_i),   α = α' / Σ α'
    w_new = (1 − c) α + c / k                       (k sources, c the smoothing towards uniform)

Where this departs from the paper:

* the excess loss is per source, from the mean token loss the trainers reported over the last interval
  (``LOSS_REPORT``), against a reference loss per source given in the configuration — DoReMi clips per token
  against a reference model's loss of the same token; there is no reference model here;
* the weights are used online: each update is the mixture from its effective step on (DoReMi trains a proxy model
  and uses the average of its weights for a separate run);
* bounds: after the update the weights are projected onto ``min_weight <= w_i <= max_weight`` (Σ w = 1), and the
  move from the current weights is shortened so that no weight changes by more than ``max_change`` (a convex
  combination of the current and the new weights: the sum stays 1 and the bounds still hold);
* a source that no report covered in the interval keeps its excess at 0 (its weight changes only through the
  normalisation): trainers that report late or never cannot stall or steer the update.

Everything is a pure function of (weights, losses, configuration): the same inputs give the same weights, bit for
bit, in any process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence


@dataclass(frozen=True)
class AdaptiveConfig:
    every_steps: int  # one update per this many steps
    reference_loss: Mapping[str, float]  # L_ref per source (sources not named: no excess, weight kept by normalisation)
    step_size: float = 1.0  # η
    smoothing: float = 1e-3  # c
    min_weight: float = 0.0
    max_weight: float = 1.0
    max_change: float = 1.0  # largest |w_new - w| of any source per update
    min_tokens: int = 1  # a source's interval loss counts only over at least this many tokens
    delay_steps: int | None = None  # the k-th update takes effect at k·every_steps + delay_steps (None: first unplanned)
    wait_steps: int | None = None  # how far the fastest reporting rank may be past an interval before it is closed
    #                                without the slower ranks' reports (None: every_steps; 0: the first report closes it)

    @property
    def wait(self) -> int:
        return self.every_steps if self.wait_steps is None else self.wait_steps

    @classmethod
    def of(cls, section: Mapping[str, Any]) -> "AdaptiveConfig":
        """The configuration of a spec's `mixture.adaptive` section (its JSON; `method` is DoReMi's, the only one)."""
        return cls(**{k: v for k, v in section.items() if k != "method"})

    def problems(self, sources: Sequence[str]) -> list[tuple[str, str]]:
        """(field under mixture.adaptive, what is wrong) for every rule the configuration breaks."""
        out: list[tuple[str, str]] = []
        if self.every_steps < 1:
            out.append(("every_steps", f"every_steps must be >= 1, got {self.every_steps}"))
        if self.delay_steps is not None and self.delay_steps < 0:
            out.append(("delay_steps", f"delay_steps must be >= 0, got {self.delay_steps}"))
        if self.wait_steps is not None and self.wait_steps < 0:
            out.append(("wait_steps", f"wait_steps must be >= 0, got {self.wait_steps}"))
        if not (self.step_size > 0 and math.isfinite(self.step_size)):
            out.append(("step_size", f"step_size must be > 0, got {self.step_size}"))
        if not 0 <= self.smoothing < 1:
            out.append(("smoothing", f"smoothing must be in [0, 1), got {self.smoothing}"))
        k = len(sources)
        if not (0 <= self.min_weight <= 1 / max(k, 1) <= self.max_weight <= 1):
            out.append(("min_weight", f"min_weight {self.min_weight} <= 1/{k} <= max_weight {self.max_weight} <= 1 does not hold"))
        if not 0 < self.max_change <= 1:
            out.append(("max_change", f"max_change must be in (0, 1], got {self.max_change}"))
        if self.min_tokens < 1:
            out.append(("min_tokens", f"min_tokens must be >= 1, got {self.min_tokens}"))
        for name, v in self.reference_loss.items():
            if name not in sources:
                out.append((f"reference_loss.{name}", f"reference_loss.{name}: unknown source"))
            elif not (v >= 0 and math.isfinite(v)):
                out.append((f"reference_loss.{name}", f"reference_loss.{name} must be a finite number >= 0, got {v}"))
        return out

    def check(self, sources: Sequence[str]) -> None:
        for _, what in self.problems(sources)[:1]:
            raise ValueError(f"mixture.adaptive.{what}")


def interval_losses(loss_sum: Sequence[float], tokens: Sequence[int], before_sum: Sequence[float],
                    before_tokens: Sequence[int], min_tokens: int = 1) -> list[float | None]:
    """Mean token loss per source over an interval, from running totals at its end and its start (None: fewer
    than `min_tokens` tokens of the source reported in the interval)."""
    out: list[float | None] = []
    for s, t, s0, t0 in zip(loss_sum, tokens, before_sum, before_tokens):
        n = int(t) - int(t0)
        out.append((float(s) - float(s0)) / n if n >= max(1, min_tokens) else None)
    return out


def project(w: Sequence[float], lo: float, hi: float) -> list[float]:
    """The point of {lo <= x_i <= hi, Σ x = 1} closest to `w` (Euclidean): x_i = clip(w_i + τ), τ by bisection
    (deterministic: a fixed number of halvings)."""
    k = len(w)
    if not k * lo <= 1 <= k * hi + 1e-12:
        raise ValueError(f"no weights of {k} sources lie within [{lo}, {hi}] and sum to 1")
    a, b = -max(w) - 1.0, 1.0 - min(w) + 1.0
    for _ in range(200):
        tau = (a + b) / 2
        if sum(min(hi, max(lo, x + tau)) for x in w) > 1:
            b = tau
        else:
            a = tau
    x = [min(hi, max(lo, v + (a + b) / 2)) for v in w]
    total = sum(x)
    return [v / total for v in x]


def doremi_step(weights: Sequence[float], losses: Sequence[float | None], reference: Sequence[float | None],
                cfg: AdaptiveConfig) -> list[float]:
    """One update of the weights (see the module docstring); `losses` / `reference` per source, None = no excess."""
    k = len(weights)
    excess = [max(lv - rv, 0.0) if lv is not None and rv is not None else 0.0 for lv, rv in zip(losses, reference)]
    top = max(cfg.step_size * e for e in excess)  # exp of differences: the same normalised result, no overflow
    grown = [w * math.exp(cfg.step_size * e - top) for w, e in zip(weights, excess)]
    total = sum(grown)
    alpha = [g / total for g in grown] if total > 0 else [1.0 / k] * k
    smoothed = [(1 - cfg.smoothing) * a + cfg.smoothing / k for a in alpha]
    target = project(smoothed, cfg.min_weight, cfg.max_weight)
    cur = project(list(weights), cfg.min_weight, cfg.max_weight)
    move = max(abs(t - c) for t, c in zip(target, cur))
    s = 1.0 if move <= cfg.max_change else cfg.max_change / move
    return [c + s * (t - c) for t, c in zip(target, cur)]


@dataclass(frozen=True)
class AdaptiveState:
    """What an adaptive mixture carries from one update to the next: `k` updates made, the weights in force (the
    mixture's base weights, normalised, in the mixture's source order) and the loss totals at the k-th interval's
    end. The planner journals it with each update, so a restarted planner continues from the last one."""

    k: int
    weights: tuple[float, ...]
    loss_sum: tuple[float, ...]
    tokens: tuple[int, ...]

    @classmethod
    def start(cls, weights: Sequence[float]) -> "AdaptiveState":
        total = sum(weights)
        n = len(weights)
        return cls(0, tuple(float(w) / total for w in weights), (0.0,) * n, (0,) * n)

    def to_json(self) -> dict[str, Any]:
        return {"k": self.k, "weights": list(self.weights), "loss_sum": list(self.loss_sum), "tokens": list(self.tokens)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "AdaptiveState":
        return cls(int(d["k"]), tuple(float(x) for x in d["weights"]), tuple(float(x) for x in d["loss_sum"]),
                   tuple(int(x) for x in d["tokens"]))

    def reweighted(self, weights: Sequence[float]) -> "AdaptiveState":
        """The same intervals with other weights in force (a live update of the mixture replaced them)."""
        total = sum(weights)
        return AdaptiveState(self.k, tuple(float(w) / total for w in weights), self.loss_sum, self.tokens)


def covered_through(rank_through: Iterable[int], wait_steps: int) -> int:
    """The last step the loss reports count as covering, from each reporting rank's newest reported step: the
    slowest rank's, so an interval's update waits for every rank that reports -- unless the fastest rank is more
    than `wait_steps` steps ahead of it, then the fastest's minus `wait_steps` (a straggler, or a rank that stopped
    reporting, holds the mixture back by at most `wait_steps` steps; planning never waits for it). -1: no report."""
    steps = list(rank_through)
    if not steps:
        return -1
    return max(min(steps), max(steps) - wait_steps)


def advance(state: AdaptiveState, loss_sum: Sequence[float], tokens: Sequence[int], through: int,
            reference: Sequence[float | None], cfg: AdaptiveConfig) -> tuple[AdaptiveState, list[float | None]] | None:
    """The next update, once the loss reports cover interval k+1 (`through`: :func:`covered_through` of the ranks'
    reports; the totals are those received so far): the new state (its weights the mixture from the update's step on) and the
    interval's mean loss per source. None while the interval is not covered: nothing changes, nothing waits."""
    boundary = (state.k + 1) * cfg.every_steps
    if through < boundary - 1:
        return None
    losses = interval_losses(loss_sum, tokens, state.loss_sum, state.tokens, cfg.min_tokens)
    new = doremi_step(state.weights, losses, reference, cfg)
    return AdaptiveState(state.k + 1, tuple(new), tuple(float(x) for x in loss_sum), tuple(int(x) for x in tokens)), losses


def effective_step(k: int, cfg: AdaptiveConfig, next_unplanned: int) -> tuple[int, bool]:
    """Where the k-th update takes effect: k·every_steps + delay_steps, or the first step not planned when that one
    was planned already or no delay is set (then `late` is True for a set delay)."""
    if cfg.delay_steps is None:
        return next_unplanned, False
    want = k * cfg.every_steps + cfg.delay_steps
    return (want, False) if want >= next_unplanned else (next_unplanned, True)

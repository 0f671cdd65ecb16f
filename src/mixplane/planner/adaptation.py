"""The planner's adaptive mixture (the spec's `mixture.adaptive`): pure, no I/O.

The planner itself turns the trainers' per-source loss reports into new weights: once the reports cover interval
k+1 (steps [k·every_steps, (k+1)·every_steps)), :func:`mixplane.adaptive.advance` gives the next weights, and the
planner adopts the mixture with them as a whole-mixture update with id ``adaptive-<k+1>`` -- a new generation in
its journal, effective at (k+1)·every_steps + delay_steps (or the first step not planned). The state between
updates (:class:`mixplane.adaptive.AdaptiveState`) is journaled with each update, so a planner restarted from its
journal continues from the last one, and resume, recovery and `mixplane replay` see the generations as journaled.

Policy for trainers that report late or never: planning never waits for a report. An interval is covered when
every rank that has reported so far reported past its last step, or when the fastest is `wait_steps` (default
every_steps) past it (:func:`mixplane.adaptive.covered_through`: a straggler or a rank that stopped reporting holds
the update back by at most that, and a rank whose first report comes later joins from then on); an interval not yet
covered makes no update; an update whose step was planned already takes the first step not planned (``late`` in its
journal record). A live update of the whole mixture (`kubectl patch`, `mixplane update --mixture`) replaces the
weights the adaptation starts from, and its `adaptive` section (or its absence) the configuration.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mixplane.adaptive import AdaptiveConfig, AdaptiveState, advance, covered_through, effective_step

ADAPTIVE_ID = "adaptive-"


def base_weights(mixture: Mapping[str, Any], names: Sequence[str]) -> list[float]:
    """The mixture section's base weights in source order (spec.effective_base_weights: none given = equal)."""
    w = mixture.get("weights") or {}
    return [1.0] * len(names) if not w else [float(w.get(n, 0.0)) for n in names]


class Adaptation:
    """What the planner keeps of an adaptive mixture: the configuration of the mixture in force and the state."""

    def __init__(self, names: Sequence[str], mixture: Mapping[str, Any]) -> None:
        self.names = list(names)
        self.mixture: dict[str, Any] = dict(mixture)
        self.state = AdaptiveState.start(base_weights(mixture, names)) if mixture.get("adaptive") else None

    @property
    def config(self) -> AdaptiveConfig | None:
        section = self.mixture.get("adaptive")
        return AdaptiveConfig.of(section) if section else None

    def restore(self, record: Mapping[str, Any], mixture: Mapping[str, Any]) -> None:
        """A journaled adaptive update's record (its `adaptive` field) and the mixture it made."""
        self.mixture = dict(mixture)
        self.state = AdaptiveState.from_json(record)

    def replaced(self, mixture: Mapping[str, Any]) -> None:
        """A live update of the whole mixture (not one of ours): its weights are where adaptation goes on from."""
        self.mixture = dict(mixture)
        if not mixture.get("adaptive"):
            self.state = None
            return
        w = base_weights(mixture, self.names)
        if sum(w) <= 0:  # cannot be a mixture (the planner refused it before): nothing to start from
            return
        self.state = AdaptiveState.start(w) if self.state is None else self.state.reweighted(w)

    def reweighted(self, weights: Mapping[str, float]) -> None:
        """A weights-only live update: the sources it names take its weights (normalised with the others'
        current ones), the rest keep theirs."""
        if self.state is None:
            return
        cur = dict(zip(self.names, self.state.weights))
        w = [float(weights.get(n, cur[n])) for n in self.names]
        if sum(w) > 0:
            self.state = self.state.reweighted(w)
            self.mixture = {**self.mixture, "weights": dict(zip(self.names, w))}

    def next_update(self, loss_sum: Sequence[float], tokens: Sequence[int], rank_through: Iterable[int],
                    next_unplanned: int) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """(the UPDATE_MIXTURE meta, the record to journal with it) once the reports cover the next interval
        (`rank_through`: each reporting rank's newest step), or None. The state moves on only when the caller calls
        :meth:`applied` with the record."""
        cfg = self.config
        if cfg is None or self.state is None:
            return None
        reference = [cfg.reference_loss.get(n) for n in self.names]
        nxt = advance(self.state, loss_sum, tokens, covered_through(rank_through, cfg.wait), reference, cfg)
        if nxt is None:
            return None
        new, losses = nxt
        step, late = effective_step(new.k, cfg, next_unplanned)
        mixture = {**self.mixture, "weights": dict(zip(self.names, new.weights))}
        meta = {"mixture": mixture, "update_id": f"{ADAPTIVE_ID}{new.k}", "effective_step": step}
        return meta, {**new.to_json(), "losses": losses, "late": late}

    def applied(self, record: Mapping[str, Any], mixture: Mapping[str, Any]) -> None:
        self.restore(record, mixture)

    def status(self) -> dict[str, Any] | None:
        """STATUS `adaptive`: updates made and the weights they set (None: the mixture in force does not adapt)."""
        if self.state is None or self.config is None:
            return None
        return {"updates": self.state.k, "every_steps": self.config.every_steps,
                "weights": dict(zip(self.names, self.state.weights))}

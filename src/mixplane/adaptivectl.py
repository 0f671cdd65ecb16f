"""Adaptive mixtures driven from outside the planner (issue 23 item 5, first form).

:class:`AdaptiveController` reads the trainers' per-source loss reports from the planner's STATUS
(``source_loss``: running totals), and once every ``every_steps`` steps — when the reports cover the interval —
turns the interval's mean losses into new weights with :func:`mixplane.adaptive.doremi_step` and sends them as a
whole-mixture live update (``mixing.mixture_update_meta``, id ``adaptive-<k>`` for the k-th interval). The
planner adopts it from the first step it has not planned, as a new generation in its journal, so batches,
``mixplane replay`` and a planner restarted from its journal (the update ids answered as duplicates, the update
re-applied at its step) stay bit-exact with what was delivered.

Policy for trainers that report late or never: the planner never waits for reports; the controller waits for the
interval to be covered (``source_loss.through``) and sends nothing until then, so the mixture stays as it is (a
source without a report in the interval keeps no excess loss). What is not deterministic across two runs is the
step at which an update takes effect: it is the first step the planner had not planned when the update arrived,
which depends on how far ahead of the trainers the planner runs (the journal records it, so a replay is exact).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mixplane import control
from mixplane.adaptive import AdaptiveConfig, doremi_step, interval_losses
from mixplane.mixing import mixture_update_meta
from mixplane.spec import DataMixtureSpec


@dataclass
class AdaptiveUpdate:
    interval: int  # k: the update after steps [(k-1)·every_steps, k·every_steps)
    losses: list[float | None]
    weights: list[float]
    generation: int
    effective_step: int


@dataclass
class AdaptiveController:
    endpoint: str
    spec: DataMixtureSpec
    config: AdaptiveConfig
    curve: Any = None
    timeout_s: float = 5.0
    updates: list[AdaptiveUpdate] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.spec.mixture.phases or self.spec.mixture.anneal is not None:
            raise ValueError("mixture.adaptive: a mixture with phases or an anneal cannot adapt its weights (the next "
                             "phase would replace them)")
        self.names = self.spec.source_names()
        self.config.check(self.names)
        w = self.spec.mixture.weights
        total = sum(float(w[n]) for n in self.names)
        self.weights = [float(w[n]) / total for n in self.names]
        self.reference = [self.config.reference_loss.get(n) for n in self.names]
        self.k = 0
        self._sum = [0.0] * len(self.names)
        self._tokens = [0] * len(self.names)

    def poll(self) -> AdaptiveUpdate | None:
        """One look at the planner: the update sent, or None (the interval is not reported yet)."""
        st = control.status(self.endpoint, self.timeout_s, curve=self.curve)
        sl = st.get("source_loss") or {}
        boundary = (self.k + 1) * self.config.every_steps
        if int(sl.get("through", -1)) < boundary - 1:
            return None
        sums = [float(x) for x in sl["loss_sum"]]
        tokens = [int(x) for x in sl["tokens"]]
        losses = interval_losses(sums, tokens, self._sum, self._tokens, self.config.min_tokens)
        new = doremi_step(self.weights, losses, self.reference, self.config)
        mixture = self.spec.mixture.model_copy(update={"weights": dict(zip(self.names, new))})
        ack = control.update_mixture(self.endpoint, mixture_update_meta(mixture, f"adaptive-{self.k + 1}"),
                                     self.timeout_s, curve=self.curve)
        self.k += 1
        self._sum, self._tokens, self.weights = sums, tokens, new
        up = AdaptiveUpdate(self.k, losses, new, int(ack.get("generation", -1)), int(ack.get("effective_step", -1)))
        self.updates.append(up)
        return up

"""Adaptive mixtures driven from outside the planner, by a controller that sends whole-mixture live updates
(for methods the planner does not run itself, and as the reference the planner's own adaptation is tested against).

:class:`AdaptiveController` reads the trainers' per-source loss reports from the planner's STATUS
(``source_loss``: running totals), and once every ``every_steps`` steps — when the reports cover the interval —
turns the interval's mean losses into new weights with :func:`mixplane.adaptive.doremi_step` and sends them as a
whole-mixture live update (``mixing.mixture_update_meta``, id ``adaptive-<k>`` for the k-th interval). The
planner adopts it from the first step it has not planned, as a new generation in its journal, so batches,
``mixplane replay`` and a planner restarted from its journal (the update ids answered as duplicates, the update
re-applied at its step) stay bit-exact with what was delivered.

Effective step: with ``delay_steps`` set, the k-th update takes effect at step ``k·every_steps + delay_steps`` — the
same step in every run, so two runs whose trainers report the same losses get the same generations at the same
steps, also when the planner is killed and recovers in between (a restarted planner answers an id it journaled as a
duplicate, and its loss totals come back from the journal's loss records). ``delay_steps`` must exceed how far the
planner plans ahead of the trainers (``runtime.max_lead_steps`` + ``prefetch_steps`` + the clients' look-ahead); an
update that arrives after its step was planned is sent again for the first step not planned (``late`` in
:class:`AdaptiveUpdate`), which is the only form without ``delay_steps``.

Policy for trainers that report late or never: the planner never waits for reports; the controller waits for the
interval to be covered by the ranks' reports (``source_loss.ranks``, the same rule as the planner's own:
:func:`mixplane.adaptive.covered_through`) and sends nothing until then, so the mixture stays as it is (a
source without a report in the interval keeps no excess loss). A planner that is restarting or recovering (no
answer, or a retryable refusal) is asked again at the next poll.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mixplane import control
from mixplane.adaptive import AdaptiveConfig, AdaptiveState, advance, covered_through, effective_step
from mixplane.mixing import mixture_update_meta
from mixplane.spec import DataMixtureSpec


@dataclass
class AdaptiveUpdate:
    interval: int  # k: the update after steps [(k-1)·every_steps, k·every_steps)
    losses: list[float | None]
    weights: list[float]
    generation: int
    effective_step: int
    late: bool = False  # its fixed step was already planned: it took effect at the first step not planned


@dataclass
class AdaptiveController:
    endpoint: str
    spec: DataMixtureSpec
    config: AdaptiveConfig
    curve: Any = None
    timeout_s: float = 5.0
    delay_steps: int | None = None  # overrides config.delay_steps when set
    updates: list[AdaptiveUpdate] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.spec.mixture.phases or self.spec.mixture.anneal is not None:
            raise ValueError("mixture.adaptive: a mixture with phases or an anneal cannot adapt its weights (the next "
                             "phase would replace them)")
        if self.delay_steps is not None:
            self.config = dataclasses.replace(self.config, delay_steps=self.delay_steps)
        self.names = self.spec.source_names()
        self.config.check(self.names)
        w = self.spec.mixture.weights
        self.state = AdaptiveState.start([float(w[n]) for n in self.names])
        self.reference = [self.config.reference_loss.get(n) for n in self.names]

    @property
    def weights(self) -> list[float]:
        return list(self.state.weights)

    def poll(self) -> AdaptiveUpdate | None:
        """One look at the planner: the update sent, or None (the interval is not reported yet)."""
        try:
            st = control.status(self.endpoint, self.timeout_s, curve=self.curve)
        except (TimeoutError, RuntimeError):
            return None  # the planner is restarting: look again at the next poll
        sl = st.get("source_loss") or {}
        through = covered_through((int(v) for v in (sl.get("ranks") or {}).values()), self.config.wait)
        nxt = advance(self.state, sl.get("loss_sum") or [], sl.get("tokens") or [], through, self.reference, self.config)
        if nxt is None:
            return None
        new, losses = nxt
        mixture = self.spec.mixture.model_copy(update={"weights": dict(zip(self.names, new.weights))})
        uid = f"adaptive-{new.k}"
        step, _ = effective_step(new.k, self.config, 0)  # the fixed step; the planner says when it was planned
        late = False
        try:
            try:
                ack = control.update_mixture(self.endpoint, mixture_update_meta(
                    mixture, uid, step if self.config.delay_steps is not None else None), self.timeout_s, curve=self.curve)
            except RuntimeError as e:
                if self.config.delay_steps is None or "already planned" not in str(e):
                    raise
                late = True
                ack = control.update_mixture(self.endpoint, mixture_update_meta(mixture, uid), self.timeout_s,
                                             curve=self.curve)
        except (TimeoutError, RuntimeError) as e:
            if control.update_retryable(e):
                return None  # restarting or recovering: the same update (same id) again at the next poll
            raise
        self.state = new
        up = AdaptiveUpdate(new.k, losses, list(new.weights), int(ack.get("generation", -1)),
                            int(ack.get("effective_step", -1)), late)
        self.updates.append(up)
        return up

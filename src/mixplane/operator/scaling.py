"""Mixture-driven scaling (MegaScale-Data §5.2): the policy the operator's timer runs. Pure, no I/O.

Every interval the operator reports an :class:`Observation` (the planner's step and trainer token rate
from STATUS, the sources the planner waited for, the delivered token rate per source). The policy
projects each source's demand over the next `lookahead_steps` steps of the schedule (cores = share x
tokens/s x cost per token, taking the largest share the lookahead sees, so capacity arrives before a
phase does), keeps a moving average over `window` intervals, and when a source's average stays above
its allocation (scale up) or below `down_ratio` of it (scale down, idle reclaim) for `consecutive`
intervals, re-targets that source. The new allocation is packed into pods with the auto-partitioner's
packer, so the decision is a :class:`PodPlan` the builders render (pods added, removed, resized).

Partitions follow demand only through the data plane's re-partition (mixplane.repartition): one
partition is one loader process that reads on one thread and transforms on the source's ``workers`` threads, so it
does at most ``bounds.capacity(workers)`` cores of single-thread work (``pod_cpu`` x the worker speed-up: the
auto-partitioner's own rule, ``autopartition.partitions_needed``), and a source allocated more than its partitions
can do is *wanted* re-partitioned (:meth:`MixtureScaler.wanted_repartitions`: ceil(cores x headroom / capacity)
partitions, within ``max_per_source`` and the source's ``max_partitions``). Fewer only with ``ScalingConfig.shrink``
(the mixture's ``mixplane.io/repartition: follow``): by the same rule, to what both the allocation and the largest
share the rest of the schedule gives the source need -- the split the auto-partitioner would plan for the rest of the
run -- so a source is not shrunk before a later phase that needs its partitions again. The
wanted re-partitions are kept in the scaler's state (status.scaler); :meth:`MixtureScaler.repartitioned` takes the
planner's acknowledgment (REPARTITION) and packs the new partitions. Until then scaling changes how many pods host
a source's partitions and their CPU. A
partition that changes pods moves with the data plane's partition handoff (planner.partitions):
the new pod starts with the partition in its args and registers as a shadow of it while the old pod still
serves it; the operator then asks the planner to hand it over (`handoff_moves`, HANDOFF at a step
boundary: nothing lost, repeated or reordered) and removes the old pod only once it serves nothing.

Measured throughput corrects the profile: when the planner waited for a source during an interval, its
loaders were saturated, so delivered tokens/s over allocated cores is that source's real cost; the
policy raises its cost estimate to it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mixplane.operator.autopartition import (
    LoaderBudget,
    PartitionBounds,
    PodPlan,
    SourceCost,
    pack_pods,
    partitions_needed,
)


MAX_CORRECTION = 2.0


@dataclass(frozen=True)
class ScalingConfig:
    lookahead_steps: int = 20  # N: schedule steps ahead whose demand counts
    window: int = 3  # moving average over this many intervals
    consecutive: int = 2  # K: intervals a threshold must stay crossed
    down_ratio: float = 0.75  # scale down when the average needs less than this share of the allocation
    cost_correction: float = 0.5  # weight of a saturated measurement in the cost estimate (EMA)
    shrink: bool = False  # partitions may also be re-partitioned to fewer when demand falls (see the module docstring)

    def __post_init__(self) -> None:
        if self.lookahead_steps < 0 or self.window < 1 or self.consecutive < 1 or not 0 < self.down_ratio < 1:
            raise ValueError("scaling: lookahead_steps >= 0, window >= 1, consecutive >= 1 and 0 < down_ratio < 1 are required")


@dataclass(frozen=True)
class Observation:
    """What one interval saw, from the planner's STATUS and the loaders' metrics."""

    step: int  # planned_through
    tokens_per_s: float  # trainer consumption
    waiting: frozenset[str] = frozenset()  # sources the planner waited for
    delivered_tokens_per_s: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RepartitionWanted:
    """A source whose allocation needs more partitions than it has (one partition does at most
    `bounds.capacity(workers)` cores of work), or with `ScalingConfig.shrink` fewer."""

    source: str
    from_partitions: int
    to_partitions: int
    cores: float  # the allocation that needs them
    interval: int  # the interval that first wanted this count

    def to_json(self) -> dict[str, Any]:
        return {"from": self.from_partitions, "to": self.to_partitions, "cores": self.cores, "interval": self.interval}


def partitions_for(cores: float, cost: SourceCost, bounds: PartitionBounds, workers: int = 1) -> int:
    """Partitions a source whose partitions have `workers` worker threads needs to read `cores` worth of work
    (`autopartition.partitions_needed`, the auto-partitioner's rule), within max_per_source and its max_partitions."""
    return int(min(partitions_needed(cores, workers, bounds), bounds.max_per_source, cost.max_partitions))


@dataclass(frozen=True)
class Decision:
    source: str
    direction: str  # "up" | "down"
    from_cores: float
    to_cores: float
    interval: int


def _shares_at(segments: Sequence[tuple[int, Mapping[str, float]]], step: int) -> Mapping[str, float]:
    cur = segments[0][1]
    for start, shares in segments:
        if start <= step:
            cur = shares
    return cur


def projected_shares(segments: Sequence[tuple[int, Mapping[str, float]]], step: int, lookahead: int) -> dict[str, float]:
    """Largest share each source has in steps [step, step + lookahead] of the schedule."""
    out = dict(_shares_at(segments, step))
    for start, shares in segments:
        if step < start <= step + lookahead:
            for k, v in shares.items():
                out[k] = max(out.get(k, 0.0), v)
    return out


class MixtureScaler:
    """Holds the allocation per source (in cores) and moves it when the projected demand says so."""

    def __init__(self, costs: Sequence[SourceCost], partitions: Mapping[str, int],
                 segments: Sequence[tuple[int, Mapping[str, float]]], initial_shares: Mapping[str, float], tokens_per_s: float,
                 *, bounds: PartitionBounds | None = None, budget: LoaderBudget | None = None,
                 config: ScalingConfig | None = None, workers: Mapping[str, int] | None = None):
        """`workers`: worker threads per partition of each source (the auto-partitioner's PartitionPlan.workers;
        absent: 1), what one partition can do (`bounds.capacity`) and so when a source needs more partitions."""
        bounds = bounds or PartitionBounds()
        config = config or ScalingConfig()
        self.costs = {c.name: c for c in costs}
        self.order = [c.name for c in costs]
        self.partitions = dict(partitions)
        self.workers = {n: max(1, int((workers or {}).get(n, 1))) for n in self.order}
        self.segments = sorted(((int(s), dict(sh)) for s, sh in segments), key=lambda x: x[0])
        self.bounds, self.budget, self.config = bounds, budget, config
        self.tokens_per_s = float(tokens_per_s)
        self.alloc = {n: self.cores(n, float(initial_shares.get(n, 0.0))) for n in self.order}  # cores the pods serve
        self.history: dict[str, deque[float]] = {n: deque(maxlen=config.window) for n in self.order}
        self.above = {n: 0 for n in self.order}
        self.below = {n: 0 for n in self.order}
        self.interval = 0
        self.step = 0  # the step of the last observation
        self.decisions: list[Decision] = []
        self.wanted: dict[str, RepartitionWanted] = {}  # sources to re-partition (kept until acknowledged)
        self.plan = self._pack()

    def set_schedule(self, segments: Sequence[tuple[int, Mapping[str, float]]]) -> None:
        """A mixture update (kubectl patch of weights or phases) changes what is projected from now on."""
        self.segments = sorted(((int(s), dict(sh)) for s, sh in segments), key=lambda x: x[0])

    def cores(self, name: str, share: float, tokens_per_s: float | None = None) -> float:
        return share * (self.tokens_per_s if tokens_per_s is None else tokens_per_s) * self.costs[name].cpu_s_per_token

    def allocated_cores(self) -> dict[str, float]:
        """Cores each source's pods are sized for (before headroom)."""
        return dict(self.alloc)

    def _pack(self, tokens_per_s: float | None = None, costs: Mapping[str, SourceCost] | None = None) -> PodPlan:
        # pack_pods sizes by share x tokens/s x cost; express each allocation in those terms (at the rate and costs of
        # the interval that packed: kept, so a restored scaler repacks to the very same figures)
        tps = self.tokens_per_s if tokens_per_s is None else tokens_per_s
        costs = dict(self.costs) if costs is None else dict(costs)
        self.packed_tokens_per_s = tps
        self.packed_costs = {n: c.cpu_s_per_token for n, c in costs.items()}
        shares = {n: (self.alloc[n] / (tps * c.cpu_s_per_token) if c.cpu_s_per_token > 0 else 0.0)
                  for n, c in costs.items()}
        return pack_pods(list(costs.values()), self.partitions, shares, tps, self.bounds,
                         self.budget, what=f"scaling interval {self.interval}", workers=self.workers)

    def _correct_costs(self, obs: Observation) -> None:
        """A saturated source delivered what its cores can: cost = cores / delivered tokens."""
        a = self.config.cost_correction
        for n in obs.waiting:
            rate = obs.delivered_tokens_per_s.get(n, 0.0)
            if n not in self.costs or rate <= 0:
                continue
            # what its partitions can use: one partition does bounds.capacity(workers) at most. A source allocated
            # more cores than that delivers what its processes can, not what its cores could: taking the allocation
            # would raise its cost, its allocation, and so on without end (it is wanted re-partitioned)
            cores = min(self.plan.source_cpu().get(n, 0.0), self.partitions[n] * self.bounds.capacity(self.workers[n]))
            # one interval moves the estimate at most MAX_CORRECTION x: a wait can have other causes (a loader
            # just restarted or handed over) than a source too expensive for its cores
            measured = min(cores / rate, MAX_CORRECTION * self.costs[n].cpu_s_per_token)
            c = self.costs[n]
            if measured > c.cpu_s_per_token:
                new = (1 - a) * c.cpu_s_per_token + a * measured
                self.costs[n] = SourceCost(c.name, new, c.memory_per_partition, c.max_partitions)
                self.above[n] = max(self.above[n], self.config.consecutive - 1)  # act on the next crossing

    def observe(self, obs: Observation) -> list[Decision]:
        """One timer interval; returns the decisions taken (and `self.plan` is the pods to run)."""
        self.interval += 1
        self.step = int(obs.step)
        if math.isfinite(obs.tokens_per_s) and obs.tokens_per_s > 0:
            self.tokens_per_s = float(obs.tokens_per_s)
        self._correct_costs(obs)
        proj = projected_shares(self.segments, obs.step, self.config.lookahead_steps)
        out: list[Decision] = []
        for n in self.order:
            h = self.history[n]
            h.append(self.cores(n, float(proj.get(n, 0.0))))
            avg = sum(h) / len(h)
            have = self.alloc[n]
            if avg > have * (1 + 1e-9) + 1e-12:
                self.above[n] += 1
                self.below[n] = 0
            elif avg < have * self.config.down_ratio:
                self.below[n] += 1
                self.above[n] = 0
            else:
                self.above[n] = self.below[n] = 0
            if self.above[n] < self.config.consecutive and self.below[n] < self.config.consecutive:
                continue
            # the largest of the projections that crossed: the lookahead already looks forward, and a scale
            # down (to 0: the source's pods are reclaimed) never goes below what the last K intervals needed
            new = max(list(h)[-self.config.consecutive:])
            if abs(new - have) > 1e-12:
                out.append(Decision(n, "up" if new > have else "down", have, new, self.interval))
                self.alloc[n] = new
            self.above[n] = self.below[n] = 0
        if out:
            self.plan = self._pack()
            self.decisions.extend(out)
        self._want_partitions()
        return out

    def remaining_peak_cores(self, name: str) -> float:
        """Cores source `name` needs at the largest share the schedule gives it from the current segment on (at the
        rate now): what the auto-partitioner would size its split for if the run started here."""
        cur = max((start for start, _ in self.segments if start <= self.step), default=self.segments[0][0])
        return self.cores(name, max(float(sh.get(name, 0.0)) for start, sh in self.segments if start >= cur))

    def _want_partitions(self) -> None:
        for n in self.order:
            need = partitions_for(self.alloc[n], self.costs[n], self.bounds, self.workers[n])
            have = int(self.partitions[n])
            if need < have:  # fewer: only what neither the allocation nor the rest of the schedule needs
                need = partitions_for(max(self.alloc[n], self.remaining_peak_cores(n)), self.costs[n], self.bounds,
                                      self.workers[n]) if self.config.shrink else have
                need = min(need, have)
            if need == have:
                self.wanted.pop(n, None)
            elif n not in self.wanted or self.wanted[n].to_partitions != need:
                self.wanted[n] = RepartitionWanted(n, have, need, self.alloc[n], self.interval)

    def wanted_repartitions(self) -> list[RepartitionWanted]:
        """The re-partitions the allocations need now, in source order (REPARTITION requests to send)."""
        return [self.wanted[n] for n in self.order if n in self.wanted]

    def repartitioned(self, source: str, partitions: int) -> None:
        """The planner acknowledged (applied) a re-partition: the source's pods are packed for its new partitions."""
        if source not in self.partitions:
            raise ValueError(f"repartitioned: no source {source!r}")
        if int(partitions) < 1:
            raise ValueError(f"repartitioned: partitions of {source!r} must be >= 1, not {partitions}")
        self.partitions[source] = int(partitions)
        w = self.wanted.get(source)
        if w is not None and (w.to_partitions <= int(partitions) if w.to_partitions > w.from_partitions
                              else w.to_partitions >= int(partitions)):
            del self.wanted[source]
        self.plan = self._pack(self.packed_tokens_per_s, {n: SourceCost(c.name, self.packed_costs.get(n, c.cpu_s_per_token),
                                                                         c.memory_per_partition, c.max_partitions)
                                                          for n, c in self.costs.items()})

    def state_dict(self) -> dict[str, Any]:
        """What must outlive the operator process (kept in status.scaler): allocations, the moving averages, the
        threshold counters, corrected costs and the rate. JSON-ready; `load_state_dict` restores it."""
        return {"interval": self.interval, "tokensPerSecond": self.tokens_per_s,
                "packedTokensPerSecond": self.packed_tokens_per_s, "packedCosts": dict(self.packed_costs),
                "alloc": {n: self.alloc[n] for n in self.order},
                "history": {n: list(self.history[n]) for n in self.order},
                "above": dict(self.above), "below": dict(self.below),
                "costs": {n: self.costs[n].cpu_s_per_token for n in self.order},
                "partitions": {n: int(self.partitions[n]) for n in self.order},
                "repartitions": {n: w.to_json() for n, w in self.wanted.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`'s figures; a source the state does not name keeps its fresh values (a state of
        another set of sources is refused)."""
        names = set(self.order)
        for key in ("alloc", "history", "above", "below", "costs", "packedCosts", "partitions", "repartitions"):
            got = state.get(key) or {}
            if not isinstance(got, Mapping) or set(got) - names:
                raise ValueError(f"status.scaler.{key}: sources {sorted(set(got) - names) if isinstance(got, Mapping) else got} "
                                 f"are not the mixture's")
        self.interval = int(state.get("interval") or 0)
        tps = float(state.get("tokensPerSecond") or self.tokens_per_s)
        if math.isfinite(tps) and tps > 0:
            self.tokens_per_s = tps
        for n, v in (state.get("alloc") or {}).items():
            self.alloc[n] = float(v)
        for n, h in (state.get("history") or {}).items():
            self.history[n] = deque((float(x) for x in h), maxlen=self.config.window)
        for n, v in (state.get("above") or {}).items():
            self.above[n] = int(v)
        for n, v in (state.get("below") or {}).items():
            self.below[n] = int(v)
        for n, v in (state.get("partitions") or {}).items():  # re-partitions acknowledged (the spec says the first)
            self.partitions[n] = int(v)
        self.wanted = {n: RepartitionWanted(n, int(w["from"]), int(w["to"]), float(w["cores"]), int(w["interval"]))
                       for n, w in (state.get("repartitions") or {}).items()}
        for n, v in (state.get("costs") or {}).items():
            c = self.costs[n]
            self.costs[n] = SourceCost(c.name, float(v), c.memory_per_partition, c.max_partitions)
        packed = {n: SourceCost(c.name, float((state.get("packedCosts") or {}).get(n, c.cpu_s_per_token)), c.memory_per_partition,
                                c.max_partitions) for n, c in self.costs.items()}
        self.plan = self._pack(float(state.get("packedTokensPerSecond") or self.tokens_per_s), packed)

    def shares(self, tokens_per_s: float) -> dict[str, float]:
        """The allocations as shares of `tokens_per_s`, the rate the pods are sized for (what `pack_pods` takes)."""
        return {n: (self.alloc[n] / (tokens_per_s * c.cpu_s_per_token) if c.cpu_s_per_token > 0 else 0.0)
                for n, c in self.costs.items()}

    def supply_tokens_per_s(self) -> dict[str, float]:
        cpu = self.plan.source_cpu()
        return {n: (cpu.get(n, 0.0) / c.cpu_s_per_token if c.cpu_s_per_token > 0 else math.inf) for n, c in self.costs.items()}


def handoff_moves(want: Mapping[str, str], table: Mapping[str, object]) -> tuple[list[tuple[str, str]], set[str]]:
    """What the operator does to reach the loader layout `want` (partition "src:r" -> host that should serve it)
    from the planner's partition table (`control.partitions()`: {"partitions": {p: {"host"}}, "hosts": {h: {"alive"}}}).

    Returns the handoffs to request now (partition, to host: the target is registered and alive, and something
    else serves the partition) and the hosts outside the layout that still serve a partition (their pods stay
    until it has moved)."""
    parts = table.get("partitions") or {}
    hosts = table.get("hosts") or {}
    assert isinstance(parts, Mapping) and isinstance(hosts, Mapping)
    moves: list[tuple[str, str]] = []
    wanted_hosts = set(want.values())
    for p, to in sorted(want.items()):
        cur = (parts.get(p) or {}).get("host")
        target = hosts.get(to) or {}
        if cur != to and target.get("alive"):
            moves.append((p, to))
    draining = {str(a.get("host")) for a in parts.values() if a.get("host") and a.get("host") not in wanted_hosts}
    return moves, draining

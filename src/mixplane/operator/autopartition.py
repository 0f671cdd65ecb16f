"""Source auto-partitioning (MegaScale-Data §5.1): profiled costs + the mixture -> loader partitions and pods.

Pure: numbers in, a plan out; no Kubernetes client, no file access. The operator and `mixplane profile`
feed it; the manifest builders render its pods.

The model. Serving source ``s`` at ``t`` trainer tokens per second with share ``w_s`` of the tokens costs
``w_s * t * cpu_s_per_token`` cores. A *partition* (the spec's ``replicas``) is a disjoint slice of the
source read by one Source Loader; a loader reads on one thread (`TOKENIZERS_PARALLELISM=false`) and, with
``sources[].workers: N``, transforms on N worker threads (loader/workers.py), so a partition can do
``pod_cpu x worker_speedup[N - 1]`` cores of single-thread work (DEFAULT_WORKER_SPEEDUP: from bench/loader_io.py).
Hence, for the peak share a source has anywhere in the schedule:

1. **Partitions** (data-parallel degree): ``ceil(peak cores x headroom / partition capacity)``, within
   ``[1, min(max_per_source, max_partitions)]`` (w_src). They are fixed for the run: changing them
   reshuffles the source's data split. **Workers** (cores per partition): a source whose ``workers`` is a
   number keeps it; ``auto`` gets the fewest partitions its largest worker count allows
   (``max_workers``), then the fewest workers that still serve its peak with those partitions — one
   partition with 3 threads instead of 3 partitions with their own shuffles and interpreters.
2. **Pods** (per segment of the schedule): partitions are sorted by source cost, expensive first (the seed's
   source clustering), and packed first-fit-decreasing into loader pods of at most ``pod_cpu`` cores and
   ``max_per_pod`` partitions (w_actor). Cheap, small sources share pods (the old ``sources_per_loader``
   generalised); expensive ones get pods of their own. When memory is tight, pods are packed fuller
   (every pod costs an interpreter, ``pod_base_memory``) until the plan fits or cannot.
3. **Resources**: each pod requests what its partitions need at that segment's weights, x ``headroom``,
   rounded up to ``cpu_quantum``; memory is the partitions' footprint plus ``pod_base_memory``.

Because partitions are sized for the peak but pod CPU for the segment, supply covers demand at every step
and idle CPU stays near ``headroom - 1``. Moving a partition to another pod between segments needs the
data-plane handoff (planner.partitions); until then a move restarts the loaders involved.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mixplane.profile_message import PartitionError, SourceCost  # noqa: F401 - what a profile says of a source

MIB = 1 << 20


@dataclass(frozen=True)
class LoaderBudget:
    """Cluster resources left for loaders (after planner and constructors)."""

    cpu: float  # cores
    memory: int  # bytes


# throughput of one partition with 1, 2, 3, 4 worker threads over 1 thread: Amdahl over the share of a text partition's
# CPU time spent without the GIL (the tokenizer's batch call), 0.931 as measured by bench/loader_io.py (the lower of
# two rounds, 0.931-0.961) — a model, because the shared 2-core machine could not measure the speed-up itself
# (docs/loader.md, Workers). Beyond the last entry a thread adds nothing.
DEFAULT_WORKER_SPEEDUP = (1.0, 1.87, 2.64, 3.31)


@dataclass(frozen=True)
class PartitionBounds:
    max_per_source: int = 64  # w_src: partitions of one source
    max_per_pod: int = 16  # w_actor: partitions one loader pod hosts
    pod_cpu: float = 1.0  # cores one loader pod (one single-threaded process) can use
    pod_base_memory: int = 256 * MIB  # interpreter, libraries, sockets of one loader process
    headroom: float = 1.05  # supply / demand a plan aims at
    cpu_quantum: float = 0.01  # CPU requests are multiples of this (10m)
    min_pod_cpu: float = 0.05  # a pod of idle partitions still polls its sockets
    small_source_cpu: float = 0.5  # sources needing fewer cores than this share pods with other small ones
    max_workers: int = 4  # worker threads a `workers: auto` source's partition may get
    worker_speedup: tuple[float, ...] = DEFAULT_WORKER_SPEEDUP  # a partition's throughput at 1, 2, ... workers / 1

    def __post_init__(self) -> None:
        if self.max_per_source < 1 or self.max_per_pod < 1:
            raise PartitionError("partition bounds: max_per_source and max_per_pod must be >= 1")
        if self.max_workers < 1:
            raise PartitionError("partition bounds: max_workers must be >= 1")
        sp = self.worker_speedup
        if not sp or sp[0] != 1.0 or any(not (b >= a) for a, b in zip(sp, sp[1:])):
            raise PartitionError(f"partition bounds: worker_speedup must start at 1.0 and never decrease, got {sp}")

    def capacity(self, workers: int) -> float:
        """Cores of single-thread work (what `cpu_s_per_token` counts) one partition with `workers` threads does."""
        sp = self.worker_speedup
        return self.pod_cpu * sp[min(max(1, int(workers)), len(sp)) - 1]
        if not self.pod_cpu > 0 or not self.headroom >= 1.0 or not self.cpu_quantum > 0:
            raise PartitionError("partition bounds: pod_cpu > 0, headroom >= 1 and cpu_quantum > 0 are required")


@dataclass(frozen=True)
class LoaderPod:
    """One loader pod: a process hosting these (source, partition) pairs with these resources."""

    name: str
    members: tuple[tuple[str, int], ...]
    cpu: float  # cores requested
    memory: int  # bytes requested
    source_demand: tuple[tuple[str, float], ...]  # cores each hosted source needs here (without headroom)

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s for s, _ in self.members))

    @property
    def demand_cpu(self) -> float:
        return sum(d for _, d in self.source_demand)

    @property
    def idle(self) -> bool:
        """No hosted source has weight: the pod need not run (0 replicas)."""
        return self.demand_cpu <= 0


@dataclass(frozen=True)
class PodPlan:
    """Loader pods for one mixture (one segment of the schedule)."""

    weights: Mapping[str, float]  # token shares the pods were sized for
    pods: tuple[LoaderPod, ...]

    @property
    def cpu(self) -> float:
        """Cores of the pods that run (idle pods run 0 replicas)."""
        return sum(p.cpu for p in self.pods if not p.idle)

    @property
    def memory(self) -> int:
        return sum(p.memory for p in self.pods if not p.idle)

    def source_cpu(self) -> dict[str, float]:
        """Cores each source gets: a pod's CPU is shared by its sources in proportion to their demand."""
        out: dict[str, float] = {}
        for p in self.pods:
            total = p.demand_cpu
            for s, d in p.source_demand:
                if p.idle:
                    out.setdefault(s, 0.0)
                    continue
                out[s] = out.get(s, 0.0) + p.cpu * (d / total if total > 0 else 1.0 / len(p.source_demand))
        return out

    def pods_of(self, source: str) -> list[LoaderPod]:
        return [p for p in self.pods if source in p.sources]


@dataclass(frozen=True)
class PartitionPlan:
    """The whole answer: partitions per source (spec `replicas`) and the pods of every schedule segment."""

    partitions: Mapping[str, int]
    costs: Mapping[str, SourceCost]
    tokens_per_s: float
    segments: tuple[tuple[int, PodPlan], ...]  # (start step, pods) in step order
    workers: Mapping[str, int] = field(default_factory=dict)  # worker threads per partition (absent: 1)

    def pods_at(self, step: int) -> PodPlan:
        cur = self.segments[0][1]
        for start, plan in self.segments:
            if start <= step:
                cur = plan
        return cur

    def supply_tokens_per_s(self, step: int) -> dict[str, float]:
        """Tokens per second each source's pods can deliver at `step` (cores / cost per token)."""
        cpu = self.pods_at(step).source_cpu()
        return {s: (cpu.get(s, 0.0) / c.cpu_s_per_token if c.cpu_s_per_token > 0 else math.inf) for s, c in self.costs.items()}


def source_cores(cost: SourceCost, share: float, tokens_per_s: float) -> float:
    """Cores a source needs to deliver `share` of `tokens_per_s` trainer tokens."""
    return share * tokens_per_s * cost.cpu_s_per_token


def partitions_needed(cores: float, workers: int, bounds: PartitionBounds) -> int:
    """Partitions that serve `cores` of single-thread work (what `cpu_s_per_token` counts) x `bounds.headroom` when
    each has `workers` worker threads (`bounds.capacity`: the throughput one such partition gives). The one rule
    partitions are sized by, at admission (`partition_layout`, at the peak share) and at run time (the scaler's
    re-partitions, `scaling.partitions_for`, at the allocation). At least 1; the callers bound it."""
    return max(1, math.ceil(max(0.0, cores) * bounds.headroom / bounds.capacity(workers) - 1e-9))


def partition_counts(costs: Sequence[SourceCost], peak_shares: Mapping[str, float], tokens_per_s: float,
                     bounds: PartitionBounds, workers: Mapping[str, int | str] | None = None) -> dict[str, int]:
    """Partitions per source: enough that no partition needs more than it can do at the source's peak."""
    return {n: p for n, (p, _) in partition_layout(costs, peak_shares, tokens_per_s, bounds, workers).items()}


def partition_layout(costs: Sequence[SourceCost], peak_shares: Mapping[str, float], tokens_per_s: float,
                     bounds: PartitionBounds, workers: Mapping[str, int | str] | None = None) -> dict[str, tuple[int, int]]:
    """(partitions, worker threads per partition) per source. `workers`: the sources' `workers` settings (a number
    is kept; `auto` or absent-with-auto is chosen: the fewest partitions at `bounds.max_workers`, then the fewest
    workers that serve the peak with them); a source not named gets 1 worker."""
    out: dict[str, tuple[int, int]] = {}
    for c in costs:
        need = source_cores(c, peak_shares.get(c.name, 0.0), tokens_per_s) * bounds.headroom
        cap = min(bounds.max_per_source, c.max_partitions)
        setting = (workers or {}).get(c.name, 1)
        w_max = bounds.max_workers if setting == "auto" else max(1, int(setting))
        n = partitions_needed(source_cores(c, peak_shares.get(c.name, 0.0), tokens_per_s), w_max, bounds)
        if n > cap:
            raise PartitionError(f"source {c.name}: needs {need:.2f} cores at its peak share {peak_shares.get(c.name, 0.0):.3f}, "
                                 f"more than {cap} partitions x {bounds.capacity(w_max):g} cores (w_src {bounds.max_per_source}, "
                                 f"data-parallel bound {c.max_partitions}, {w_max} worker(s) a partition)")
        w = w_max
        if setting == "auto":  # the fewest threads that still serve the peak with n partitions
            w = next(k for k in range(1, w_max + 1) if n * bounds.capacity(k) >= need - 1e-9)
        out[c.name] = (n, w)
    return out


def _round_up(x: float, q: float) -> float:
    return round(math.ceil(x / q - 1e-9) * q, 6)


def _pod_name(members: Sequence[tuple[str, int]]) -> str:
    srcs = list(dict.fromkeys(s for s, _ in members))
    if len(srcs) == 1:
        reps = [r for _, r in members]
        lo, hi = min(reps), max(reps)
        return f"{srcs[0]}-{lo}" if lo == hi else f"{srcs[0]}-{lo}-{hi}"
    s0, r0 = members[0]
    return f"{s0}-{r0}-g{len(members)}"


def pack_pods(costs: Sequence[SourceCost], partitions: Mapping[str, int], shares: Mapping[str, float], tokens_per_s: float,
              bounds: PartitionBounds, budget: LoaderBudget | None = None, *, what: str = "mixture",
              workers: Mapping[str, int] | None = None) -> PodPlan:
    """Group partitions into loader pods for one mixture.

    By default a source that needs at least `bounds.small_source_cpu` cores gets pods of its own (seed §5.3:
    dedicated loaders keep feeding stable when weights diverge); smaller sources share pods. When that does
    not fit the memory budget, every source may share (fewer pods, fewer interpreters). `workers`: threads per
    partition of each source (PartitionPlan.workers; absent: 1): a pod holds what its partitions' threads can do
    (`bounds.capacity`), so its CPU request may exceed one core."""
    plan = _pack(costs, partitions, shares, tokens_per_s, bounds, mixed=False, workers=workers)
    if budget is not None and plan.memory > budget.memory:
        mixed = _pack(costs, partitions, shares, tokens_per_s, bounds, mixed=True, workers=workers)
        if mixed.memory > budget.memory:
            raise PartitionError(f"{what}: loaders need {mixed.memory / MIB:.0f} MiB in {len(mixed.pods)} pods even with "
                                 f"sources sharing pods (w_actor {bounds.max_per_pod}), budget {budget.memory / MIB:.0f} MiB")
        plan = mixed
    if budget is not None and plan.cpu > budget.cpu + 1e-9:
        raise PartitionError(f"{what}: loaders need {plan.cpu:.2f} cores, budget {budget.cpu:g} cores")
    return plan


def _pack(costs: Sequence[SourceCost], partitions: Mapping[str, int], shares: Mapping[str, float], tokens_per_s: float,
          bounds: PartitionBounds, *, mixed: bool, workers: Mapping[str, int] | None = None) -> PodPlan:
    order = {c.name: i for i, c in enumerate(costs)}
    by_name = {c.name: c for c in costs}
    groups: dict[str, list[tuple[float, float, str, int]]] = {}  # packing group -> (cost, demand, source, partition)
    for c in costs:
        n = partitions[c.name]
        total = source_cores(c, shares.get(c.name, 0.0), tokens_per_s)
        # a source without weight needs no running loader (the planner does not wait for it): its partitions
        # go to pods of their own, which the builders run with 0 replicas until the weight comes back
        key = "~idle" if total <= 0 else "" if mixed or total * bounds.headroom < bounds.small_source_cpu else c.name
        groups.setdefault(key, []).extend((c.cpu_s_per_token, total / n, c.name, r) for r in range(n))
    pods: list[LoaderPod] = []
    for key in sorted(groups, key=lambda k: (k == "~idle", k == "", min(order[i[2]] for i in groups[k]))):
        items = groups[key]
        # clustering: expensive sources first, partitions of one source together, bigger demand first
        items.sort(key=lambda t: (-t[0], -t[1], order[t[2]], t[3]))
        bins: list[dict] = []
        for _, d, s, r in items:
            dh = d * bounds.headroom
            room = bounds.capacity((workers or {}).get(s, 1))  # a pod: the least its partitions' threads can do
            for b in bins:
                if len(b["members"]) < bounds.max_per_pod and b["load"] + dh <= min(b["room"], room) + 1e-9:
                    b["room"] = min(b["room"], room)
                    break
            else:
                b = {"members": [], "load": 0.0, "demand": {}, "room": room}
                bins.append(b)
            b["members"].append((s, r))
            b["load"] += dh
            b["demand"][s] = b["demand"].get(s, 0.0) + d
        for b in bins:
            members = tuple(sorted(b["members"], key=lambda m: (order[m[0]], m[1])))
            cpu = max(bounds.min_pod_cpu, _round_up(b["load"], bounds.cpu_quantum))
            mem = bounds.pod_base_memory + sum(by_name[s].memory_per_partition for s, _ in members)
            demand = tuple(sorted(b["demand"].items(), key=lambda x: order[x[0]]))
            pods.append(LoaderPod(_pod_name(members), members, cpu, int(math.ceil(mem / MIB) * MIB), demand))
    seen: dict[str, int] = {}
    for i, p in enumerate(pods):
        k = seen.get(p.name, -1) + 1
        seen[p.name] = k
        if k:
            pods[i] = LoaderPod(f"{p.name}-{k}", p.members, p.cpu, p.memory, p.source_demand)
    return PodPlan(dict(shares), tuple(pods))


def auto_partition(costs: Sequence[SourceCost], schedule: Sequence[tuple[int, Mapping[str, float]]], tokens_per_s: float,
                   budget: LoaderBudget, bounds: PartitionBounds | None = None,
                   partitions: Mapping[str, int] | None = None,
                   workers: Mapping[str, int | str] | None = None) -> PartitionPlan:
    """The plan for a whole schedule: `schedule` is (start step, token share per source) per segment.

    `partitions`: the counts a running mixture already has (its sources are split that way; changing the
    split mid-run would reshuffle the data), used instead of computing them. `workers`: each source's
    `workers` setting (spec_workers(spec)); the plan's `workers` are the threads chosen per partition."""
    bounds = bounds or PartitionBounds()
    if not costs:
        raise PartitionError("no sources to partition")
    if not schedule:
        raise PartitionError("the schedule has no segment")
    if not (math.isfinite(tokens_per_s) and tokens_per_s > 0):
        raise PartitionError(f"tokens_per_s must be a finite number > 0, got {tokens_per_s}")
    names = [c.name for c in costs]
    for start, shares in schedule:
        unknown = sorted(set(shares) - set(names))
        if unknown:
            raise PartitionError(f"segment at step {start}: unknown source(s) {', '.join(unknown)}")
    peak = {n: max(float(sh.get(n, 0.0)) for _, sh in schedule) for n in names}
    if partitions is not None and all(partitions.get(n, 0) >= 1 for n in names):
        parts = {n: int(partitions[n]) for n in names}
        # a kept split: a number of workers stays; `auto` gets the fewest threads serving the peak with those partitions
        threads: dict[str, int] = {}
        for c in costs:
            setting = (workers or {}).get(c.name, 1)
            if setting != "auto":
                threads[c.name] = max(1, int(setting))
                continue
            need = source_cores(c, peak[c.name], tokens_per_s) * bounds.headroom
            threads[c.name] = next((k for k in range(1, bounds.max_workers + 1)
                                    if parts[c.name] * bounds.capacity(k) >= need - 1e-9), bounds.max_workers)
    else:
        layout = partition_layout(costs, peak, tokens_per_s, bounds, workers)
        parts = {n: p for n, (p, _) in layout.items()}
        threads = {n: w for n, (_, w) in layout.items()}
    memory_floor = sum(parts[c.name] * c.memory_per_partition for c in costs)
    if memory_floor > budget.memory:
        worst = max(costs, key=lambda c: parts[c.name] * c.memory_per_partition)
        raise PartitionError(f"partitions alone need {memory_floor / MIB:.0f} MiB, budget {budget.memory / MIB:.0f} MiB "
                             f"(largest: source {worst.name}, {parts[worst.name]} x {worst.memory_per_partition / MIB:.0f} MiB)")
    segs = tuple((int(start), pack_pods(costs, parts, shares, tokens_per_s, bounds, budget, what=f"segment at step {start}",
                                        workers=threads))
                 for start, shares in sorted(schedule, key=lambda x: x[0]))
    return PartitionPlan(parts, {c.name: c for c in costs}, tokens_per_s, segs, threads)


def peak_shares(plan: PartitionPlan) -> dict[str, float]:
    """The largest share each source has anywhere in the schedule (what a layout fixed for the run must serve)."""
    return {n: max(float(pp.weights.get(n, 0.0)) for _, pp in plan.segments) for n in plan.partitions}


@dataclass(frozen=True)
class SidecarPlacement:
    """Sidecar placement (MegaScale-Data §7, hybrid deployment): which loader pods run as containers of which trainer pod.

    `slots[k]` are the loader pods of trainer pod k (its `mixplane.io/trainer-index`); `remote` the ones that did
    not fit any trainer pod's sidecar budget, which run as loader pods of their own (scale-out)."""

    slots: tuple[tuple[LoaderPod, ...], ...]
    remote: tuple[LoaderPod, ...]

    def slot_of(self) -> dict[str, int]:
        """Loader pod name -> trainer slot."""
        return {p.name: k for k, pods in enumerate(self.slots) for p in pods}


def place_sidecars(pods: PodPlan, slots: int, cpu: float, memory: int) -> SidecarPlacement:
    """Put loader pods into `slots` trainer pods with `cpu` cores and `memory` bytes each for sidecars.

    Biggest first, each onto the least loaded trainer pod that still holds it (spreads the loaders over the
    nodes); what fits nowhere stays remote. Pods whose sources have no weight anywhere stay remote (they run
    0 replicas); a sidecar cannot be stopped without restarting its trainer pod."""
    if slots < 1:
        raise PartitionError(f"sidecar placement needs at least one trainer pod, got {slots}")
    load = [[0.0, 0] for _ in range(slots)]
    placed: list[list[LoaderPod]] = [[] for _ in range(slots)]
    remote: list[LoaderPod] = []
    for p in sorted(pods.pods, key=lambda p: (p.idle, -p.cpu, -p.memory, p.name)):
        fits = [k for k in range(slots) if not p.idle and load[k][0] + p.cpu <= cpu + 1e-9 and load[k][1] + p.memory <= memory]
        if not fits:
            remote.append(p)
            continue
        k = min(fits, key=lambda k: (load[k][0], k))
        load[k][0] += p.cpu
        load[k][1] += p.memory
        placed[k].append(p)
    order = {p.name: i for i, p in enumerate(pods.pods)}
    return SidecarPlacement(tuple(tuple(sorted(s, key=lambda p: order[p.name])) for s in placed),
                            tuple(sorted(remote, key=lambda p: order[p.name])))


def idle_fraction(plan: PodPlan, demand_cores: float) -> float:
    """Share of the pods' requested CPU not needed to meet `demand_cores`."""
    return 0.0 if plan.cpu <= 0 else max(0.0, 1.0 - demand_cores / plan.cpu)


def spec_schedule(spec: DataMixtureSpec, mean_tokens: Mapping[str, float] | None = None) -> list[tuple[int, dict[str, float]]]:
    """Token shares per schedule segment of a spec (phases, anneal, temperature applied).

    With `mixture.unit: samples` the weights count samples; `mean_tokens` (tokens per sample, from the
    profile) turns them into token shares, which is what loader CPU follows."""
    from mixplane.mixing import MixtureSchedule

    sched = MixtureSchedule(spec)
    names = sched.names
    out = []
    for seg in sched.segments:
        probs = [float(p) for p in sched.at(seg.start_step).probs]
        if spec.mixture.unit == "samples" and mean_tokens:
            probs = [p * float(mean_tokens.get(n, 1.0)) for p, n in zip(probs, names)]
            total = sum(probs) or 1.0
            probs = [p / total for p in probs]
        out.append((int(seg.start_step), dict(zip(names, probs))))
    return out


def with_partitions(spec: DataMixtureSpec, partitions: Mapping[str, int],
                    workers: Mapping[str, int] | None = None) -> DataMixtureSpec:
    """The spec with each source's `replicas` set to its planned partitions (what loaders and planner read), and
    with `workers` (PartitionPlan.workers) each `auto` source's worker threads set to the planned count."""
    sources = []
    for s in spec.sources:
        up: dict[str, int] = {"replicas": int(partitions.get(s.name, s.replicas))}
        if workers is not None and s.workers == "auto" and s.name in workers:
            up["workers"] = int(workers[s.name])
        sources.append(s.model_copy(update=up))
    return spec.model_copy(update={"sources": sources})


def spec_workers(spec: DataMixtureSpec) -> dict[str, int | str]:
    """Each source's `workers` setting, as auto_partition takes it."""
    return {s.name: s.workers for s in spec.sources}


if TYPE_CHECKING:  # pragma: no cover
    from mixplane.spec import DataMixtureSpec

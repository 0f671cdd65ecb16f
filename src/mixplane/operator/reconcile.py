"""What one DataMixture should look like in the cluster: pure functions from the object to its children and status.

The kopf handlers (mixplane.operator.handlers) call these and only do the I/O: apply the objects, patch
the status, ask the planner for STATUS or send UPDATE_MIXTURE.

Operator inputs that are not part of the data plane's spec ride on annotations of the DataMixture, parsed once a
pass into a MixtureAnnotations (mixplane.operator.annotations, which lists them and the ones that are not inputs).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from mixplane.operator.autopartition import (
    LoaderPod,
    PartitionBounds,
    PartitionPlan,
    PodPlan,
    SidecarPlacement,
    SourceCost,
    auto_partition,
    pack_pods,
    peak_shares,
    place_sidecars,
    source_cores,
    spec_schedule,
    spec_workers,
    with_partitions,
)
from mixplane.operator.annotations import MixtureAnnotations, ReconcileError, annotations_of
from mixplane.operator.builders import (
    ClusterOptions,
    owner_reference,
    render_mixture,
    sidecar_containers,
    sidecar_volumes,
    trainer_pods,
    spec_options,
)

# used only when a source cannot be profiled (the status says so): cautious, an image costs far more
FALLBACK_COST = {"text": 2e-6, "tokens": 2e-7, "image_text": 1e-4}
FALLBACK_MEMORY = 96 << 20


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def spec_of(body: Mapping[str, Any]) -> Any:
    """The validated spec of a DataMixture object (its name defaults to metadata.name)."""
    from mixplane.spec import SpecError, parse_spec

    doc = dict(body.get("spec") or {})
    doc.setdefault("name", body["metadata"]["name"])
    try:
        return parse_spec(doc)
    except SpecError as e:
        raise ReconcileError("; ".join(f"spec.{p}" for p in e.problems)) from None


# ---- profile: measured once, kept in the status ---------------------------------------------------
def profile_from_status(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The profile kept in status.sources[*].profile, when every source of the spec has one."""
    status = body.get("status") or {}
    if any(c.get("reason") == "FallbackCosts" for c in status.get("conditions") or [] if isinstance(c, dict)):
        return None  # costs by kind are not a profile: measure again when the sources can be read
    sources = status.get("sources") or []
    names = [str(s.get("name")) for s in (body.get("spec") or {}).get("sources") or []]
    found: dict[str, dict[str, Any]] = {str(s.get("name")): s["profile"] for s in sources if isinstance(s, dict) and s.get("profile")}
    if not names or any(n not in found for n in names) or any(found[n].get("measuredBy") == "fallback" for n in names):
        return None  # costs by kind (e.g. while profiling again after a failed Job) are not a profile either
    if (any(not found[n].get("filesListed") for n in names)
            and any(_pages_for_blocks(s, found[s.name]) for s in _spec_sources(body))):
        return None  # an older mixplane's profile: its max_partitions may count the pages of a block-read source
    return {"version": 1, "sources": {n: {"cpu_s_per_token": found[n]["cpuSecondsPerToken"],
                                          "memory_per_partition": found[n]["memoryPerPartition"],
                                          "mean_tokens_per_sample": found[n].get("meanTokens"),
                                          "max_partitions": found[n].get("maxPartitions", 1 << 20),
                                          **({"files_listed": found[n]["filesListed"]} if found[n].get("filesListed") else {}),
                                          **({"measured_by": found[n]["measuredBy"]} if found[n].get("measuredBy") else {}),
                                          **({"image_costs": _image_costs_from_status(found[n]["imageCosts"])}
                                             if isinstance(found[n].get("imageCosts"), Mapping) else {})}
                                      for n in names}}


def _spec_sources(body: Mapping[str, Any]) -> list[Any]:
    try:
        return list(spec_of(body).sources)
    except ReconcileError:
        return []  # an invalid spec is reported where it is parsed for the pass


def _pages_for_blocks(s: Any, kept: Mapping[str, Any]) -> bool:
    """Whether a kept profile's maxPartitions may exceed the blocks of a source read block by block: a profile that
    records no file count (`filesListed`: mixplane profile capped max_partitions at the blocks since it records
    one), measured (not the annotation's), of a source that may be read block by block
    (`SourceSpec.block_read_from`), above the fewest blocks such a source has (ceil(lazy_index_files / block_files):
    a cap below that is one already)."""
    if kept.get("filesListed") or kept.get("measuredBy") == "annotation":
        return False
    start = s.block_read_from
    if start is None:
        return False
    return int(kept.get("maxPartitions") or (1 << 20)) > -(-start // s.block_files)


def _image_costs_from_status(ic: Mapping[str, Any]) -> dict[str, Any]:
    return {"decode_s": ic.get("decodeSeconds"), "raw_bytes": ic.get("rawBytes"), "decoded_bytes": ic.get("decodedBytes"),
            "images": ic.get("images")}


def with_decode_places(spec: Any, profile: Mapping[str, Any]) -> Any:
    """`spec` with every image source's ``image.decode_at: auto`` resolved as the embedded runtime resolves it
    (`imagedecode.choose_decode_place`, one image reaching one rank) from the profile's image costs; the loader where
    the profile has none (costs by kind, an annotation without them). Every component then reads the same concrete
    place from the resolved spec, and the planner journals it. The place never changes a batch, only where the CPU
    is spent and what the wire carries."""
    from mixplane.imagedecode import choose_decode_place
    from mixplane.profile_message import image_costs_from_profile

    auto = {s.name for s in spec.sources if s.kind == "image_text" and s.image.decode_at == "auto"}
    if not auto:
        return spec
    costs = image_costs_from_profile(profile)  # PartitionError (a ValueError) names the source: desired() reports it
    sources = []
    for s in spec.sources:
        if s.name in auto:
            c = costs.get(s.name)
            place = choose_decode_place(c, consumers=1) if c is not None else "loader"
            s = s.model_copy(update={"image": s.image.model_copy(update={"decode_at": place})})
        sources.append(s)
    return spec.model_copy(update={"sources": sources})


def fallback_profile(spec: Any) -> dict[str, Any]:
    """Costs by kind for sources that could not be profiled (marked `source: fallback` in the status)."""
    return {"version": 1, "sources": {s.name: {"cpu_s_per_token": FALLBACK_COST[s.kind], "memory_per_partition": FALLBACK_MEMORY,
                                               "max_partitions": 1 if s.live else 1 << 20, "source": "fallback",
                                               "measured_by": "fallback"}
                                      for s in spec.sources}}


@dataclass(frozen=True)
class ProfileOutcome:
    """Where the profiling Jobs of a mixture are: `pending` (some still run), `done` (every source measured) or
    `failed` (a Job gave up: `profile` then holds what was measured plus costs by kind for the rest)."""

    state: str
    profile: dict[str, Any] | None
    message: str


def _terminated(pod: Mapping[str, Any]) -> dict[str, Any] | None:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == "profile":
            return ((cs.get("state") or {}).get("terminated")) or ((cs.get("lastState") or {}).get("terminated")) or None
    return None


def _pod_failure(pod: Mapping[str, Any]) -> str | None:
    """Why one profiling pod failed (its redacted error message, else the kubelet's reason), None if it did not."""
    from mixplane.profile_message import parse_message

    t = _terminated(pod)
    name = (pod.get("metadata") or {}).get("name", "?")
    if t is None:
        return f"pod {name}: {(pod.get('status') or {}).get('reason')}" if (pod.get("status") or {}).get("phase") == "Failed" else None
    if t.get("exitCode") == 0:
        return None
    try:
        err = parse_message(t.get("message") or "").get("error")
    except ValueError:
        err = None
    return f"pod {name}: " + (err or f"{t.get('reason') or 'Error'} (exit code {t.get('exitCode')})")


def job_outcome(job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]], sources: Sequence[str]) -> ProfileOutcome:
    """One profiling Job from the API server's view of it and its pods: the measured profile of `sources` (from a
    succeeded pod's termination message), a failure (the Job gave up: backoff limit, deadline) or still pending."""
    from mixplane.profile_message import parse_message

    name = (job.get("metadata") or {}).get("name", "?")
    for pod in pods:
        t = _terminated(pod)
        if t is None or t.get("exitCode") != 0:
            continue
        try:
            doc = parse_message(t.get("message") or "")
        except ValueError as e:
            return ProfileOutcome("failed", None, f"Job {name}: pod {pod['metadata'].get('name')} wrote no profile ({e})")
        got = doc.get("sources") or {}
        if "error" in doc or set(got) != set(sources):
            return ProfileOutcome("failed", None, f"Job {name}: the profile is not of sources {', '.join(sources)}")
        return ProfileOutcome("done", {"version": doc["version"], "sources": {n: {**got[n], "measured_by": "job"} for n in sources}}, "")
    failed = next((c for c in (job.get("status") or {}).get("conditions") or []
                   if c.get("type") == "Failed" and c.get("status") == "True"), None)
    if failed is None:
        return ProfileOutcome("pending", None, f"Job {name} profiling {', '.join(sources)}")
    why = [w for w in (_pod_failure(p) for p in pods) if w]
    detail = why[-1] if why else f"{failed.get('reason')}: {failed.get('message')}"
    return ProfileOutcome("failed", None, f"Job {name} failed ({failed.get('reason')}): {detail}")


def profile_outcome(spec: Any, jobs: Sequence[tuple[Mapping[str, Any] | None, Sequence[Mapping[str, Any]], Sequence[str]]]) -> ProfileOutcome:
    """All profiling Jobs of a mixture together ((job or None when not created yet, its pods, its sources) each):
    pending while any runs; done when all measured; failed when any gave up, with the measured sources kept and
    the others at costs by kind."""
    outs = [job_outcome(j, pods, names) if j is not None else ProfileOutcome("pending", None, "Job not created yet")
            for j, pods, names in jobs]
    if any(o.state == "pending" for o in outs):
        return ProfileOutcome("pending", None, "; ".join(o.message for o in outs if o.state == "pending"))
    merged = fallback_profile(spec)
    for o in outs:
        if o.profile is not None:
            merged["sources"].update(o.profile["sources"])
    failures = [o.message for o in outs if o.state == "failed"]
    return ProfileOutcome("failed" if failures else "done", merged, "; ".join(failures))


def costs_of(profile: Mapping[str, Any], spec: Any) -> list[SourceCost]:
    out = []
    for s in spec.sources:
        p = (profile.get("sources") or {}).get(s.name)
        if p is None:
            raise ReconcileError(f"profile has no source {s.name!r}")
        cap = 1 if s.live else int(p.get("max_partitions") or (1 << 20))
        out.append(SourceCost(s.name, float(p["cpu_s_per_token"]), int(p["memory_per_partition"]), cap))
    return out


# ---- the plan and the children --------------------------------------------------------------------
@dataclass(frozen=True)
class Desired:
    spec: Any  # resolved (replicas = partitions)
    plan: PartitionPlan
    step: int
    objects: list[dict[str, Any]]
    owner: dict[str, Any]
    pods: PodPlan | None = None  # the loader pods rendered (remote and sidecar); None: plan.pods_at(step)
    sidecars: SidecarPlacement | None = None  # sidecar placement: loader pods per trainer pod slot
    served: Mapping[str, int] | None = None  # partitions per source the planner serves (re-partitioned); None: the plan's

    def partitions(self) -> dict[str, int]:
        """Partitions per source now: those the planner serves after a re-partition, else the plan's split."""
        return {**self.plan.partitions, **(self.served or {})}


def trainer_slots(spec: Any) -> int:
    """Trainer pods that host sidecars: kubernetes.trainer_pods, else one per node of the topology."""
    return trainer_pods(spec)


def _at_shares(p: LoaderPod, shares: Mapping[str, float], costs: Mapping[str, SourceCost], partitions: Mapping[str, int],
               tokens_per_s: float) -> LoaderPod:
    """The pod with its sources' demand at `shares` (its size stays: its members are fixed for the run)."""
    demand: dict[str, float] = {}
    for s, _ in p.members:
        demand[s] = demand.get(s, 0.0) + source_cores(costs[s], float(shares.get(s, 0.0)), tokens_per_s) / partitions[s]
    return LoaderPod(p.name, p.members, p.cpu, p.memory, tuple(demand.items()))


def sidecar_layout(spec: Any, plan: PartitionPlan, costs: Sequence[SourceCost], tokens_per_s: float, bounds: PartitionBounds,
                   step: int) -> tuple[PodPlan, SidecarPlacement]:
    """Sidecar placement: loader pods sized for each source's peak share (containers of a running trainer pod cannot
    change, so the layout is fixed for the run), placed on the trainer pods' sidecar budget; the rest is remote.
    Returns every pod with its demand at `step` (a remote pod of sources without weight then runs 0 replicas)."""
    k = spec.kubernetes
    layout = pack_pods(costs, plan.partitions, peak_shares(plan), tokens_per_s, bounds, None, what="sidecar layout",
                       workers=plan.workers)
    placement = place_sidecars(layout, trainer_slots(spec), float(k.sidecar_cpu), int(k.sidecar_memory_mb) << 20)
    now = plan.pods_at(step).weights
    by_name = {c.name: c for c in costs}
    pods = tuple(_at_shares(p, now, by_name, plan.partitions, tokens_per_s) for p in layout.pods)
    return PodPlan(dict(now), pods), placement


def segments_of(spec: Any, profile: Mapping[str, Any]) -> list[tuple[int, dict[str, float]]]:
    mean = {n: p.get("mean_tokens_per_sample") or 1.0 for n, p in (profile.get("sources") or {}).items()}
    return spec_schedule(spec, mean)


def desired(body: Mapping[str, Any], opts: ClusterOptions, profile: Mapping[str, Any], keys: Mapping[str, tuple[str, str]],
            step: int = 0, bounds: PartitionBounds | None = None,
            shares: Mapping[str, float] | None = None, served: Mapping[str, int] | None = None,
            annotations: MixtureAnnotations | None = None) -> Desired:
    """Children of the mixture at `step` (the pods of that schedule segment, or of `shares` when the
    scaling policy decided them), each owned by the DataMixture.

    `served`: partitions per source the planner serves now (STATUS `source_partitions`) where a re-partition changed
    them. The spec the planner reads keeps the split it started with; the loader pods are packed for the served
    counts, and the re-partitioned sources' partitions are handed to them by the planner's table, not named in
    their launch lists (builders.mixture_launch_plan). Sidecar placement is never re-partitioned."""
    from mixplane.operator.autopartition import pack_pods

    bounds = bounds or PartitionBounds()
    spec = spec_of(body)
    inp = annotations if annotations is not None else annotations_of(body)  # the pass's, when it parsed them
    costs = costs_of(profile, spec)
    placement: SidecarPlacement | None = None
    try:
        spec_options(opts, spec)  # rank_binding: required that pod keys cannot meet (builders.pod_rank_keys) is refused here
        plan = plan_of(body, spec, profile, inp, bounds)
        spec = with_partitions(spec, plan.partitions, plan.workers)  # `workers: auto` -> the planned threads
        spec = with_decode_places(spec, profile)  # `image.decode_at: auto` -> the place its image costs choose
        moved = {n: int(m) for n, m in (served or {}).items() if n in plan.partitions and int(m) != plan.partitions[n]}
        if spec.kubernetes.placement == "sidecar":
            moved = {}
            pods, placement = sidecar_layout(spec, plan, costs, inp.tokens_per_s, bounds, step)
        elif moved:
            parts = {**plan.partitions, **moved}
            pods = pack_pods(costs, parts, plan.pods_at(step).weights if shares is None else shares, inp.tokens_per_s,
                             bounds, inp.budget, workers=plan.workers)
        else:
            pods = plan.pods_at(step) if shares is None else pack_pods(costs, plan.partitions, shares, inp.tokens_per_s, bounds,
                                                                       inp.budget, workers=plan.workers)
    except ValueError as e:
        raise ReconcileError(str(e)) from None
    if placement is not None:
        side = {p.name for s in placement.slots for p in s}
        remote = PodPlan(pods.weights, tuple(p for p in pods.pods if p.name not in side))
        resolved, objs = render_mixture(spec, opts, remote, plan.partitions, keys,
                                        [p for p in pods.pods if p.name in side])
    else:
        resolved, objs = render_mixture(spec, opts, pods, plan.partitions, keys, table_sources=sorted(moved))
    owner = owner_reference(body)
    for o in objs:
        o["metadata"]["ownerReferences"] = [dict(owner)]
    return Desired(resolved, plan, step, objs, dict(body), pods, placement, moved or None)


def plan_of(body: Mapping[str, Any], spec: Any, profile: Mapping[str, Any], inp: MixtureAnnotations,
            bounds: PartitionBounds) -> PartitionPlan:
    """The auto-partitioner's plan, keeping the split the status already has (a running split stays): the counts the
    planner started with (`startPartitions`; a status written before re-partitions had only `partitions`)."""
    kept = {str(s.get("name")): s.get("startPartitions", s.get("partitions"))
            for s in ((body.get("status") or {}).get("sources") or []) if isinstance(s, dict)}
    return auto_partition(costs_of(profile, spec), segments_of(spec, profile), inp.tokens_per_s, inp.budget, bounds,
                          partitions={k: int(v) for k, v in kept.items() if isinstance(v, int)} or None,
                          workers=spec_workers(spec))


def sidecar_injection(body: Mapping[str, Any], opts: ClusterOptions, profile: Mapping[str, Any], slot: int | None,
                      bounds: PartitionBounds | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(containers, volumes) the pod webhook adds to trainer pod `slot` of a sidecar-placed mixture; nothing for
    remote placement, an unknown slot, or a slot the placement left empty."""
    spec = spec_of(body)
    if spec.kubernetes.placement != "sidecar" or slot is None:
        return [], []
    bounds = bounds or PartitionBounds()
    inp = annotations_of(body)
    try:
        plan = plan_of(body, spec, profile, inp, bounds)
        spec = with_partitions(spec, plan.partitions, plan.workers)  # `workers: auto` -> the planned threads
        spec = with_decode_places(spec, profile)  # `image.decode_at: auto` -> the place its image costs choose
        step = int((body.get("status") or {}).get("step") or 0)
        pods, placement = sidecar_layout(spec, plan, costs_of(profile, spec), inp.tokens_per_s, bounds, step)
    except ValueError as e:
        raise ReconcileError(str(e)) from None
    if not 0 <= slot < len(placement.slots) or not placement.slots[slot]:
        return [], []
    opts = spec_options(opts, spec)
    return sidecar_containers(spec, opts, pods.pods, plan.partitions, placement.slots[slot]), sidecar_volumes(opts)


# ---- status -----------------------------------------------------------------------------------------
def condition(kind: str, ok: bool, reason: str, message: str, generation: int | None,
              previous: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """One condition; lastTransitionTime moves only when the status flips."""
    status = "True" if ok else "False"
    prev = next((c for c in previous if c.get("type") == kind), None)
    since = prev.get("lastTransitionTime") if prev and prev.get("status") == status else now()
    # never an empty message: a merge patch through kopf turns "" into null, which the schema refuses
    return {"type": kind, "status": status, "reason": reason, "message": (message or reason)[:1000], "lastTransitionTime": since,
            "observedGeneration": generation}


def planner_source_figures(st: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Per source what the running planner's STATUS says: the target weight now, the weight realised in the
    current phase, and the delivered tokens per second (status.sources[*] fields; empty without a STATUS)."""
    names = list(st.get("sources") or [])
    out: dict[str, dict[str, float]] = {n: {} for n in names}
    for key, field, digits, floor in (("target", "targetWeight", 6, None), ("realized_phase", "realisedWeight", 6, None),
                                      ("source_tokens_per_s", "deliveredTokensPerSecond", 3, 0.0)):
        values = list(st.get(key) or [])
        if len(values) == len(names):
            for n, x in zip(names, values):
                out[n][field] = round(float(x) if floor is None else max(floor, float(x)), digits)
    return {n: f for n, f in out.items() if f}


def _image_costs_status(ic: Mapping[str, Any]) -> dict[str, Any]:
    return {"decodeSeconds": float(ic.get("decode_s", 0.0)), "rawBytes": float(ic.get("raw_bytes", 0.0)),
            "decodedBytes": float(ic.get("decoded_bytes", 0.0)), "images": int(ic.get("images", 0))}


def status_of(body: Mapping[str, Any], d: Desired, opts: ClusterOptions, profile: Mapping[str, Any], *,
              ready: bool, progressing: tuple[bool, str, str], degraded: tuple[bool, str, str],
              planner_status: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The status patch: conditions, endpoint, step, and per source weights, partitions, pods, profile."""
    gen = (body.get("metadata") or {}).get("generation")
    prev = ((body.get("status") or {}).get("conditions")) or []
    pods = d.pods if d.pods is not None else d.plan.pods_at(d.step)
    slot_of = d.sidecars.slot_of() if d.sidecars is not None else {}
    step = d.step
    live = planner_source_figures(planner_status or {})
    if planner_status:
        step = max(0, int(planner_status.get("planned_through", step)))
    sources = []
    for s in d.spec.sources:
        p = (profile.get("sources") or {}).get(s.name, {})
        sources.append({
            "name": s.name, "targetWeight": round(float(pods.weights.get(s.name, 0.0)), 6), **live.get(s.name, {}),
            "partitions": int(d.partitions()[s.name]), "startPartitions": int(d.plan.partitions[s.name]),
            "loaderPods": sum(1 for x in pods.pods_of(s.name) if not x.idle and x.name not in slot_of),
            **({"sidecarPartitions": sum(1 for x in pods.pods_of(s.name) if x.name in slot_of for m in x.members if m[0] == s.name)}
               if d.sidecars is not None else {}),
            "profile": {"cpuSecondsPerToken": float(p.get("cpu_s_per_token", 0.0)), "memoryPerPartition": int(p.get("memory_per_partition", 0)),
                        **({"meanTokens": float(p["mean_tokens_per_sample"])} if p.get("mean_tokens_per_sample") else {}),
                        **({"maxPartitions": int(p["max_partitions"])} if p.get("max_partitions") else {}),
                        **({"filesListed": int(p["files_listed"])} if p.get("files_listed") else {}),
                        **({"measuredBy": p["measured_by"]} if p.get("measured_by") else {}),
                        **({"imageCosts": _image_costs_status(p["image_costs"])} if isinstance(p.get("image_costs"), Mapping) else {}),
                        },
            **({"decodeAt": s.image.decode_at} if s.kind == "image_text" and s.image.decode_at != "auto" else {}),
        })
    prog_ok, prog_reason, prog_msg = progressing
    deg_ok, deg_reason, deg_msg = degraded
    phase = "Degraded" if deg_ok else "Running" if ready else "Pending"
    return {
        "phase": phase, "observedGeneration": gen, "plannerEndpoint": opts.planner_endpoint, "step": step,
        "sourceCount": len(d.spec.sources), "loaderPods": sum(1 for x in pods.pods if not x.idle and x.name not in slot_of),
        # a slot without loaders has no `partitions` (an empty string reaches the API server as null through the
        # client's merge patch, which the CRD's schema refuses)
        **({"sidecars": [{"slot": k, "pods": [p.name for p in ps],
                          **({"partitions": parts} if (parts := ",".join(f"{s}:{r}" for p in ps for s, r in p.members)) else {}),
                          "cpu": round(sum(p.cpu for p in ps), 3)} for k, ps in enumerate(d.sidecars.slots)]}
           if d.sidecars is not None else {}),
        "conditions": [condition("Ready", ready, "ComponentsReady" if ready else "ComponentsNotReady",
                                 "planner, constructors and loaders are ready" if ready else "waiting for component pods", gen, prev),
                       condition("Progressing", prog_ok, prog_reason, prog_msg, gen, prev),
                       condition("Degraded", deg_ok, deg_reason, deg_msg, gen, prev)],
        "sources": sources,
    }


# ---- the object's size ------------------------------------------------------------------------------
# The API server writes a DataMixture to etcd in one request, and etcd refuses requests over 1.5 MiB (its
# --max-request-bytes default): an object that grows past it cannot be written at all, and every status patch
# would fail. The operator keeps the whole object (spec, metadata, status) under OBJECT_BUDGET_BYTES of compact
# JSON, a third under etcd's limit for what a pass does not see when it writes: the managedFields the API server
# adds for the patch (the status's field names again), kopf's annotations written after the pass, the encoding.
ETCD_REQUEST_LIMIT = 1_572_864
OBJECT_BUDGET_BYTES = 1 << 20
# status fields no pass reads back to decide anything (figures and records for people), left out in this order
# while the object is too large; the histories keep their last entry (a pass reads it to record a change once)
INFORMATIONAL = ("sidecars", "scaling")
HISTORIES = ("updates", "topologyChanges", "repartitions")
SOURCE_FIGURES = ("targetWeight", "realisedWeight", "deliveredTokensPerSecond", "loaderPods", "sidecarPartitions")
SIZE_CONDITION = "StatusTooLarge"


def object_bytes(body: Mapping[str, Any], status: Mapping[str, Any] | None) -> int:
    """Bytes of the object as compact JSON with `status` as its status."""
    doc = {k: v for k, v in body.items() if k != "status"}
    if status is not None:
        doc["status"] = status
    return len(json.dumps(doc, separators=(",", ":"), default=str).encode())


@dataclass(frozen=True)
class FittedStatus:
    """A status made to fit: what was left out (`dropped`, in words), the object's bytes before and after; `fits`
    False when even without every informational field it is over the budget."""

    status: dict[str, Any]
    dropped: tuple[str, ...]
    bytes_before: int
    bytes_after: int
    fits: bool


def fit_status(body: Mapping[str, Any], status: Mapping[str, Any], budget: int = OBJECT_BUDGET_BYTES) -> FittedStatus:
    """`status` (the whole status as it will be) without the informational fields it takes to keep the object within
    `budget` bytes of JSON: the sidecar and scaling records first, then the histories down to their last entry, then
    each source's live figures. What a pass reads to decide (profile, partitions, layout, scaler, the requests kept
    in the status) is never left out."""
    out = dict(status)
    before = size = object_bytes(body, out)
    dropped: list[str] = []
    steps: list[tuple[str, Any]] = [(k, None) for k in INFORMATIONAL] + [(k, "last") for k in HISTORIES] + [("sources", "figures")]
    for key, how in steps:
        if size <= budget:
            break
        value = out.get(key)
        if not value:
            continue
        if how is None:
            out.pop(key)
            dropped.append(key)
        elif how == "last":
            if len(value) <= 1:
                continue
            out[key] = list(value)[-1:]
            dropped.append(f"{key} but its last entry")
        else:
            out[key] = [{k: v for k, v in s.items() if k not in SOURCE_FIGURES} if isinstance(s, Mapping) else s
                        for s in value]
            dropped.append("sources[*] figures (" + ", ".join(SOURCE_FIGURES) + ")")
        size = object_bytes(body, out)
    return FittedStatus(out, tuple(dropped), before, size, size <= budget)


def size_condition(body: Mapping[str, Any], fitted: FittedStatus, previous: Sequence[Mapping[str, Any]] = (),
                   budget: int = OBJECT_BUDGET_BYTES) -> dict[str, Any] | None:
    """The StatusTooLarge condition for a fitted status: True when something was left out or it still does not fit
    (the message says what and the sizes), False when the stored conditions (`previous`) had it True and the status
    fits whole again, None when there is nothing to say."""
    gen = (body.get("metadata") or {}).get("generation")
    prev = [c for c in previous if isinstance(c, Mapping)]
    was = next((c for c in prev if c.get("type") == SIZE_CONDITION), None)
    limit = f"the operator's bound of {budget} bytes (etcd refuses objects over {ETCD_REQUEST_LIMIT})"
    if not fitted.fits:
        msg = (f"the DataMixture would take {fitted.bytes_before} bytes as JSON, over {limit}; even without "
               f"{', '.join(fitted.dropped) or 'its informational fields'} it takes {fitted.bytes_after}: the status "
               "is not written but for this condition (the spec, metadata.annotations or the sources are too large)")
        return condition(SIZE_CONDITION, True, "OverLimit", msg, gen, prev)
    if fitted.dropped:
        msg = (f"the DataMixture would take {fitted.bytes_before} bytes as JSON, over {limit}; left out: "
               f"{'; '.join(fitted.dropped)} ({fitted.bytes_after} bytes)")
        return condition(SIZE_CONDITION, True, "Trimmed", msg, gen, prev)
    if was is not None and was.get("status") == "True":
        return condition(SIZE_CONDITION, False, "WithinLimit", f"{fitted.bytes_after} bytes, within {limit}", gen, prev)
    return None


def bounded_patch(body: Mapping[str, Any], current: Mapping[str, Any], new: Mapping[str, Any],
                  budget: int = OBJECT_BUDGET_BYTES) -> tuple[dict[str, Any], FittedStatus]:
    """The merge patch that takes status `current` to `new` with the object kept within `budget` (fit_status), the
    StatusTooLarge condition set or cleared (size_condition) and the fields left out removed (null in the patch).
    When even the fitted status would not fit, the patch holds the conditions only: the stored status stays as it
    was (it fitted when it was written) and says why it is not updated."""
    whole = {**current, **new}
    fitted = fit_status(body, whole, budget)
    cond = size_condition(body, fitted, list(current.get("conditions") or []), budget)
    status = dict(fitted.status)
    if cond is not None:
        status["conditions"] = [c for c in status.get("conditions") or [] if c.get("type") != SIZE_CONDITION] + [cond]
    if not fitted.fits:
        return {"conditions": status["conditions"]}, fitted
    patch = {k: v for k, v in status.items() if current.get(k) != v}
    for k in current:
        if k not in status:
            patch[k] = None  # left out now: removed from the stored status
    return patch, fitted

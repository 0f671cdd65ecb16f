"""The operator's level-triggered reconcile as pure functions: what it observed in, what to do out.

One pass (`decide`) reads the DataMixture as it is now (spec, annotations, status), its loader Deployments, the
readiness of its components and the planner's STATUS (or None when unreachable), and returns:

  intent     the status fields that record *decisions* (scaling shares and the scaler's state, the loader layout
             being moved to and the hosts draining, the live update being sent, the scaling decisions). The shell
             writes it first, so an operator killed in the middle of acting finds its decision in the status and
             carries it out again (every action below is idempotent);
  apply      the children to (re-)apply, or none when status.children says this very set is applied;
  handoffs   partitions to move to the host the layout wants (the planner's HANDOFF, at a step boundary);
  delete     loader Deployments outside the layout that the planner's table shows serve nothing. A Deployment is
             never deleted while its host serves a partition, nor while the planner cannot be asked;
  update     the UPDATE_MIXTURE meta to send now (whole mixture, idempotent id), or None;
  topology   the RESHARD to send now for a patched spec.topology (idempotent id, no cursor: the planner takes the
             first step it has not planned). Until the planner acknowledged it the children stay those of the world
             it serves (operator/topology.py: served_body), with the new world's trainer keys issued beside;
  repartition  the REPARTITION to send now for a source the scaler wants read by more partitions (idempotent id;
             operator/repartitions.py). The loader layout is packed for the partitions the planner serves (STATUS
             `source_partitions`): the new partitions get pods once it applied the change, then move to them by
             HANDOFF like any change of the layout;
  status     the rest of the status (phase, conditions, per source figures), written after acting.

Nothing is kept in the operator's memory: a restarted operator (or a new version of it) continues from the status
and what it observes. A status written by an operator that kept its decisions in memory has no `layout`: the
loader Deployments that exist are then the active layout, and none is deleted before the planner moved its
partitions.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from mixplane.operator.annotations import MixtureAnnotations, annotations_of
from mixplane.operator.builders import ANN_HOST, ANN_SHADOW_OF, API_GROUP, ClusterOptions, pod_rank_keys
from mixplane.operator.reconcile import (
    Desired,
    condition,
    costs_of,
    desired,
    now as now_text,
    plan_of,
    planner_source_figures,
    segments_of,
    spec_of,
    status_of,
)
from mixplane.operator.autopartition import PartitionBounds
from mixplane.operator.scaling import Decision, MixtureScaler, Observation, ScalingConfig, handoff_moves
from mixplane.operator import repartitions as rp_state
from mixplane.operator import topology as topo_state
from mixplane.operator.requests import RequestPlan
from mixplane.operator.topology import plan_topology, served_body
from mixplane.operator.updates import condition_of, history, plan_update

RESYNC_S = 300.0  # children are re-applied at least this often (someone may have deleted or edited one)
DECISIONS = 20


@dataclass(frozen=True)
class Observed:
    body: Mapping[str, Any]  # the DataMixture as read at the start of the pass
    opts: ClusterOptions
    profile: Mapping[str, Any]
    keys: Mapping[str, tuple[str, str]]
    loaders: Mapping[str, Mapping[str, Any]]  # the mixture's loader Deployments now, by name
    planner: Mapping[str, Any] | None  # planner STATUS; None: not reachable
    ready: tuple[bool, str]  # (all components ready, who is not)
    now: float  # wall clock, seconds since the epoch
    scale_interval_s: float = 30.0
    profiling: Mapping[str, Any] | None = None  # status.profiling entry when the profile came from Jobs
    profile_failure: str = ""
    # the body's annotations, parsed once for the whole pass (the shell passes what it parsed; else from `body`)
    annotations: MixtureAnnotations | None = None

    def __post_init__(self) -> None:
        if self.annotations is None:
            object.__setattr__(self, "annotations", annotations_of(self.body))

    @property
    def inputs(self) -> MixtureAnnotations:
        assert self.annotations is not None  # (set in __post_init__)
        return self.annotations


@dataclass(frozen=True)
class Actions:
    desired: Desired
    intent: dict[str, Any]
    apply: list[dict[str, Any]]
    children_hash: str
    handoffs: list[tuple[str, str]]
    delete: list[str]
    update: RequestPlan
    status: dict[str, Any]
    decisions: list[Decision] = field(default_factory=list)
    draining: list[str] = field(default_factory=list)
    topology: RequestPlan | None = None
    repartition: RequestPlan | None = None


def desired_hosts(d: Desired) -> dict[str, str]:
    """partition "src:r" -> the loader host (launch component name) the rendered layout puts it on (its primary)."""
    out = {}
    for obj in d.objects:
        ann = obj["metadata"].get("annotations") or {}
        if obj["kind"] == "Deployment" and ANN_HOST in ann and ANN_SHADOW_OF not in ann and obj["spec"].get("replicas", 1):
            for p in filter(None, ann.get(f"{API_GROUP}/partitions", "").split(",")):
                out[p] = ann[ANN_HOST]
    return out


def standby_hosts(d: Desired) -> dict[str, set[str]]:
    """primary host -> its shadows' hosts in the rendered layout (a partition a shadow serves after a failover is
    where the layout wants it: it is not handed back)."""
    out: dict[str, set[str]] = {}
    for obj in d.objects:
        ann = obj["metadata"].get("annotations") or {}
        if obj["kind"] == "Deployment" and ANN_SHADOW_OF in ann:
            out.setdefault(ann[ANN_SHADOW_OF], set()).add(ann[ANN_HOST])
    return out


def children_hash(objects: Sequence[Mapping[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(list(objects), sort_keys=True, default=str).encode()).hexdigest()[:20]


def _status(body: Mapping[str, Any]) -> dict[str, Any]:
    return dict(body.get("status") or {})


def run_scaler(obs: Observed, spec: Any, step: int, served: Mapping[str, int] | None = None
               ) -> tuple[dict[str, float] | None, dict[str, Any] | None, list[Decision]]:
    """One interval of the scaling policy when it is due: (shares or None when it never decided, the scaler's state
    to keep, the decisions of this interval). Not due, or no planner to observe: the kept shares and state.
    `served`: the partitions the planner reads each source with (a re-partition it applied is taken by the policy)."""
    st = _status(obs.body)
    layout = dict(st.get("layout") or {})
    kept_shares = layout.get("shares")
    kept = dict(st.get("scaler") or {})
    if obs.planner is None or obs.now - float(kept.get("observedAt") or 0.0) < obs.scale_interval_s * 0.999:
        return kept_shares, (kept or None), []
    costs = costs_of(obs.profile, spec)
    inp = obs.inputs
    segs = segments_of(spec, obs.profile)
    parts = {s["name"]: s["partitions"] for s in st.get("sources") or [] if isinstance(s, Mapping) and s.get("partitions")}
    parts.update({n: int(m) for n, m in (served or {}).items() if n in parts and int(m) >= 1})
    if len(parts) != len(costs):
        return kept_shares, (kept or None), []
    try:  # the worker threads of each source's partitions (a number as the spec says, `auto` as planned)
        workers = dict(plan_of(obs.body, spec, obs.profile, inp, PartitionBounds()).workers)
    except ValueError:
        return kept_shares, (kept or None), []  # a plan that cannot be made: desired() says why
    now_step = max(0, int(obs.planner.get("planned_through", 0)))  # -1 before the first plan
    sc = MixtureScaler(costs, parts, segs, [sh for s, sh in segs if s <= now_step][-1], inp.tokens_per_s, budget=inp.budget,
                       workers=workers, config=ScalingConfig(shrink=inp.repartition == "follow"))
    if kept.get("state"):
        try:
            sc.load_state_dict(kept["state"])
        except (ValueError, TypeError, KeyError):
            pass  # a state of another set of sources (the mixture changed them): start the policy afresh
    for n, m in parts.items():
        if sc.partitions.get(n) != int(m):
            sc.repartitioned(n, int(m))  # applied by the planner (or its state is older): packed for them
    tps = inp.tokens_per_s
    last = kept.get("last") or {}
    planned = float(obs.planner.get("tokens_planned", 0) or 0)
    if last:
        dt = obs.now - float(last.get("time") or 0.0)
        if dt > 0 and planned > float(last.get("tokensPlanned") or 0):
            tps = (planned - float(last["tokensPlanned"])) / dt
    if inp.scale_on == "declared":
        tps = inp.tokens_per_s  # the mixture asked to be sized for its declared trainer rate, not the measured one
    # while partitions are handed over (and the interval after) the planner waits for the moving windows: that says
    # nothing about what a source costs
    # (and while a re-partition is pending or was just applied: the new partitions open cold windows)
    repartitioning = (st.get("repartition") or {}).get("state") not in (None, "Acknowledged")
    settling = bool(layout.get("draining")) or bool(layout.get("settling")) or repartitioning
    # (and a mixture whose costs are the profile's, `scale-costs: profiled`, is never corrected by what was measured)
    measured = not settling and inp.scale_costs == "measured"
    waiting = frozenset(str(w).split("/")[0] for w in obs.planner.get("waiting") or []) if measured else frozenset()
    delivered = delivered_rates(obs.planner)
    decisions = sc.observe(Observation(step, tps, waiting, delivered))
    shares = sc.shares(inp.tokens_per_s) if decisions else kept_shares
    state = {"observedAt": round(obs.now, 3), "last": {"time": round(obs.now, 3), "tokensPlanned": planned},
             "state": sc.state_dict()}
    return shares, state, decisions


def delivered_rates(st: Mapping[str, Any]) -> dict[str, float]:
    """Per source tokens/s the planner measured (STATUS source_tokens_per_s, in `sources` order)."""
    names = list(st.get("sources") or [])
    rates = list(st.get("source_tokens_per_s") or [])
    return {n: float(r) for n, r in zip(names, rates)} if len(names) == len(rates) else {}


def loader_moves(obs: Observed, d: Desired) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """(handoffs to request, loader Deployments to delete, hosts draining) to reach the layout of `d`."""
    want = desired_hosts(d)
    keep = {o["metadata"]["name"] for o in d.objects if o["kind"] == "Deployment"}
    old = {name: str((dep.get("metadata", {}).get("annotations") or {}).get(ANN_HOST) or name)
           for name, dep in obs.loaders.items() if name not in keep}
    if obs.planner is None:
        return [], [], sorted(set(old.values()))  # nobody can say what they serve: every old loader stays
    table = {"partitions": obs.planner.get("partitions") or {}, "hosts": obs.planner.get("hosts") or {}}
    moves, draining = handoff_moves(want, table)
    standby = standby_hosts(d)
    current = {p: (a.get("host") if isinstance(a, Mapping) else None) for p, a in table["partitions"].items()}
    moves = [(p, to) for p, to in moves if current.get(p) not in standby.get(to, set())]
    draining = {h for h in draining if not any(h in hs for hs in standby.values())}
    serving = {str(a.get("host")) for a in table["partitions"].values() if isinstance(a, Mapping) and a.get("host")}
    delete = sorted(n for n, h in old.items() if h not in serving)
    return moves, delete, sorted(h for h in set(old.values()) if h in serving | draining)


def decide(obs: Observed) -> Actions:
    """One level-triggered pass (see the module docstring). Raises ReconcileError for an object that cannot be
    turned into children (the shell reports it as the Failed phase)."""
    body = obs.body
    st = _status(body)
    spec = spec_of(body)
    step = int(obs.planner.get("planned_through", 0)) if obs.planner else int(st.get("step") or 0)
    step = max(0, step)
    served = rp_state.served_partitions(body, obs.planner)
    shares, scaler_state, decisions = run_scaler(obs, spec, step, served)
    try:
        new_keys = pod_rank_keys(spec)
    except ValueError as e:
        from mixplane.operator.reconcile import ReconcileError

        raise ReconcileError(f"spec.topology: {e}") from None
    topo = plan_topology(body, spec, obs.planner, obs.now, new_keys)
    opts = obs.opts
    if topo.pending:  # the new world's trainer keys are issued now, its children once the planner switched to it
        opts = replace(opts, extra_rank_keys=new_keys)
    d = desired(served_body(body, topo.state), opts, obs.profile, obs.keys, step=step, shares=shares, served=served,
                annotations=obs.inputs)
    moves, delete, draining = loader_moves(obs, d)
    upd = plan_update(body, spec, obs.planner, obs.now)
    hold = (f"waiting for the handoff to the loader layout to finish (draining {', '.join(draining)})" if draining
            else "waiting for the topology change" if topo.pending else None)
    rp = rp_state.plan_repartition(body, [s.name for s in spec.sources], obs.planner, served or d.partitions(),
                                   scaler_state if scaler_state is not None else st.get("scaler"), obs.now, hold=hold,
                                   enabled=spec.kubernetes.placement != "sidecar",
                                   layout_hosts=set(desired_hosts(d).values()))
    if rp is not None and (rp.send or (rp.pending and rp.state.get("acceptedStep") is not None)):
        # sent now or accepted: the planner applies it at a later step, giving new partitions to hosts of a table
        # observed before; no Deployment goes before the application is seen (a refused or unsent one holds nothing)
        delete = []

    layout_prev = dict(st.get("layout") or {})
    want = desired_hosts(d)
    layout = {"shares": shares, "hosts": {h: ",".join(sorted(p for p, x in want.items() if x == h)) for h in sorted(set(want.values()))},
              "draining": draining, "settling": (bool(layout_prev.get("draining")) and not draining)
              or (rp is not None and rp.acknowledged_now)}
    # (the live update's state is not an intent: its id follows from the object, and its acknowledgment is written
    # together with status.updates in the final patch, so the two never disagree)
    # the topology change is an intent: the world served until the planner acknowledges (`was`) is kept in it
    intent: dict[str, Any] = {"layout": layout, "topology": topo_state.status_value(body, topo.state)}
    if scaler_state is not None:
        intent["scaler"] = scaler_state
    if decisions:
        pods = {s.name: sum(1 for x in (d.pods.pods_of(s.name) if d.pods is not None else []) if not x.idle) for s in spec.sources}
        rec = [{"step": step, "source": x.source, "direction": x.direction, "fromCores": round(x.from_cores, 4),
                "toCores": round(x.to_cores, 4), "interval": x.interval, "time": now_text(), "loaderPods": pods.get(x.source, 0)}
               for x in decisions]
        intent["scaling"] = (list(st.get("scaling") or []) + rec)[-DECISIONS:]

    h = children_hash(d.objects)
    applied = dict(st.get("children") or {})
    missing = any(o["kind"] == "Deployment" and o["metadata"]["name"] not in obs.loaders
                  and (o["metadata"].get("labels") or {}).get("mixplane.io/role") == "loader" for o in d.objects)
    due = applied.get("hash") != h or missing or obs.now - float(applied.get("appliedAt") or 0.0) >= RESYNC_S
    status = final_status(obs, d, upd, spec, applied_hash=h if due else str(applied.get("hash")),
                          applied_at=obs.now if due else float(applied.get("appliedAt") or 0.0), draining=draining)
    status = with_topology(status, body, topo.state)
    status = with_repartition(status, body, rp.state if rp is not None else None)
    return Actions(d, intent, list(d.objects) if due else [], h, moves, delete, upd, status, decisions, draining, topo, rp)


def final_status(obs: Observed, d: Desired, upd: RequestPlan, spec: Any, *, applied_hash: str, applied_at: float,
                 draining: Sequence[str]) -> dict[str, Any]:
    """Phase, conditions, per source figures and the children applied (written after acting)."""
    body = obs.body
    ready, waiting = obs.ready
    fallback = [n for n, p in (obs.profile.get("sources") or {}).items() if p.get("source") == "fallback"]
    degraded = degraded_of(fallback, obs.profile_failure, obs.planner, _status(body).get("conditions") or [])
    if upd.state.get("state") != "Acknowledged":
        progressing = (True, "MixtureUpdate", str(upd.state.get("reason") or "rolling out the new mixture"))
    elif draining:
        progressing = (True, "Handoff", f"loaders {', '.join(draining)} stay until their partitions moved")
    else:
        progressing = ((not ready), "RollingOut" if not ready else "Converged",
                       f"waiting for: {waiting}" if waiting else "all children applied")
    out = status_of(body, d, obs.opts, obs.profile, ready=ready, progressing=progressing, degraded=degraded,
                    planner_status=obs.planner)
    if obs.planner is None:
        out["step"] = int(_status(body).get("step") or out.get("step") or 0)  # what was last seen, not the schedule's
        kept = {s.get("name"): s for s in _status(body).get("sources") or [] if isinstance(s, Mapping)}
        for s in out["sources"]:  # the planner's last figures stay until it answers again
            for k in ("realisedWeight", "deliveredTokensPerSecond"):
                if k in kept.get(s["name"], {}):
                    s[k] = kept[s["name"]][k]
    else:
        live = planner_source_figures(obs.planner)
        for s in out["sources"]:
            s.update(live.get(s["name"], {}))
    out["phase"] = "Updating" if upd.state.get("state") != "Acknowledged" and out["phase"] in ("Running", "Pending") else out["phase"]
    out = with_update(out, body, spec, upd.state)
    if obs.profiling is not None:
        out["profiling"] = dict(obs.profiling)
    out["children"] = {"hash": applied_hash, "appliedAt": round(applied_at, 3), "generation": (body.get("metadata") or {}).get("generation")}
    return out


# the Degraded condition of loaders the run refused (planner STATUS `refused_loaders`): its message names this many of
# them and quotes the reasons of the first REFUSED_QUOTED, each cut to REFUSED_REASON_CHARS (and less when the names
# take room: reconcile.condition keeps MESSAGE_CHARS of a message)
REFUSED_NAMED = 8
REFUSED_QUOTED = 2
REFUSED_REASON_CHARS = 500
MESSAGE_CHARS = 1000


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[:max(0, n - 3)] + "..."


def refused_loaders_of(planner: Mapping[str, Any] | None) -> dict[str, str]:
    """The loaders the planner's STATUS says the run refused (name -> the planner's reason), by name; {} without a
    STATUS, or with a `refused_loaders` that is not a mapping (an older planner says none)."""
    refused = (planner or {}).get("refused_loaders")
    if not isinstance(refused, Mapping):
        return {}
    return {str(k): str(v) for k, v in sorted(refused.items(), key=lambda kv: str(kv[0]))}


def loader_refused_message(refused: Mapping[str, str], also: str = "") -> str:
    """The Degraded message of refused loaders: their names (REFUSED_NAMED of them, then how many more), `also` (what
    else degrades the mixture), then the first REFUSED_QUOTED reasons, cut so that it all fits MESSAGE_CHARS."""
    names = sorted(refused)
    listed = ", ".join(names[:REFUSED_NAMED]) + (f" and {len(names) - REFUSED_NAMED} more" if len(names) > REFUSED_NAMED else "")
    head = (f"loaders refused by the run (their pods exit 4; a restart is refused again until the run's listing is "
            f"back): {listed}")
    if also:
        head += f" (also {_cut(also, 200)})"
    quoted = names[:REFUSED_QUOTED]
    room = (MESSAGE_CHARS - len(head)) // len(quoted) if quoted else 0
    parts = [f"; {n}: {_cut(refused[n], min(REFUSED_REASON_CHARS, room - len(n) - 4))}" for n in quoted]
    return _cut(head + "".join(parts), MESSAGE_CHARS)


def degraded_of(fallback: Sequence[str], profile_failure: str, planner: Mapping[str, Any] | None,
                previous: Sequence[Mapping[str, Any]] = ()) -> tuple[bool, str, str]:
    """The Degraded condition (true?, reason, message): ``LoaderRefused`` while the planner's STATUS names refused
    loaders (their pods exit with protocol.EXIT_LISTING, and their Deployments restart them in vain), mentioning
    ``FallbackCosts`` as well when sources are sized by kind; else ``FallbackCosts``; else ``AsPlanned``. Without a
    STATUS (the planner unreachable) a ``LoaderRefused`` condition of `previous` stays, as the planner's last figures
    do."""
    costs = ""
    if fallback:
        costs = (f"{profile_failure}; " if profile_failure else "") + f"sources not profiled, sized by kind: {', '.join(fallback)}"
    refused = refused_loaders_of(planner)
    if refused:
        return True, "LoaderRefused", loader_refused_message(refused, f"FallbackCosts: {costs}" if costs else "")
    if planner is None:
        prev = next((c for c in previous if c.get("type") == "Degraded"), None)
        if prev is not None and prev.get("status") == "True" and prev.get("reason") == "LoaderRefused":
            return True, "LoaderRefused", str(prev.get("message") or "")
    if costs:
        return True, "FallbackCosts", costs
    return False, "AsPlanned", ""


def with_update(status: Mapping[str, Any], body: Mapping[str, Any], spec: Any, state: Mapping[str, Any]) -> dict[str, Any]:
    """`status` with the live update `state` in it: status.mixtureUpdate, the MixtureApplied condition, the phase
    (Updating while not acknowledged), and the update added once to status.updates when it was acknowledged now."""
    out = dict(status)
    gen = (body.get("metadata") or {}).get("generation")
    prev = _status(body).get("conditions") or []
    ok, reason, msg = condition_of(state)
    out["conditions"] = [c for c in out.get("conditions") or [] if c.get("type") != "MixtureApplied"] + \
        [condition("MixtureApplied", ok, reason, msg, gen, prev)]
    if ok and out.get("phase") == "Updating":
        out["phase"] = "Running" if all(c.get("status") == "True" for c in out["conditions"] if c.get("type") == "Ready") \
            else "Pending"
    prev_updates = list(_status(body).get("updates") or [])
    if ok and not state.get("initial") and all(int(u.get("generation", -1)) != int(state["generation"]) for u in prev_updates):
        out["updates"] = history(prev_updates, state, spec)  # acknowledged in this pass: recorded once
    out["mixtureUpdate"] = dict(state)
    return out


def with_topology(status: Mapping[str, Any], body: Mapping[str, Any], state: Mapping[str, Any]) -> dict[str, Any]:
    """`status` with the topology `state` in it: status.topology, the TopologyApplied condition, the phase (Updating
    while the planner has not acknowledged), and the change added once to status.topologyChanges when acknowledged."""
    out = dict(status)
    gen = (body.get("metadata") or {}).get("generation")
    prev = _status(body).get("conditions") or []
    ok, reason, msg = topo_state.condition_of(state)
    out["conditions"] = [c for c in out.get("conditions") or [] if c.get("type") != "TopologyApplied"] + \
        [condition("TopologyApplied", ok, reason, msg, gen, prev)]
    if not ok and out.get("phase") in ("Running", "Pending"):
        out["phase"] = "Updating"
    elif ok and out.get("phase") == "Updating" and (out.get("mixtureUpdate") or {}).get("state", "Acknowledged") == "Acknowledged":
        out["phase"] = "Running" if all(c.get("status") == "True" for c in out["conditions"] if c.get("type") == "Ready") \
            else "Pending"
    changes = list(_status(body).get("topologyChanges") or [])
    if ok and not state.get("initial") and all(int(u.get("generation", -1)) != int(state["generation"]) for u in changes):
        out["topologyChanges"] = topo_state.history(changes, state)  # acknowledged in this pass: recorded once
    out["topology"] = topo_state.status_value(body, state)
    return out


def with_repartition(status: Mapping[str, Any], body: Mapping[str, Any], state: Mapping[str, Any] | None) -> dict[str, Any]:
    """`status` with the re-partition `state` in it (None: none was ever asked): status.repartition, the
    PartitionsApplied condition, and the change added once to status.repartitions when the planner applied it."""
    out = dict(status)
    gen = (body.get("metadata") or {}).get("generation")
    prev = _status(body).get("conditions") or []
    ok, reason, msg = rp_state.condition_of(state)
    out["conditions"] = [c for c in out.get("conditions") or [] if c.get("type") != "PartitionsApplied"] + \
        [condition("PartitionsApplied", ok, reason, msg, gen, prev)]
    if not state:
        return out
    done = list(_status(body).get("repartitions") or [])
    if ok and all(u.get("repartitionId") != state.get("repartitionId") for u in done):
        out["repartitions"] = rp_state.history(done, state)  # applied, seen in this pass: recorded once
    out["repartition"] = rp_state.status_value(body, state)
    return out


def status_patch(current: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of `new` that differ from `current` (a merge patch; empty when nothing changed)."""
    return {k: v for k, v in new.items() if current.get(k) != v}

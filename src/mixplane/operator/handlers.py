"""kopf wiring of the DataMixture operator: every event and every tick runs the same level-triggered pass.

A pass (`reconcile_once`) observes — the DataMixture as the API server has it now, its loader Deployments, the
components' readiness, the planner's STATUS — asks the pure `controller.decide` what to do, and does it in an
order that survives being cut anywhere (the operator SIGKILLed between two API calls, or upgraded):

    1. the decisions go into the status first (scaling shares and the scaler's state, the layout being moved to,
       the live update being sent): a restarted operator finds them there and carries them out again;
    2. the children are applied (server-side apply: idempotent);
    3. partitions are handed to the hosts the layout wants (the planner's HANDOFF, at a step boundary);
    4. loader Deployments outside the layout are deleted once the planner's table shows they serve nothing;
    5. the live update is sent (the whole mixture, with an id the planner applies once), then a topology change
       (RESHARD with an id the planner applies once, at the first step it has not planned), then a re-partition the
       scaler wants (REPARTITION with an id the planner applies once; acknowledged when STATUS shows it applied);
    6. the rest of the status (phase, conditions, figures, the acknowledgments) is written. A topology change
       acknowledged in this pass is followed at once by another pass: it renders the new world's children.

Nothing that must outlive the process is kept in memory; kopf's `memo` holds only a lock that keeps two passes
over one object from interleaving inside this process. Create, resume (operator start), spec changes and a timer
every TICK_S seconds all call the same pass: what the pass does depends only on what it observes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import kopf

from mixplane import settings
from mixplane.operator.builders import API_GROUP, LABEL_MIXTURE, LABEL_ROLE, ClusterOptions, pod_rank_keys
from mixplane.operator import repartitions as rp_state
from mixplane.operator import topology as topo_state
from mixplane.operator.controller import Observed, decide, with_repartition, with_topology, with_update
from mixplane.operator.keys import admin_key_dir, keys_for, stale_trainer_keys
from mixplane.operator.kube import Kube, kube
from mixplane.operator.annotations import annotations_of
from mixplane.operator.profiling import Profiled, profile_for
from mixplane.operator.reconcile import OBJECT_BUDGET_BYTES, ReconcileError, bounded_patch, condition, spec_of
from mixplane.operator import updates as upd_state
from mixplane.operator.requests import Sender

VERSION = "v1alpha1"
PLURAL = "datamixtures"
API_VERSION = f"{API_GROUP}/{VERSION}"
SCALE_INTERVAL_S: float = settings.get("MIXPLANE_SCALE_INTERVAL_S")
TICK_S: float = settings.get("MIXPLANE_RECONCILE_INTERVAL_S") or min(5.0, SCALE_INTERVAL_S)
PROFILE_POLL_S: float = settings.get("MIXPLANE_PROFILE_POLL_S")
PLANNER_TIMEOUT_S: float = settings.get("MIXPLANE_OPERATOR_PLANNER_TIMEOUT_S")
log = logging.getLogger("mixplane.operator")


# ---------------------------------------------------------------------------------------------- planner
def planner_endpoint(opts: ClusterOptions) -> str:
    """Where the operator reaches the planner; MIXPLANE_OPERATOR_PLANNER overrides it (a template with
    {name} and {namespace}, e.g. for an operator outside the cluster network)."""
    tmpl = settings.get("MIXPLANE_OPERATOR_PLANNER")
    return tmpl.format(name=opts.name, namespace=opts.namespace) if tmpl else opts.planner_endpoint


def planner_request(opts: ClusterOptions, keys: Mapping[str, tuple[str, str]], kind: str, meta: dict[str, Any],
                    timeout_s: float = PLANNER_TIMEOUT_S) -> dict[str, Any]:
    """STATUS, HANDOFF, UPDATE_MIXTURE, RESHARD or REPARTITION with the admin key. Raises TimeoutError / OSError (not
    reachable) or RuntimeError (the planner answered an error)."""
    from mixplane import control

    curve = control.ControlCurve(admin_key_dir(opts.name, opts.namespace, keys))
    ep = planner_endpoint(opts)
    if kind == "status":
        return control.status(ep, timeout_s, curve=curve)
    kube().fault.hit(f"{kind} {meta.get('partition', '')}".strip())  # a request that changes the run: a cut point too
    if kind == "handoff":
        return control.handoff(ep, meta["partition"], meta["to"], timeout_s, curve=curve)
    if kind == "reshard":
        return control.reshard(ep, meta, max(timeout_s, 10.0), curve=curve)
    if kind == "repartition":
        return control.repartition(ep, str(meta["source"]), int(meta["partitions"]), timeout_s, curve=curve,
                                   hosts=meta.get("hosts"), repartition_id=meta.get("repartition_id"))
    return control.update_mixture(ep, meta, timeout_s, curve=curve)


def send_kept(opts: ClusterOptions, keys: Mapping[str, tuple[str, str]], sender: Sender, state: Mapping[str, Any],
              meta: dict[str, Any], planner: Mapping[str, Any] | None, logger: Any
              ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """One send of the request kept in status `state` (`meta`: what it asks; `planner`: this pass's STATUS answer,
    None: not sent). Returns its state afterwards and the planner's ACK (None: not taken). What each outcome makes
    of the state is the sender's rule (requests.Sender, pure); this is only the I/O around it."""
    now = time.time()
    if planner is None:
        return sender.unreachable(state, now), None
    try:
        ack = planner_request(opts, keys, sender.kind, meta)
    except RuntimeError as e:  # an ERROR answer: refused (a field, the step), or "not now" (recovering, one pending)
        logger.warning(f"{sender.what} {sender.request_id(state)} not taken by the planner: {e}")
        return sender.failed(state, str(e), answered=True, now=now), None
    except (TimeoutError, OSError) as e:
        return sender.failed(state, str(e), answered=False, now=now), None
    kube().fault.hit(sender.cut, mutating=False)  # taken by the planner, not recorded in the status yet
    return sender.answered(state, ack), ack


# ---------------------------------------------------------------------------------------------- observe
_PDB_API: list[str] = []


def server_pdb_api(k: Kube) -> str:
    """The PodDisruptionBudget API of this operator's API server (asked once per process)."""
    from mixplane.operator.builders import pdb_api_version

    if not _PDB_API:
        _PDB_API.append(pdb_api_version(k.discover("/apis/policy")))
    return _PDB_API[0]


def options_for(body: Mapping[str, Any]) -> ClusterOptions:
    md = body["metadata"]
    image = ((body.get("spec") or {}).get("kubernetes") or {}).get("image") or settings.get("MIXPLANE_IMAGE")
    return ClusterOptions(name=md["name"], namespace=md["namespace"], image=image,
                          image_pull_policy=settings.get("MIXPLANE_IMAGE_PULL_POLICY"))


def readiness(k: Kube, opts: ClusterOptions) -> tuple[bool, str]:
    missing = []
    for kind in ("Deployment", "StatefulSet"):
        for obj in k.list("apps/v1", kind, opts.namespace, f"{LABEL_MIXTURE}={opts.name}"):
            if (obj.get("status") or {}).get("readyReplicas", 0) < (obj.get("spec") or {}).get("replicas", 1):
                missing.append(obj["metadata"]["name"])
    return not missing, ", ".join(sorted(missing))


def ask_planner(opts: ClusterOptions, keys: Mapping[str, tuple[str, str]], logger: Any) -> dict[str, Any] | None:
    try:
        return planner_request(opts, keys, "status", {})
    except (TimeoutError, RuntimeError, OSError) as e:
        logger.debug(f"planner not reachable: {e}")
        return None


# ---------------------------------------------------------------------------------------------- the pass
def failed_status(body: Mapping[str, Any], message: str) -> dict[str, Any]:
    gen = body["metadata"].get("generation")
    prev = (body.get("status") or {}).get("conditions") or []
    return {"phase": "Failed", "observedGeneration": gen,
            "conditions": [condition("Ready", False, "InvalidMixture", message, gen, prev),
                           condition("Progressing", False, "InvalidMixture", message, gen, prev),
                           condition("Degraded", True, "InvalidMixture", message, gen, prev)]}


def profiling_status(body: Mapping[str, Any], profiled: Profiled) -> dict[str, Any]:
    """Status while the profiling Jobs run: phase Profiling, not ready, progressing."""
    gen = body["metadata"].get("generation")
    prev = (body.get("status") or {}).get("conditions") or []
    msg = f"profiling the sources in {', '.join((profiled.jobs or {}).get('jobs') or [])}"
    return {"phase": "Profiling", "observedGeneration": gen, "profiling": profiled.jobs,
            "conditions": [condition("Ready", False, "Profiling", msg, gen, prev),
                           condition("Progressing", True, "Profiling", msg, gen, prev),
                           condition("Degraded", False, "AsPlanned", "", gen, prev)]}


def _write_status(k: Kube, body: Mapping[str, Any], current: dict[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """Patch the fields of `new` that differ from `current`, the object kept within the API server's size
    (reconcile.bounded_patch: informational fields left out and the StatusTooLarge condition set rather than a
    patch the API server refuses); returns the status as it is afterwards."""
    patch, fitted = bounded_patch(body, current, new)
    if fitted.dropped or not fitted.fits:
        md = body["metadata"]
        log.warning(f"DataMixture {md['namespace']}/{md['name']}: {fitted.bytes_before} bytes as JSON, over "
                    f"{OBJECT_BUDGET_BYTES}; left out: {', '.join(fitted.dropped) or 'nothing'}"
                    f"{'' if fitted.fits else '; still over: only the conditions are written'}")
    if patch:
        md = body["metadata"]
        k.patch_status(API_VERSION, "DataMixture", md["namespace"], md["name"], patch)
        current = {k_: v for k_, v in {**current, **patch}.items() if v is not None}
    return current


def reconcile_once(namespace: str, name: str, logger: Any, k: Kube | None = None, _again: bool = True) -> dict[str, Any]:
    """One level-triggered pass over the DataMixture `namespace/name` (see the module docstring)."""
    k = k or kube()
    body = k.get(API_VERSION, "DataMixture", namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return {"gone": True}
    current = dict(body.get("status") or {})
    opts = replace(options_for(body), pdb_api_version=server_pdb_api(k))
    try:
        spec = spec_of(body)
        ann = annotations_of(body)  # once for the pass: profiling, sizing and scaling read this object
        profiled = profile_for(k, body, spec, opts, logger, ann)
        if profiled.profile is None:  # the profiling Jobs still run: nothing to size children by yet
            _write_status(k, body, current, profiling_status(body, profiled))
            return {"profiling": profiled.jobs}
        try:
            # the trainer pods' keys of the world the planner serves and, while a topology change is pending, of the
            # world asked for (its pods find their keys before they start)
            served = spec_of(topo_state.served_body(body, current.get("topology") or {}))
            worlds = tuple(dict.fromkeys((*pod_rank_keys(served), *pod_rank_keys(spec))))
            keys = keys_for(k.get("v1", "Secret", namespace, opts.secret_name), worlds)
        except ValueError as e:  # more trainer pods than a Secret holds keys for, under rank_binding: required
            raise ReconcileError(str(e)) from None
        loaders = {d["metadata"]["name"]: d for d in k.list("apps/v1", "Deployment", namespace,
                                                            f"{LABEL_MIXTURE}={name},{LABEL_ROLE}=loader")}
        planner = ask_planner(opts, keys, logger)
        obs = Observed(body, opts, profiled.profile, keys, loaders, planner, readiness(k, opts), time.time(),
                       SCALE_INTERVAL_S, profiled.jobs, profiled.failure, ann)
        acts = decide(obs)
    except ReconcileError as e:
        _write_status(k, body, current, failed_status(body, str(e)))
        raise kopf.PermanentError(str(e)) from None

    # 1. decisions first
    current = _write_status(k, body, current, acts.intent)
    for x in acts.decisions:
        logger.info(f"scaling: {x.source} {x.direction} {x.from_cores:.2f}->{x.to_cores:.2f} cores")
    # 2. children
    for obj in acts.apply:
        k.apply(obj)
    if acts.topology is not None and not acts.topology.pending and not acts.topology.state.get("initial"):
        # after a topology change, the old world's trainer keys go (idempotent: nothing stale, nothing patched)
        for secret in (opts.secret_name, opts.trainer_keys_name):
            have = k.get("v1", "Secret", namespace, secret)
            stale = stale_trainer_keys((have or {}).get("data"), worlds)
            if stale:
                k.patch("v1", "Secret", namespace, secret, {"data": {x: None for x in stale}})
                logger.info(f"topology: removed the keys of trainer pods the world no longer has from {secret}: {', '.join(stale)}")
    # 3. handoffs
    for part, to in acts.handoffs:
        try:
            ack = planner_request(opts, keys, "handoff", {"partition": part, "to": to})
            logger.info(f"handoff: {part} {ack.get('from')} -> {to} after step {ack.get('after_step')}")
        except (TimeoutError, RuntimeError, OSError) as e:
            logger.warning(f"handoff of {part} to {to} failed: {e}")
    # 4. old loaders that serve nothing
    for dep in acts.delete:
        k.delete("apps/v1", "Deployment", namespace, dep)
        logger.info(f"handoff: removed loader Deployment {dep} (its partitions moved)")
    if acts.draining:
        logger.info(f"handoff: loader hosts {', '.join(acts.draining)} stay until their partitions moved")
    # 5. the live update, a topology change, a re-partition: each a request kept in status, sent by send_kept
    final = dict(acts.status)
    state = acts.update.state
    if acts.update.send:
        from mixplane.mixing import mixture_update_meta

        state, taken = send_kept(opts, keys, upd_state.SENDER, state, mixture_update_meta(spec, str(state["updateId"])),
                               obs.planner, logger)
        if taken is not None:
            logger.info(f"mixture update {state['updateId']} in force from step {state['effectiveStep']}"
                        f"{' (acknowledged before)' if taken.get('duplicate') else ''}")
        final = with_update(final, body, spec, state)
    topo = acts.topology.state if acts.topology is not None else {}
    resharded = False
    if acts.topology is not None and acts.topology.send:
        topo, taken = send_kept(opts, keys, topo_state.SENDER, topo, topo_state.reshard_meta(spec, topo), obs.planner, logger)
        if taken is not None:
            resharded = True
            logger.info(f"topology change {topo['reshardId']}: world of {topo.get('worldSize')} ranks from step "
                        f"{topo['effectiveStep']}{' (acknowledged before)' if taken.get('duplicate') else ''}")
        final = with_topology(final, body, topo)
    elif acts.topology is not None:
        final = with_topology(final, body, topo)
        resharded = acts.topology.acknowledged_now
    rstate = acts.repartition.state if acts.repartition is not None else None
    if acts.repartition is not None and acts.repartition.send and rstate is not None:
        rstate, taken = send_kept(opts, keys, rp_state.SENDER, rstate, rp_state.request_meta(rstate), obs.planner, logger)
        if taken is not None:
            logger.info(f"re-partition {rstate['repartitionId']}: {rstate['source']} {rstate['from']} -> "
                        f"{rstate['partitions']} partitions at step {taken.get('step')}"
                        f"{' (accepted before)' if taken.get('duplicate') else ''}")
        final = with_repartition(final, body, rstate)
    elif acts.repartition is not None and acts.repartition.acknowledged_now and rstate is not None:
        logger.info(f"re-partition {rstate['repartitionId']} applied: {rstate['source']} read with "
                    f"{rstate['partitions']} partitions from step {rstate.get('effectiveStep')}")
    # 6. the rest of the status
    _write_status(k, body, current, final)
    out = {"objects": len(acts.apply), "handoffs": len(acts.handoffs), "deleted": acts.delete,
           "update": state.get("state"), "topology": topo.get("state"), "step": final.get("step"),
           **({"repartition": rstate.get("state")} if rstate else {})}
    if resharded and _again:  # the planner serves the new world: render its children now, not a tick later
        out["after_reshard"] = reconcile_once(namespace, name, logger, k, _again=False)
    return out


# ---------------------------------------------------------------------------------------------- kopf wiring
def _lock(memo: Any) -> threading.Lock:
    lock = memo.get("lock")
    if lock is None:
        lock = memo.setdefault("lock", threading.Lock())
    return lock


def _pass(body: Any, memo: Any, logger: Any) -> dict[str, Any]:
    md = body["metadata"]
    with _lock(memo):
        return reconcile_once(md["namespace"], md["name"], logger)


@kopf.on.startup()
def _configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = f"{API_GROUP}/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=API_GROUP)
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 60
    # a deleted mixture waits for its timer to stop; kopf re-checks every cancellation_polling seconds
    # (default 60: `kubectl delete` would hang a minute), the timer stops at its next turn
    settings.background.cancellation_polling = 1.0


@kopf.on.resume(API_GROUP, VERSION, PLURAL)
@kopf.on.create(API_GROUP, VERSION, PLURAL)
@kopf.on.update(API_GROUP, VERSION, PLURAL)
def on_change(body: Any, memo: Any, logger: Any, **_: Any) -> None:
    out = _pass(body, memo, logger)
    logger.info(f"reconciled: {out}")


@kopf.timer(API_GROUP, VERSION, PLURAL, interval=TICK_S, initial_delay=TICK_S)
def on_tick(body: Any, memo: Any, logger: Any, **_: Any) -> None:
    """The same pass every TICK_S: scaling (when its interval is due), handoffs, update retries, figures."""
    _pass(body, memo, logger)


def _profiling(status: Any, **_: Any) -> bool:
    return bool(status) and status.get("phase") == "Profiling"


@kopf.timer(API_GROUP, VERSION, PLURAL, interval=PROFILE_POLL_S, initial_delay=PROFILE_POLL_S, when=_profiling)
def on_profiling(body: Any, memo: Any, logger: Any, **_: Any) -> None:
    """While the profiling Jobs run, the pass looks at them this often; once they are done the children are applied."""
    out = _pass(body, memo, logger)
    if "profiling" not in out:
        logger.info(f"reconciled after profiling by Job: {out}")

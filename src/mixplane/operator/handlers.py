"""kopf handlers of the DataMixture operator: thin shells around mixplane.operator.reconcile.

They only do I/O: server-side apply of the children the pure functions describe (idempotent: a restart
re-applies the same objects, nothing is duplicated), status patches, the planner's STATUS and
UPDATE_MIXTURE. Children carry the DataMixture as controlling owner (kopf.adopt), so deleting the mixture
lets the API server's garbage collector remove them.

Lifecycle:
  create / resume / update -> profile (once: kept in status) -> auto-partition -> apply children -> status
  timer (every SCALE_INTERVAL_S) -> planner STATUS -> scaling policy -> re-apply loader Deployments -> status
  update of spec.mixture (kubectl patch of weights or phases) -> children re-rendered for the new schedule and
      UPDATE_MIXTURE at the next step boundary the planner has not planned; status.updates records the step.

A partition that moves to another loader pod moves with the data plane's partition handoff: the new pod
registers as a shadow of it, the operator asks the planner to HANDOFF it (at a step boundary, nothing lost or
repeated), and the old Deployment is deleted only once the planner's table shows it serves nothing (see
`converge_hosts`). Without a reachable planner old Deployments go at once (their loaders restart from the cursor).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import kopf

from mixplane.operator.builders import (
    ANN_HOST,
    API_GROUP,
    LABEL_MIXTURE,
    LABEL_ROLE,
    ROLES,
    ClusterOptions,
)
from mixplane.operator.reconcile import (
    Desired,
    ReconcileError,
    costs_of,
    desired,
    fallback_profile,
    inputs_of,
    planner_source_figures,
    profile_from_annotation,
    profile_from_status,
    profiler_of,
    segments_of,
    spec_of,
    status_of,
)

VERSION = "v1alpha1"
PLURAL = "datamixtures"
FIELD_MANAGER = "mixplane-operator"
SCALE_INTERVAL_S = float(os.environ.get("MIXPLANE_SCALE_INTERVAL_S", "30"))
PROFILE_POLL_S = float(os.environ.get("MIXPLANE_PROFILE_POLL_S", "5"))
UPDATE_MARGIN_STEPS = int(os.environ.get("MIXPLANE_UPDATE_MARGIN_STEPS", "2"))
log = logging.getLogger("mixplane.operator")

_PLURALS = {"ServiceAccount": "serviceaccounts", "ConfigMap": "configmaps", "Secret": "secrets", "Service": "services",
            "Deployment": "deployments", "StatefulSet": "statefulsets", "NetworkPolicy": "networkpolicies",
            "PodDisruptionBudget": "poddisruptionbudgets", "Job": "jobs", "Pod": "pods"}


# ---------------------------------------------------------------------------------------------- API access
class KubeError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Kube:
    """The few REST calls the operator makes, through the kubernetes client's configured ApiClient."""

    def __init__(self, api_client: Any = None):
        import kubernetes

        if api_client is None:
            try:
                kubernetes.config.load_incluster_config()
            except kubernetes.config.ConfigException:
                kubernetes.config.load_kube_config()
            api_client = kubernetes.client.ApiClient()
        self.api = api_client

    @staticmethod
    def path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
        base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
        p = f"{base}/namespaces/{namespace}/{_PLURALS.get(kind, kind.lower() + 's')}"
        return p if name is None else f"{p}/{name}"

    def _call(self, method: str, path: str, *, body: Any = None, query: list | None = None,
              content_type: str = "application/json") -> Any:
        """One request; the JSON answer, or KubeError with the server's status and message."""
        m, url, headers, data, post = self.api.param_serialize(
            method, path, query_params=query or [], header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body, auth_settings=["BearerToken"])
        resp = self.api.call_api(m, url, header_params=headers, body=data, post_params=post, _request_timeout=30)
        raw = resp.read()
        if not 200 <= resp.status < 300:
            try:
                msg = json.loads(raw).get("message", "")
            except ValueError:
                msg = raw[:300]
            raise KubeError(resp.status, f"{method} {path}: {resp.status} {msg}")
        return json.loads(raw) if raw else {}

    def apply(self, obj: Mapping[str, Any]) -> Any:
        """Server-side apply: create or converge, owned fields only, idempotent."""
        md = obj["metadata"]
        return self._call("PATCH", self.path(obj["apiVersion"], obj["kind"], md["namespace"], md["name"]),
                          body=json.dumps(obj), query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
                          content_type="application/apply-patch+yaml")

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any:
        try:
            return self._call("GET", self.path(api_version, kind, namespace, name))
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def discover(self, path: str) -> Any:
        """A discovery document (`/apis/<group>`), or None when the server does not serve it."""
        try:
            return self._call("GET", path)
        except KubeError as e:
            if e.status in (403, 404):
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[Any]:
        out = self._call("GET", self.path(api_version, kind, namespace), query=[("labelSelector", selector)])
        return list(out.get("items") or [])

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        try:
            self._call("DELETE", self.path(api_version, kind, namespace, name), body={"propagationPolicy": "Background"})
        except KubeError as e:
            if e.status != 404:
                raise


_KUBE: Kube | None = None


def kube() -> Kube:
    global _KUBE
    if _KUBE is None:
        _KUBE = Kube()
    return _KUBE


# ---------------------------------------------------------------------------------------------- keys
_PUBLIC = re.compile(r'public-key = "([^"]+)"')
_SECRET = re.compile(r'secret-key = "([^"]+)"')


def existing_keys(secret: Mapping[str, Any] | None) -> dict[str, tuple[str, str]] | None:
    """Key pairs of an existing Secret, the roles' and the trainer pods' (never rotated by a reconcile: running pods
    hold them); None when a role's pair is missing or unreadable."""
    from mixplane.wire import SECRET_SUFFIX, ranks_of_key_name

    if not secret:
        return None
    data = secret.get("data") or {}
    out = {}
    names = [*ROLES, *sorted(n[: -len(SECRET_SUFFIX)] for n in data if n.endswith(SECRET_SUFFIX)
                             and ranks_of_key_name(n[: -len(SECRET_SUFFIX)]) is not None)]
    for name in names:
        raw = data.get(f"{name}{SECRET_SUFFIX}")
        if raw is None:
            return None
        try:
            text = base64.b64decode(raw, validate=True).decode()
        except ValueError:  # not base64, not text (binascii.Error and UnicodeDecodeError): unreadable like a bad pair
            text = ""
        pub, sec = _PUBLIC.search(text), _SECRET.search(text)
        if not pub or not sec:
            if name in ROLES:
                return None
            continue  # a damaged pod key is issued again
        out[name] = (pub.group(1), sec.group(1))
    return out


def new_keys(names: tuple[str, ...] = ROLES) -> dict[str, tuple[str, str]]:
    import zmq

    out = {}
    for name in names:
        pub, sec = zmq.curve_keypair()
        out[name] = (pub.decode(), sec.decode())
    return out


def with_pod_keys(keys: Mapping[str, tuple[str, str]], pod_keys: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """The roles' pairs and exactly the trainer pods' pairs `pod_keys` (kept where the Secret has them, new where
    it does not: a world that grew adds pods; pairs of pods the mixture no longer has are dropped)."""
    out = {r: keys[r] for r in ROLES}
    missing = tuple(n for n in pod_keys if n not in keys)
    fresh = new_keys(missing) if missing else {}
    out.update({n: keys[n] if n in keys else fresh[n] for n in pod_keys})
    return out


def admin_key_dir(name: str, namespace: str, keys: Mapping[str, tuple[str, str]]) -> str:
    """A private key dir (0700) with the admin pair and the server's public key, for control requests."""
    from mixplane.operator.builders import cert_text

    d = Path(tempfile.gettempdir()) / f"mixplane-operator-{os.getuid()}" / f"{namespace}.{name}"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(d, 0o700)
    (d / "server.key").write_text(cert_text(keys["server"][0]))
    sec = d / "admin.key_secret"
    sec.touch(mode=0o600)
    sec.write_text(cert_text(*keys["admin"]))
    (d / "admin.key").write_text(cert_text(keys["admin"][0]))
    return str(d)


# ---------------------------------------------------------------------------------------------- planner
def planner_endpoint(opts: ClusterOptions) -> str:
    """Where the operator reaches the planner; MIXPLANE_OPERATOR_PLANNER overrides it (a template with
    {name} and {namespace}, e.g. for an operator outside the cluster network)."""
    tmpl = os.environ.get("MIXPLANE_OPERATOR_PLANNER")
    return tmpl.format(name=opts.name, namespace=opts.namespace) if tmpl else opts.planner_endpoint


def planner_request(opts: ClusterOptions, keys: Mapping[str, tuple[str, str]], kind: str, meta: dict[str, Any],
                    timeout_s: float = 3.0) -> dict[str, Any]:
    from mixplane import control

    curve = control.ControlCurve(admin_key_dir(opts.name, opts.namespace, keys))
    ep = planner_endpoint(opts)
    if kind == "status":
        return control.status(ep, timeout_s, curve=curve)
    if kind == "handoff":
        return control.handoff(ep, meta["partition"], meta["to"], timeout_s, curve=curve)
    return control.update_mixture(ep, meta, timeout_s, curve=curve)


# ---------------------------------------------------------------------------------------------- reconcile
_PDB_API: list[str] = []


def server_pdb_api() -> str:
    """The PodDisruptionBudget API of this operator's API server (asked once per process)."""
    from mixplane.operator.builders import pdb_api_version

    if not _PDB_API:
        _PDB_API.append(pdb_api_version(kube().discover("/apis/policy")))
    return _PDB_API[0]


def options_for(body: Mapping[str, Any]) -> ClusterOptions:
    md = body["metadata"]
    image = ((body.get("spec") or {}).get("kubernetes") or {}).get("image") or os.environ.get("MIXPLANE_IMAGE", "mixplane:latest")
    return ClusterOptions(name=md["name"], namespace=md["namespace"], image=image,
                          image_pull_policy=os.environ.get("MIXPLANE_IMAGE_PULL_POLICY", "IfNotPresent"))


@dataclass(frozen=True)
class Profiled:
    """A profile to plan with, or (profile None) profiling Jobs still running; `jobs`: the status.profiling entry."""

    profile: dict[str, Any] | None
    jobs: dict[str, Any] | None = None
    failure: str = ""


def profile_for(body: Mapping[str, Any], spec: Any, opts: ClusterOptions, logger: Any) -> Profiled:
    """Kept profile, else the annotation's, else measured in-process or by profiling Jobs (`profiler_of`), else
    fallback costs (the Jobs failed, or in-process profiling failed under `mixplane.io/profiler: operator`)."""
    prof = profile_from_status(body) or profile_from_annotation(body)
    if prof is not None:
        return Profiled(prof)
    mode = profiler_of(body, spec)
    # a mixture already waiting for its Jobs does not try in-process again on every poll
    if mode != "job" and (body.get("status") or {}).get("phase") != "Profiling":
        try:
            from mixplane.profile import profile_spec

            measured = profile_spec(spec, max_rows=512, max_cpu_s=0.5)
            return Profiled({**measured, "sources": {n: {**p, "measured_by": "operator"} for n, p in measured["sources"].items()}})
        except Exception as e:  # noqa: BLE001 - the data may live where only loader pods can read it
            if mode == "operator":
                logger.warning(f"profiling in the operator failed ({e}); using fallback costs by kind until a profile is given")
                return Profiled(fallback_profile(spec))
            logger.info(f"profiling in the operator failed ({e}); profiling in a Job with the loaders' image instead")
    return profile_by_jobs(body, spec, opts, logger)


def profile_by_jobs(body: Mapping[str, Any], spec: Any, opts: ClusterOptions, logger: Any) -> Profiled:
    """Apply the profiling Jobs (idempotent: same spec, same names; a finished Job is never re-run, delete it to
    retry), remove those of an earlier spec, and read what their pods' termination messages say."""
    from mixplane.operator.builders import ANN_PROFILE_SOURCES, LABEL_PROFILE, LABEL_PROFILE_DIGEST, profile_children
    from mixplane.operator.reconcile import now, profile_outcome

    k = kube()
    objs = profile_children(spec, opts)
    digest = objs[1]["metadata"]["labels"][LABEL_PROFILE_DIGEST]
    for obj in objs:
        kopf.adopt(obj, owner=cast(Any, body))
        k.apply(obj)
    for kind, api in (("Job", "batch/v1"), ("ConfigMap", "v1")):
        for old in k.list(api, kind, opts.namespace, f"{LABEL_PROFILE}={opts.name},{LABEL_PROFILE_DIGEST}!={digest}"):
            k.delete(api, kind, opts.namespace, old["metadata"]["name"])
    jobs = []
    for obj in objs:
        if obj["kind"] == "Job":
            name = obj["metadata"]["name"]
            jobs.append((k.get("batch/v1", "Job", opts.namespace, name), k.list("v1", "Pod", opts.namespace, f"job-name={name}"),
                         obj["metadata"]["annotations"][ANN_PROFILE_SOURCES].split(",")))
    out = profile_outcome(spec, jobs)
    names = [o["metadata"]["name"] for o in objs if o["kind"] == "Job"]
    state = {"pending": "Running", "done": "Succeeded", "failed": "Failed"}[out.state]
    prev = (body.get("status") or {}).get("profiling") or {}
    entry = {"state": state, "jobs": names, "message": out.message or f"{len(names)} Job(s) succeeded",
             "time": prev.get("time") if prev.get("state") == state and prev.get("jobs") == names else now()}
    if out.state == "failed":
        logger.warning(f"profiling Job failed: {out.message}; sources not measured are sized by kind")
    return Profiled(out.profile, entry, out.message if out.state == "failed" else "")


def apply_children(d: Desired, opts: ClusterOptions, draining: set[str] | None = None) -> tuple[set[tuple[str, str]], list[str]]:
    """Apply every child; delete loader Deployments of an earlier grouping unless their host still serves a
    partition (`draining`, from the planner's table: they go once the handoff moved it). Returns the children's
    (kind, name) and the loader Deployments left over (draining)."""
    k = kube()
    names = set()
    for obj in d.objects:
        kopf.adopt(obj, owner=cast(Any, d.owner))  # the DataMixture controls it: deleting the mixture deletes it
        k.apply(obj)
        names.add((obj["kind"], obj["metadata"]["name"]))
    return names, delete_old_loaders(opts, names, draining or set())[1]


def delete_old_loaders(opts: ClusterOptions, keep: set[tuple[str, str]], draining: set[str]) -> tuple[list[str], list[str]]:
    """(deleted, kept because draining) loader Deployments outside `keep`."""
    k = kube()
    gone, left = [], []
    for dep in k.list("apps/v1", "Deployment", opts.namespace, f"{LABEL_MIXTURE}={opts.name},{LABEL_ROLE}=loader"):
        name = dep["metadata"]["name"]
        host = (dep["metadata"].get("annotations") or {}).get(ANN_HOST)
        if ("Deployment", name) in keep:
            continue
        if host in draining:
            left.append(name)
        else:
            k.delete("apps/v1", "Deployment", opts.namespace, name)
            gone.append(name)
    return gone, left


def desired_hosts(d: Desired) -> dict[str, str]:
    """partition "src:r" -> the loader host (launch component name) the rendered layout puts it on."""
    out = {}
    for obj in d.objects:
        ann = obj["metadata"].get("annotations") or {}
        if obj["kind"] == "Deployment" and ANN_HOST in ann and obj["spec"].get("replicas", 1):
            for p in filter(None, ann.get(f"{API_GROUP}/partitions", "").split(",")):
                out[p] = ann[ANN_HOST]
    return out


def converge_hosts(opts: ClusterOptions, keys: Mapping[str, tuple[str, str]], want: Mapping[str, str],
                   logger: Any) -> tuple[set[str], list[dict[str, Any]]] | None:
    """Ask the planner to hand every partition to the host the layout wants (when that host is up), and say
    which hosts outside the layout still serve something. None when the planner cannot be asked."""
    from mixplane.operator.scaling import handoff_moves

    try:
        st = planner_request(opts, keys, "status", {})
    except (TimeoutError, RuntimeError, OSError) as e:
        logger.info(f"handoff: planner not reachable ({e})")
        return None
    table = {"partitions": st.get("partitions") or {}, "hosts": st.get("hosts") or {}}
    if not table["partitions"]:
        return None  # a planner without a partition table: nothing to hand over
    moves, draining = handoff_moves(want, table)
    done = []
    for part, to in moves:
        try:
            ack = planner_request(opts, keys, "handoff", {"partition": part, "to": to})
        except (TimeoutError, RuntimeError, OSError) as e:
            logger.warning(f"handoff of {part} to {to} failed: {e}")
            continue
        logger.info(f"handoff: {part} {ack.get('from')} -> {to} after step {ack.get('after_step')}")
        done.append({"partition": part, "from": ack.get("from"), "to": to, "afterStep": ack.get("after_step")})
    return draining, done


def _keys_for(opts: ClusterOptions, spec: Any = None) -> dict[str, tuple[str, str]]:
    """The Secret's key pairs (new ones for a new mixture); with `spec`, completed with its trainer pods' keys."""
    from mixplane.operator.builders import pod_rank_keys

    keys = existing_keys(kube().get("v1", "Secret", opts.namespace, opts.secret_name)) or new_keys()
    if spec is None:
        return keys
    try:
        return with_pod_keys(keys, pod_rank_keys(spec))
    except ValueError as e:  # more trainer pods than a Secret holds keys for, under rank_binding: required
        raise ReconcileError(str(e)) from None


def _readiness(opts: ClusterOptions) -> tuple[bool, str]:
    k = kube()
    missing = []
    for dep in k.list("apps/v1", "Deployment", opts.namespace, f"{LABEL_MIXTURE}={opts.name}"):
        want = dep["spec"].get("replicas", 1)
        if (dep.get("status") or {}).get("readyReplicas", 0) < want:
            missing.append(dep["metadata"]["name"])
    for sts in k.list("apps/v1", "StatefulSet", opts.namespace, f"{LABEL_MIXTURE}={opts.name}"):
        if (sts.get("status") or {}).get("readyReplicas", 0) < sts["spec"].get("replicas", 1):
            missing.append(sts["metadata"]["name"])
    return not missing, ", ".join(missing)


def reconcile(body: Mapping[str, Any], patch: Any, logger: Any, memo: Any, *, mixture_changed: bool = False,
              shares: Mapping[str, float] | None = None, planner_status: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One pass: children and status for the object as it is now."""
    opts = replace(options_for(body), pdb_api_version=server_pdb_api())
    try:
        spec = spec_of(body)
        profiled = profile_for(body, spec, opts, logger)
        if profiled.profile is None:  # the profiling Jobs still run: nothing to size children by yet
            profiling_status(body, patch, profiled)
            return {"profiling": profiled.jobs}
        prof = profiled.profile
        keys = _keys_for(opts, spec)
        step = int(planner_status.get("planned_through", 0)) if planner_status else int((body.get("status") or {}).get("step") or 0)
        if mixture_changed:
            memo.pop("shares", None)  # the scaler re-decides for the new schedule
        d = desired(body, opts, prof, keys, step=max(0, step), shares=shares or memo.get("shares"))
    except ReconcileError as e:
        gen = body["metadata"].get("generation")
        from mixplane.operator.reconcile import condition

        prev = (body.get("status") or {}).get("conditions") or []
        patch.status["phase"] = "Failed"
        patch.status["observedGeneration"] = gen
        patch.status["conditions"] = [condition("Ready", False, "InvalidMixture", str(e), gen, prev),
                                      condition("Progressing", False, "InvalidMixture", str(e), gen, prev),
                                      condition("Degraded", True, "InvalidMixture", str(e), gen, prev)]
        raise kopf.PermanentError(str(e)) from None
    want = desired_hosts(d)
    conv = converge_hosts(opts, keys, want, logger) if planner_status is not None else None
    names, left = apply_children(d, opts, conv[0] if conv else None)
    memo["layout"] = (want, names)
    if left:
        memo["draining"] = True
        logger.info(f"handoff: loader Deployments {', '.join(left)} stay until their partitions moved")
    memo["keys"] = keys
    memo["profile"] = prof
    ready, waiting = _readiness(opts)
    fallback = [n for n, p in prof["sources"].items() if p.get("source") == "fallback"]
    why = f"{profiled.failure}; " if profiled.failure else ""
    degraded = (True, "FallbackCosts", f"{why}sources not profiled, sized by kind: {', '.join(fallback)}") if fallback else (False, "AsPlanned", "")
    progressing = (True, "MixtureUpdate", "new mixture rolled out") if mixture_changed else \
        ((not ready), "RollingOut" if not ready else "Converged", f"waiting for: {waiting}" if waiting else "all children applied")
    st = status_of(body, d, opts, prof, ready=ready, progressing=progressing, degraded=degraded, planner_status=planner_status)
    if profiled.jobs is not None:
        st["profiling"] = profiled.jobs
    for k, v in st.items():
        patch.status[k] = v
    return {"objects": len(d.objects), "partitions": dict(d.plan.partitions)}


def profiling_status(body: Mapping[str, Any], patch: Any, profiled: Profiled) -> None:
    """Status while the profiling Jobs run: phase Profiling, not ready, progressing."""
    from mixplane.operator.reconcile import condition

    gen = body["metadata"].get("generation")
    prev = (body.get("status") or {}).get("conditions") or []
    msg = f"profiling the sources in {', '.join((profiled.jobs or {}).get('jobs') or [])}"
    patch.status["phase"] = "Profiling"
    patch.status["observedGeneration"] = gen
    patch.status["profiling"] = profiled.jobs
    patch.status["conditions"] = [condition("Ready", False, "Profiling", msg, gen, prev),
                                  condition("Progressing", True, "Profiling", msg, gen, prev),
                                  condition("Degraded", False, "AsPlanned", "", gen, prev)]


def _mixture_changed(diff: Any) -> bool:
    return any(tuple(field[:2]) == ("spec", "mixture") or tuple(field) == ("spec",) for _, field, _, _ in diff or ())


def live_update(body: Mapping[str, Any], memo: Any, logger: Any) -> dict[str, Any] | None:
    """Send the new base weights to the running planner at the first step it has not planned (+ a margin)."""
    opts = options_for(body)
    keys = memo.get("keys") or _keys_for(opts)
    spec = spec_of(body)
    from mixplane.operator.autopartition import spec_schedule

    try:
        st = planner_request(opts, keys, "status", {})
    except (TimeoutError, RuntimeError, OSError) as e:
        logger.warning(f"planner not reachable for the live update ({e}); pods restart with the new spec instead")
        return None
    step = int(st.get("planned_through", -1)) + 1 + UPDATE_MARGIN_STEPS
    weights = dict(spec_schedule(spec)[0][1]) if not spec.mixture.phases else None
    point = [sh for s, sh in spec_schedule(spec) if s <= step][-1]
    meta = {"weights": {k: float(v) for k, v in (weights or point).items()}, "effective_step": step}
    try:
        ack = planner_request(opts, keys, "update", meta)
    except (TimeoutError, RuntimeError) as e:
        logger.warning(f"mixture update refused by the planner: {e}")
        return None
    return {"generation": body["metadata"].get("generation"), "effectiveStep": int(ack.get("effective_step", step)),
            "weights": meta["weights"]}


# ---------------------------------------------------------------------------------------------- kopf wiring
@kopf.on.startup()
def _configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = f"{API_GROUP}/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=API_GROUP)
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 60
    # a deleted mixture waits for its scaling timer to stop; kopf re-checks every cancellation_polling seconds
    # (default 60: `kubectl delete` would hang a minute), the timer stops at its next turn
    settings.background.cancellation_polling = 1.0


@kopf.on.resume(API_GROUP, VERSION, PLURAL)
@kopf.on.create(API_GROUP, VERSION, PLURAL)
def on_create(body: Any, patch: Any, logger: Any, memo: Any, **_: Any) -> None:
    out = reconcile(body, patch, logger, memo)
    logger.info(f"children applied: {out}")


@kopf.on.update(API_GROUP, VERSION, PLURAL)
def on_update(body: Any, patch: Any, diff: Any, logger: Any, memo: Any, **_: Any) -> None:
    changed = _mixture_changed(diff)
    out = reconcile(body, patch, logger, memo, mixture_changed=changed)
    if changed:
        upd = live_update(body, memo, logger)
        if upd is not None:
            prev = list(((body.get("status") or {}).get("updates")) or [])
            patch.status["updates"] = (prev + [upd])[-20:]
            out["effectiveStep"] = upd["effectiveStep"]
    logger.info(f"children applied: {out}")


def _profiling(status: Any, **_: Any) -> bool:
    return bool(status) and status.get("phase") == "Profiling"


@kopf.timer(API_GROUP, VERSION, PLURAL, interval=PROFILE_POLL_S, initial_delay=PROFILE_POLL_S, when=_profiling)
def on_profiling(body: Any, patch: Any, logger: Any, memo: Any, **_: Any) -> None:
    """While the profiling Jobs run: look at them again; once they are done (or failed), the children are applied."""
    out = reconcile(body, patch, logger, memo)
    if "profiling" not in out:
        logger.info(f"profiled by Job; children applied: {out}")


@kopf.timer(API_GROUP, VERSION, PLURAL, interval=SCALE_INTERVAL_S, initial_delay=SCALE_INTERVAL_S)
def on_timer(body: Any, patch: Any, logger: Any, memo: Any, **_: Any) -> None:
    """Mixture-driven scaling: planner STATUS -> policy -> loader Deployments re-applied when it decides."""
    from mixplane.operator.scaling import MixtureScaler, Observation

    opts = options_for(body)
    keys = memo.get("keys") or _keys_for(opts)
    try:
        st = planner_request(opts, keys, "status", {})
    except (TimeoutError, RuntimeError, OSError) as e:
        logger.info(f"scaling: planner not reachable ({e})")
        return
    spec = spec_of(body)
    prof = memo.get("profile") or profile_from_status(body) or fallback_profile(spec)
    costs = costs_of(prof, spec)
    inp = inputs_of(body)
    sc = memo.get("scaler")
    segs = segments_of(spec, prof)
    if sc is None:
        parts = {s["name"]: s["partitions"] for s in (body.get("status") or {}).get("sources") or [] if s.get("partitions")}
        if len(parts) != len(costs):
            return
        now_step = max(0, int(st.get("planned_through", 0)))  # -1 before the first plan
        sc = MixtureScaler(costs, parts, segs, [sh for s, sh in segs if s <= now_step][-1],
                           inp.tokens_per_s, budget=inp.budget)
        memo["scaler"] = sc
    sc.set_schedule(segs)
    last = memo.get("last_status")
    memo["last_status"] = (time.monotonic(), st)
    tps = inp.tokens_per_s
    if last is not None:
        dt = time.monotonic() - last[0]
        if dt > 0 and st.get("tokens_planned", 0) > last[1].get("tokens_planned", 0):
            tps = (st["tokens_planned"] - last[1]["tokens_planned"]) / dt
    if inp.scale_on == "declared":
        tps = inp.tokens_per_s  # the mixture asked to be sized for its declared trainer rate, not the measured one
    # while partitions are handed over (and the turn after) the planner waits for the moving windows: that says
    # nothing about what a source costs
    settling = bool(memo.get("draining")) or memo.pop("settling", False)
    if memo.get("draining"):
        memo["settling"] = True
    waiting = frozenset() if settling else frozenset(w.split("/")[0] for w in st.get("waiting") or [])
    delivered = delivered_rates(st)
    step = max(0, int(st.get("planned_through", 0)))
    decisions = sc.observe(Observation(step, tps, waiting, delivered))
    if decisions:
        # the policy's cores, as shares of the rate reconcile sizes pods for
        shares = {n: (sc.alloc[n] / (inp.tokens_per_s * c.cpu_s_per_token) if c.cpu_s_per_token > 0 else 0.0) for n, c in sc.costs.items()}
        memo["shares"] = shares
        logger.info("scaling: " + "; ".join(f"{d.source} {d.direction} {d.from_cores:.2f}->{d.to_cores:.2f} cores" for d in decisions))
        reconcile(body, patch, logger, memo, shares=shares, planner_status=st)
        pods = {s["name"]: s.get("loaderPods") for s in patch.status.get("sources") or []}
        from mixplane.operator.reconcile import now

        rec = [{"step": step, "source": d.source, "direction": d.direction, "fromCores": round(d.from_cores, 4),
                "toCores": round(d.to_cores, 4), "interval": d.interval, "time": now(),
                **({"loaderPods": pods[d.source]} if isinstance(pods.get(d.source), int) else {})} for d in decisions]
        prev = list(((body.get("status") or {}).get("scaling")) or [])
        patch.status["scaling"] = (prev + rec)[-20:]
        return
    patch.status["step"] = step
    live = planner_source_figures(st)  # realised weights and delivered rates as the run goes
    if live:
        srcs = [{**s, **live.get(s.get("name"), {})} for s in (body.get("status") or {}).get("sources") or []]
        if srcs:
            patch.status["sources"] = srcs
    if memo.get("draining") and memo.get("layout"):  # a regrouping is under way: hand over, then remove old pods
        want, names = memo["layout"]
        conv = converge_hosts(opts, keys, want, logger)
        if conv is not None:
            gone, left = delete_old_loaders(opts, names, conv[0])
            if gone:
                logger.info(f"handoff: removed loader Deployments {', '.join(gone)} (their partitions moved)")
            if not left:
                memo.pop("draining", None)


def delivered_rates(st: Mapping[str, Any]) -> dict[str, float]:
    """Per source tokens/s the planner measured (STATUS source_tokens_per_s, in `sources` order)."""
    names = list(st.get("sources") or [])
    rates = list(st.get("source_tokens_per_s") or [])
    return {n: float(r) for n, r in zip(names, rates)} if len(names) == len(rates) else {}

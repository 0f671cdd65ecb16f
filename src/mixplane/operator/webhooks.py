"""Admission webhooks of the operator, as pure functions (objects in, decisions and patches out).

Validating (DataMixture): cross-field rules the CRD schema cannot express. It reuses the spec's own
validation (`mixplane.spec.parse_spec`), so the API server answers with the same `field.path: message`
texts as `mixplane validate`, only files and user code are not looked at: they live on the cluster's
volumes and in the component image, not in the operator.

Mutating (Pod): a pod labelled ``mixplane.io/mixture: <name>`` gets the planner endpoint, the trainer's
CURVE client key (mounted from the mixture's Secret: the key bound to its slot's ranks, `client-r<A>-<B>`,
unless the mixture's runtime.rank_binding is off) and, when the mixture asks for sidecar placement, the
loader containers the operator placed on it. The trainer then needs nothing but ``MixtureLoader()``.

kopf wiring (the handlers stay thin)::

    @kopf.on.validate("mixplane.io", "v1alpha1", "datamixtures")
    def check(body, **_):
        if problems := review_mixture(body):
            raise kopf.AdmissionError("; ".join(problems), code=422)

    @kopf.on.mutate("", "v1", "pods", labels={MIXTURE_LABEL: kopf.PRESENT})
    def inject(body, patch, **_):
        patch.update(pod_merge_patch(body, inject_pod(body, Injection(...))))

Plain AdmissionReview v1 servers use :func:`validate_review` and :func:`mutate_review`.
"""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mixplane import podend
from mixplane.operator.annotations import ReconcileError, annotations_of
from mixplane.spec import SpecError, parse_spec

MIXTURE_LABEL = "mixplane.io/mixture"
INJECTED_ANNOTATION = "mixplane.io/injected"
KEY_MOUNT = "/var/run/mixplane/keys"
KEY_VOLUME = "mixplane-keys"


# ---- validating: DataMixture ----

def review_mixture(obj: Mapping[str, Any]) -> list[str]:
    """Every problem of a DataMixture object as `spec.field.path: message`, and the first bad annotation the operator
    reads (operator.annotations) as `metadata.annotations.<key>: message`; empty when it is valid.

    No checkers are passed in (mixplane.checks): the sources' files and a user strategy's code live on the
    cluster's volumes and in the component image, and the operator must not import user code."""
    problems: list[str] = []
    try:
        parse_spec(copy.deepcopy(dict(obj)))
    except SpecError as e:
        problems = [str(p) for p in e.problems]
    try:  # refused at admission rather than failing the mixture's first pass
        annotations_of(obj)
    except ReconcileError as e:
        problems.append(str(e))
    return problems


# phases in which nothing runs yet (or nothing could start): any change is still a new start
NOT_RUNNING = (None, "", "Pending", "Profiling", "Failed")


def _source_identity(src: Mapping[str, Any]) -> dict[str, Any]:
    return {k: src.get(k) for k in ("name", "uri", "kind", "columns", "tokenizer") if k in src}


def topology_paths(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """The field paths of spec.topology that differ (`spec.topology.modules.backbone.dp`, ...)."""
    o, n = dict(old.get("topology") or {}), dict(new.get("topology") or {})
    out = []
    om, nm = dict(o.get("modules") or {}), dict(n.get("modules") or {})
    for m in [*om, *[x for x in nm if x not in om]]:
        a, b = om.get(m), nm.get(m)
        if a == b:
            continue
        if not isinstance(a, Mapping) or not isinstance(b, Mapping):
            out.append(f"spec.topology.modules.{m}")
            continue
        out += [f"spec.topology.modules.{m}.{k}" for k in [*a, *[x for x in b if x not in a]] if a.get(k) != b.get(k)]
    out += [f"spec.topology.{k}" for k in [*o, *[x for x in n if x not in o]] if k != "modules" and o.get(k) != n.get(k)]
    return out


def _running(obj: Mapping[str, Any]) -> bool:
    return ((obj.get("status") or {}).get("phase")) not in NOT_RUNNING


def topology_change_problems(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """What a running mixture cannot take of a change of its topology (both objects valid). The data plane reshards
    live (RESHARD at the first step not planned): DP, TP, PP, CP, ranks per node, module layouts -- any world the
    spec's rules accept whose global batch is the running one. Not live: a changed global batch (rows per step, the
    sequence length), sidecar loaders placed on a number of trainer pods that would change, trainer pod keys that
    `runtime.rank_binding: required` cannot give the new world."""
    from mixplane.operator.builders import pod_rank_keys, trainer_pods

    where = ", ".join(topology_paths(old.get("spec") or {}, new.get("spec") or {})) or "spec.topology"
    try:
        a = parse_spec(_spec_doc(old))
        b = parse_spec(_spec_doc(new))
    except SpecError:
        return []  # the spec's own rules answer (review_mixture)
    out = []
    if (a.rows_per_step, a.batch.seq_len) != (b.rows_per_step, b.batch.seq_len):
        out.append(f"{where}: the new world would change the global batch of a running mixture ({a.rows_per_step} -> "
                   f"{b.rows_per_step} rows of {b.batch.seq_len} tokens per step); trainers' steps and cursors count it")
    if b.kubernetes.placement == "sidecar" and trainer_pods(a) != trainer_pods(b):
        out.append(f"{where}: kubernetes.placement sidecar fixes the loader containers of {trainer_pods(a)} trainer pods for "
                   f"the run; the new world has {trainer_pods(b)} (set kubernetes.trainer_pods to keep them, or create a "
                   f"new DataMixture)")
    try:
        pod_rank_keys(b)
    except ValueError as e:
        out.append(f"{where}: {e}")
    return out


def _spec_doc(obj: Mapping[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(dict(obj.get("spec") or {}))
    doc.setdefault("name", (obj.get("metadata") or {}).get("name") or "mixture")
    return doc


def explain_topology(old: Mapping[str, Any], new: Mapping[str, Any], problems: list[str]) -> list[str]:
    """The spec's own problems of an UPDATE that changed only the topology of a running mixture, named by the
    topology's field path: a world its batch cannot divide is a refusal of the new topology, not of spec.batch."""
    o, n = dict(old.get("spec") or {}), dict(new.get("spec") or {})
    if not _running(old) or o.get("topology") == n.get("topology") or o.get("batch") != n.get("batch"):
        return problems
    where = ", ".join(topology_paths(o, n)) or "spec.topology"
    return [f"{where}: the running mixture cannot take this world ({p})" if p.startswith("spec.batch") else p for p in problems]


def review_change(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """What an UPDATE of a running DataMixture changes that its running components cannot take live, each as
    `spec.field.path: message`. The mixture (weights, temperature, phases, anneal, lr_scale) changes live, and so
    does the topology (the operator reshards: `topology_change_problems` says what of it cannot); the sources'
    identity, the mixture's seed and the global batch belong to every cursor and journal record of the run. A
    mixture that is not running yet (no status phase, Pending, Profiling, Failed) takes any valid change."""
    if ((old.get("status") or {}).get("phase")) in NOT_RUNNING:
        return []
    o, n = dict(old.get("spec") or {}), dict(new.get("spec") or {})
    out = []
    os_, ns_ = list(o.get("sources") or []), list(n.get("sources") or [])
    names_o = [s.get("name") for s in os_ if isinstance(s, Mapping)]
    names_n = [s.get("name") for s in ns_ if isinstance(s, Mapping)]
    if names_o != names_n:
        out.append(f"spec.sources: a running mixture's sources cannot be added, removed, renamed or reordered "
                   f"(was {names_o}, now {names_n}); create a new DataMixture for another set of sources")
    else:
        for i, (a, b) in enumerate(zip(os_, ns_)):
            for k, v in _source_identity(a).items():
                if _source_identity(b).get(k) != v:
                    out.append(f"spec.sources[{i}].{k}: cannot change on a running mixture (was {v!r}, now "
                               f"{_source_identity(b).get(k)!r}): the loaders' cursors point into the data it names")
    seed_o, seed_n = (o.get("mixture") or {}).get("seed"), (n.get("mixture") or {}).get("seed")
    if seed_o != seed_n:
        out.append(f"spec.mixture.seed: cannot change on a running mixture (was {seed_o}, now {seed_n}): "
                   f"the journal and every trainer's cursor belong to it")
    if (o.get("batch") or {}) != (n.get("batch") or {}):
        out.append("spec.batch: the global batch of a running mixture cannot change (trainers' steps and cursors count it)")
    if (o.get("topology") or {}) != (n.get("topology") or {}) and not out:
        out += topology_change_problems(old, new)
    return out


def admission_response(review: Mapping[str, Any], allowed: bool, message: str = "",
                       patch: Sequence[Mapping[str, Any]] | None = None, code: int = 422) -> dict[str, Any]:
    """The AdmissionReview answer to `review` (admission.k8s.io/v1)."""
    request = review.get("request") or {}
    response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": allowed}
    if not allowed:
        response["status"] = {"code": code, "reason": "Invalid", "message": message}
    if patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(list(patch)).encode()).decode()
    return {"apiVersion": review.get("apiVersion", "admission.k8s.io/v1"), "kind": "AdmissionReview", "response": response}


def validate_review(review: Mapping[str, Any]) -> dict[str, Any]:
    """AdmissionReview of a DataMixture CREATE/UPDATE in, allow/deny (with every problem) out."""
    request = review.get("request") or {}
    obj = request.get("object")
    if request.get("operation") == "DELETE" or not isinstance(obj, dict):
        return admission_response(review, True)
    problems = review_mixture(obj)
    prior = request.get("oldObject")
    if problems and request.get("operation") == "UPDATE" and isinstance(prior, dict):
        problems = explain_topology(prior, obj, problems)
    if not problems and request.get("operation") == "UPDATE" and isinstance(prior, dict):
        problems = review_change(prior, obj)
    return admission_response(review, not problems, "; ".join(problems))


# ---- mutating: trainer pods ----

@dataclass(frozen=True)
class Injection:
    """What a labelled trainer pod receives; the operator fills it from the mixture and its children."""

    mixture: str
    planner: str  # tcp://<planner service>.<namespace>.svc:<port>
    secret_name: str  # the mixture's CURVE key Secret
    key_name: str = "client"  # the trainer's key pair: its pod's rank-bound `client-r<A>-<B>`, or the shared one
    sidecars: tuple[dict[str, Any], ...] = ()  # loader containers placed on this pod (sidecar placement)
    volumes: tuple[dict[str, Any], ...] = ()  # volumes those containers mount (spec ConfigMap, data)
    extra_env: tuple[tuple[str, str], ...] = field(default=())
    trainer_ranks: tuple[int, int] | None = None  # the global ranks (first, last) of this pod's slot

    @property
    def key_items(self) -> tuple[str, ...]:
        """The trainer gets its own key pair and the servers' public key, never a component's or another pod's secret."""
        return (f"{self.key_name}.key", f"{self.key_name}.key_secret", "server.key")


TRAINER_INDEX = "mixplane.io/trainer-index"
JOB_INDEX = "batch.kubernetes.io/job-completion-index"


def trainer_index(pod: Mapping[str, Any]) -> int | None:
    """The sidecar slot of a trainer pod: its `mixplane.io/trainer-index` label or annotation, else its Indexed Job
    completion index, else its StatefulSet ordinal (`name-<n>`); None when the pod says nothing (a Deployment's
    pods have no stable index: refused while the mixture binds ranks to keys (`pod_key`), else given the planner
    env and the shared client key, no loaders)."""
    meta = pod.get("metadata") or {}
    labels, ann = meta.get("labels") or {}, meta.get("annotations") or {}
    for raw in (labels.get(TRAINER_INDEX), ann.get(TRAINER_INDEX), ann.get(JOB_INDEX), labels.get(JOB_INDEX)):
        if raw is not None and str(raw).isdigit():
            return int(raw)
    name = str(meta.get("name") or "")
    owners = [o.get("kind") for o in meta.get("ownerReferences") or []]
    tail = name.rsplit("-", 1)
    if "StatefulSet" in owners and len(tail) == 2 and tail[1].isdigit():
        return int(tail[1])
    return None


def pod_key(rank_keys: tuple[str, ...], slot: int | None) -> str:
    """The key a trainer pod of `slot` gets: its slot's rank-bound key when the mixture binds ranks (a pod without a
    slot, or past the last one, is refused: the message says how to give it one), else the shared client key."""
    if not rank_keys:
        return "client"
    if slot is None:
        raise ValueError("the mixture binds trainer ranks to keys (runtime.rank_binding), and this pod has no trainer slot: "
                         "label it mixplane.io/trainer-index=<k> (pod k runs the k-th block of ranks), or run it from an "
                         "Indexed Job or a StatefulSet, or set the mixture's runtime.rank_binding: off")
    if not 0 <= slot < len(rank_keys):
        raise ValueError(f"trainer slot {slot} is outside the mixture's {len(rank_keys)} trainer pods "
                         f"(kubernetes.trainer_pods or world size / ranks_per_node)")
    return rank_keys[slot]


def mixture_of(pod: Mapping[str, Any]) -> str | None:
    """The mixture a pod asks for (its `mixplane.io/mixture` label), or None."""
    labels = ((pod.get("metadata") or {}).get("labels")) or {}
    name = labels.get(MIXTURE_LABEL)
    return str(name) if name else None


def inject_pod(pod: Mapping[str, Any], inj: Injection) -> dict[str, Any]:
    """The pod with mixplane injected. Idempotent: an injected pod comes back unchanged; env the user set wins."""
    new = copy.deepcopy(dict(pod))
    meta = new.setdefault("metadata", {})
    annotations = meta.get("annotations") or {}
    if annotations.get(INJECTED_ANNOTATION):
        return new
    spec = new.setdefault("spec", {})
    env = [("MIXPLANE_PLANNER", inj.planner), ("MIXPLANE_MIXTURE", inj.mixture),
           ("MIXPLANE_CURVE_DIR", KEY_MOUNT), ("MIXPLANE_CURVE_NAME", inj.key_name), *inj.extra_env]
    # sidecar placement: the loaders end with the trainer (mixplane.podend): a directory the trainer's ranks mark
    # (their lock while running, a done mark on a clean close) and the loader containers watch
    pod_end = bool(inj.sidecars) and inj.trainer_ranks is not None
    if pod_end:
        env.append((podend.ENV, podend.MOUNT))
    pod_mount = {"name": podend.VOLUME, "mountPath": podend.MOUNT}
    containers = []
    for c in spec.get("containers") or []:
        c = dict(c)
        have = {e.get("name") for e in c.get("env") or []}
        c["env"] = list(c.get("env") or []) + [{"name": k, "value": v} for k, v in env if k not in have]
        mounts = list(c.get("volumeMounts") or [])
        if not any(m.get("name") == KEY_VOLUME for m in mounts):
            mounts.append({"name": KEY_VOLUME, "mountPath": KEY_MOUNT, "readOnly": True})
        if pod_end and not any(m.get("name") == podend.VOLUME for m in mounts):
            mounts.append(dict(pod_mount))
        c["volumeMounts"] = mounts
        containers.append(c)
    taken = {c.get("name") for c in containers}
    restart = str(spec.get("restartPolicy") or "Always")
    for s in inj.sidecars:
        if s.get("name") in taken:
            raise ValueError(f"pod {meta.get('name') or meta.get('generateName') or '?'}: container name {s.get('name')!r} already used")
        s = copy.deepcopy(s)
        if pod_end and inj.trainer_ranks is not None:
            lo, hi = inj.trainer_ranks
            s["args"] = [*(s.get("args") or []), "--trainer-dir", podend.MOUNT, "--trainer-ranks", f"{lo}-{hi}",
                         "--trainer-restart", restart]
            s["volumeMounts"] = [*(s.get("volumeMounts") or []), dict(pod_mount)]
        containers.append(s)
        taken.add(s.get("name"))
    spec["containers"] = containers
    volumes = list(spec.get("volumes") or [])
    have_vol = {v.get("name") for v in volumes}
    key_volume = {"name": KEY_VOLUME, "secret": {"secretName": inj.secret_name, "defaultMode": 0o440,
                                                  "items": [{"key": k, "path": k} for k in inj.key_items]}}
    pod_volume = [{"name": podend.VOLUME, "emptyDir": {}}] if pod_end else []
    for v in (key_volume, *pod_volume, *inj.volumes):
        if v["name"] not in have_vol:
            volumes.append(copy.deepcopy(v))
            have_vol.add(v["name"])
    spec["volumes"] = volumes
    meta["annotations"] = {**annotations, INJECTED_ANNOTATION: inj.mixture}
    return new


_PATCHED = (("metadata", "annotations"), ("spec", "containers"), ("spec", "volumes"))


def pod_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[dict[str, Any]]:
    """JSON Patch (RFC 6902) turning `old` into `new` on the fields inject_pod changes."""
    ops: list[dict[str, Any]] = []
    for parent, key in _PATCHED:
        before = (old.get(parent) or {}).get(key)
        after = (new.get(parent) or {}).get(key)
        if after == before:
            continue
        ops.append({"op": "add" if before is None else "replace", "path": f"/{parent}/{key}", "value": after})
    return ops


def pod_merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The same change as a merge-style dict (what kopf's `patch` object takes)."""
    out: dict[str, Any] = {}
    for parent, key in _PATCHED:
        after = (new.get(parent) or {}).get(key)
        if after != (old.get(parent) or {}).get(key):
            out.setdefault(parent, {})[key] = after
    return out


def mutate_review(review: Mapping[str, Any], resolve: Callable[[str, str, Mapping[str, Any]], Injection | None]) -> dict[str, Any]:
    """AdmissionReview of a Pod CREATE in, a JSON patch out. `resolve(mixture, namespace, pod)` says what to inject
    (None: no such mixture, the pod is refused with a message naming the label)."""
    request = review.get("request") or {}
    pod = request.get("object")
    if request.get("operation") != "CREATE" or not isinstance(pod, dict):
        return admission_response(review, True)
    name = mixture_of(pod)
    if name is None:
        return admission_response(review, True)
    namespace = request.get("namespace") or (pod.get("metadata") or {}).get("namespace") or "default"
    try:
        inj = resolve(name, namespace, pod)
    except ValueError as e:  # e.g. the mixture's sidecars cannot be placed: say so instead of admitting a pod without them
        return admission_response(review, False, f"metadata.labels.{MIXTURE_LABEL}: mixture {name!r}: {e}")
    if inj is None:
        return admission_response(review, False, f"metadata.labels.{MIXTURE_LABEL}: no DataMixture {name!r} in namespace {namespace!r}", code=404)
    try:
        new = inject_pod(pod, inj)
    except ValueError as e:
        return admission_response(review, False, f"spec.containers: {e}")
    return admission_response(review, True, patch=pod_patch(pod, new))

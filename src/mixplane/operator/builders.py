"""Manifests of one DataMixture: pure functions from the spec and its launch plan to Kubernetes objects.

The operator renders the same launch plan the embedded runtime starts as processes (mixplane.launch):
each component's `args` and `env` become a container's args and env, with cluster values in the
:class:`ClusterOptions` target (fixed ports, 0.0.0.0 binds, the pod IP announced through the downward
API, the spec from a ConfigMap, CURVE keys from a Secret). Resources come from the auto-partitioner's
pods (loaders) or the launch plan's estimates (planner, constructors), never empty.

Children of a mixture `m` in its namespace:
    ServiceAccount m-mixplane         no API rights, no token mounted
    ConfigMap      m-spec             spec.json: the resolved spec every component reads
    Secret         m-keys             CURVE key pairs per role (server, component, client, admin) and, unless
                                      runtime.rank_binding is off, one client-r<A>-<B> pair per trainer pod (its ranks)
    Deployment     m-planner          1 replica, Recreate (one planner per mixture, ever)
    Service        m-planner          the fixed planner port + metrics
    StatefulSet    m-constructor      pod ordinal = constructor index; headless Service m-constructors
    Deployment     m-loader-<group>   one per remote loader pod of the auto-partitioner (0 replicas when idle)
    Service        m-loaders          headless, the loaders' metrics port (what a ServiceMonitor scrapes)
    PersistentVolumeClaim m-journal   the planner journal (kubernetes.journal_mb > 0): a restarted planner pod recovers
    NetworkPolicy  m-components, m-planner, m-constructors
    PodDisruptionBudget m-planner, m-constructors

Sidecar placement (kubernetes.placement: sidecar): loader pods the placement put on trainer pod slot k are not
Deployments but containers the pod webhook injects into the trainer pod of that slot (`sidecar_containers`).
Every component serves Prometheus metrics on a fixed port (`metrics`, 9090; sidecars 9191 + i so they do not
collide with each other or the trainer) bound on all interfaces (MIXPLANE_METRICS_HOST), named in the pod's
prometheus.io annotations and in a Service labelled mixplane.io/metrics for the chart's ServiceMonitor.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

API_GROUP = "mixplane.io"
KEY_MOUNT = "/var/run/mixplane/keys"  # the layout the pod webhook mounts into trainers too
SPEC_MOUNT = "/etc/mixplane/spec"
RUN_DIR = "/var/run/mixplane/run"
JOURNAL_MOUNT = "/var/run/mixplane/journal"  # the planner's --run-dir: its journal, on the claim m-journal
# numba's cache of the planner's compiled loops, beside the journal: a planner pod that replaces a lost one loads them
# (~0.3 s) instead of compiling them again before it serves (24 s of wall time at load 8 here; 8-9 s of the trainers'
# stall when the planner pod was deleted, test_e2e_chaos); numba keys each entry by source and CPU, so another image
# or node just compiles and adds its own (~1.4 MB)
PLANNER_NUMBA_CACHE = f"{JOURNAL_MOUNT}/numba-cache"
SIDECAR_PREFIX = "mixplane-"  # names of what the pod webhook adds to a trainer pod (containers, volumes)
ROLES = ("server", "component", "client", "admin")
# what a component pod mounts: its own key pairs, and the public keys of every role it must admit
COMPONENT_KEY_ITEMS = ("server.key", "server.key_secret", "component.key", "component.key_secret", "client.key", "admin.key")
LABEL_MIXTURE = "mixplane.io/instance"  # components; trainers carry mixplane.io/mixture (the pod webhook's label)
LABEL_TRAINER = "mixplane.io/mixture"
LABEL_ROLE = "mixplane.io/role"
LABEL_COMPONENT = "mixplane.io/component"
LABEL_METRICS = "mixplane.io/metrics"
MIB = 1 << 20
# trainer pods whose ranks get a key pair of their own: ~400 bytes a pod, a Secret holds at most 1 MiB
MAX_POD_KEYS = 2048
ANN_HOST = f"{API_GROUP}/host"  # a loader Deployment's host name in the planner's partition table
ANN_SHADOW_OF = f"{API_GROUP}/shadow-of"  # a shadow loader Deployment: the primary host whose partitions it stands by for
LABEL_LOADER_GROUP = f"{API_GROUP}/loader-group"  # a primary and its shadows (spread over nodes)


@dataclass(frozen=True)
class ClusterOptions:
    """Cluster values of one mixture's deployment (the launch target's counterpart)."""

    name: str  # the DataMixture's metadata.name
    namespace: str
    image: str
    image_pull_policy: str = "IfNotPresent"
    planner_port: int = 7000
    data_port: int = 7001
    client_port: int = 7002
    metrics_port: int = 9090
    sidecar_metrics_port: int = 9191  # sidecar i of a trainer pod serves metrics on this + i
    run_as_user: int = 10001
    memory_limit_factor: float = 1.5  # limit = request x this (buffers may briefly double while refilling)
    command: tuple[str, ...] = ("mixplane",)
    # rank-bound trainer keys (`client-r<A>-<B>`, one per trainer pod): components mount their public halves
    rank_keys: tuple[str, ...] = ()
    # the trainer pod keys of a world being moved to (a topology change not acknowledged yet): issued beside
    # rank_keys, so the new world's trainer pods find theirs in the Secret before they start
    extra_rank_keys: tuple[str, ...] = ()
    # the Secret whose keys are every loader container's environment (storage credentials), kubernetes.source_secret
    source_secret: str | None = None
    # PodDisruptionBudget's API: policy/v1 (Kubernetes >= 1.21; v1beta1 is gone from 1.25), v1beta1 on older servers
    pdb_api_version: str = "policy/v1"

    @property
    def planner_service(self) -> str:
        return f"{self.name}-planner"

    @property
    def planner_endpoint(self) -> str:
        return f"tcp://{self.planner_service}.{self.namespace}.svc:{self.planner_port}"

    @property
    def secret_name(self) -> str:
        return f"{self.name}-keys"

    @property
    def trainer_keys_name(self) -> str:
        """The Secret of the trainer pods' public keys only (what components admit; projected into their key dir)."""
        return f"{self.name}-trainer-keys"

    @property
    def configmap_name(self) -> str:
        return f"{self.name}-spec"

    @property
    def service_account(self) -> str:
        return f"{self.name}-mixplane"

    @property
    def journal_claim(self) -> str:
        return f"{self.name}-journal"


def launch_target_kwargs(opts: ClusterOptions) -> dict[str, Any]:
    """The mixplane.launch.LaunchTarget fields for a cluster (`LaunchTarget(**launch_target_kwargs(o))`)."""
    return {"run_dir": RUN_DIR, "bind_host": "0.0.0.0", "planner_host": f"{opts.planner_service}.{opts.namespace}.svc",
            "planner_port": opts.planner_port, "spec_path": f"{SPEC_MOUNT}/spec.json", "key_dir": KEY_MOUNT,
            "metrics_port": opts.metrics_port, "constructor_ports": (opts.data_port, opts.client_port),
            "advertise_host": "$(POD_IP)"}


# ---------------------------------------------------------------------------------------------- helpers
def dns_label(s: str, limit: int = 63) -> str:
    """A DNS-1123 label; too long names keep a hash of the whole so they stay unique."""
    out = re.sub(r"[^a-z0-9-]+", "-", s.lower()).strip("-") or "x"
    if len(out) > limit:
        h = hashlib.sha1(out.encode()).hexdigest()[:8]
        out = out[: limit - 9].rstrip("-") + "-" + h
    return out


def labels(opts: ClusterOptions, role: str, component: str | None = None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": "mixplane", "app.kubernetes.io/instance": opts.name,
           "app.kubernetes.io/component": role, "app.kubernetes.io/managed-by": "mixplane-operator",
           LABEL_MIXTURE: opts.name, LABEL_ROLE: role}
    if component is not None:
        out[LABEL_COMPONENT] = dns_label(component)
    return out


def selector(opts: ClusterOptions, role: str, component: str | None = None) -> dict[str, str]:
    out = {LABEL_MIXTURE: opts.name, LABEL_ROLE: role}
    if component is not None:
        out[LABEL_COMPONENT] = dns_label(component)
    return out


def _meta(opts: ClusterOptions, name: str, role: str, component: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"name": name, "namespace": opts.namespace, "labels": labels(opts, role, component), **extra}


def _quantity_cpu(cores: float) -> str:
    return f"{max(1, round(cores * 1000))}m"


def _quantity_mem(nbytes: int) -> str:
    return f"{max(1, -(-int(nbytes) // MIB))}Mi"


def resources(cpu: float, memory: int, opts: ClusterOptions, *, cpu_limit: float | None = None) -> dict[str, Any]:
    """Requests from the plan; a memory limit above them; a CPU limit only when given (no throttling else)."""
    if not (cpu > 0 and memory > 0):
        raise ValueError(f"resources must be positive, got cpu={cpu} memory={memory}")
    limits = {"memory": _quantity_mem(int(memory * opts.memory_limit_factor))}
    if cpu_limit is not None:
        limits["cpu"] = _quantity_cpu(max(cpu, cpu_limit))
    return {"requests": {"cpu": _quantity_cpu(cpu), "memory": _quantity_mem(memory)}, "limits": limits}


def _security(opts: ClusterOptions) -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": opts.run_as_user, "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


# the page-index cache of loaders (loader.sidecar): the image's home is /nonexistent under a read-only root
# filesystem, so the default ~/.cache is unwritable; the pod's run volume keeps it across container restarts
INDEX_CACHE = f"{RUN_DIR}/pageindex"


def _env(component: Any) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "MIXPLANE_CURVE_DIR", "value": KEY_MOUNT},
           {"name": "MIXPLANE_METRICS_HOST", "value": "0.0.0.0"}]
    if component.role == "loader":
        env.append({"name": "MIXPLANE_INDEX_CACHE", "value": INDEX_CACHE})
    fixed = {e["name"] for e in env}
    env += [{"name": k, "value": str(v)} for k, v in sorted(component.env.items()) if k not in fixed]
    return env


def _ports(component: Any) -> list[dict[str, Any]]:
    return [{"name": n[:15], "containerPort": int(p), "protocol": "TCP"} for n, p in sorted(component.ports.items()) if p]


def component_key_items(opts: ClusterOptions) -> tuple[str, ...]:
    """A component's key files from the mixture's key Secret: its pairs and the public keys of the roles it admits.
    The trainer pods' rank keys (`client-r<A>-<B>.key`, whose file names tell the ZAP handler which ranks each may
    claim) come from the trainer-keys Secret, projected whole into the same directory (`_volumes`)."""
    return COMPONENT_KEY_ITEMS


def _volumes(opts: ClusterOptions) -> list[dict[str, Any]]:
    # the key dir is one projected volume: the component's items of the key Secret, and every public key of the
    # trainer-keys Secret. The pod template does not list trainer keys, so a new world's keys (a topology change)
    # reach running components as the kubelet refreshes the volume -- the planner is not restarted for them
    return [
        {"name": "spec", "configMap": {"name": opts.configmap_name, "items": [{"key": "spec.json", "path": "spec.json"}]}},
        {"name": "keys", "projected": {"defaultMode": 0o400, "sources": [
            {"secret": {"name": opts.secret_name, "items": [{"key": k, "path": k} for k in component_key_items(opts)]}},
            {"secret": {"name": opts.trainer_keys_name, "optional": True}}]}},
        {"name": "run", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
    ]


_MOUNTS: list[dict[str, Any]] = [{"name": "spec", "mountPath": SPEC_MOUNT, "readOnly": True},
           {"name": "keys", "mountPath": KEY_MOUNT, "readOnly": True},
           {"name": "run", "mountPath": RUN_DIR}, {"name": "tmp", "mountPath": "/tmp"}]


READY_FILE = f"{RUN_DIR}/ready.json"  # in the pod's own emptyDir (no ready/ subdirectory there)


def set_flag(args: Sequence[str], flag: str, value: str) -> list[str]:
    """The args with the value of every `flag VALUE` pair replaced (a flag the args lack is not added)."""
    out = list(args)
    for i, a in enumerate(out[:-1]):
        if a == flag:
            out[i + 1] = value
    return out


def pod_args(args: Sequence[str]) -> list[str]:
    """The launch plan's args with the ready file where a pod has it (its readiness probe looks there)."""
    return set_flag(args, "--ready-file", READY_FILE)


def container(component: Any, opts: ClusterOptions, res: dict[str, Any], args: Sequence[str] | None = None) -> dict[str, Any]:
    """A launch-plan component as a container: the same command line the embedded runtime runs. Loaders, which
    read the sources, get the storage credentials' Secret as environment (`opts.source_secret`)."""
    out = {"name": component.role, "image": opts.image, "imagePullPolicy": opts.image_pull_policy,
           "command": list(opts.command), "args": pod_args(component.args if args is None else args),
           "env": _env(component), "ports": _ports(component), "resources": res,
           "readinessProbe": {"exec": {"command": ["test", "-f", READY_FILE]}, "periodSeconds": 2, "failureThreshold": 3},
           "volumeMounts": [dict(m) for m in _MOUNTS], "securityContext": _security(opts)}
    if component.role == "loader" and opts.source_secret:
        out["envFrom"] = [{"secretRef": {"name": opts.source_secret}}]
    return out


def scrape_annotations(port: int) -> dict[str, str]:
    """The prometheus.io annotations annotation-based scrape configs read (the ServiceMonitor uses the Services)."""
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def pod_template(opts: ClusterOptions, role: str, component_name: str | None, containers: list[dict[str, Any]],
                 spec_hash: str, volumes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"metadata": {"labels": labels(opts, role, component_name),
                         "annotations": {f"{API_GROUP}/spec-hash": spec_hash, **scrape_annotations(opts.metrics_port)}},
            "spec": {"serviceAccountName": opts.service_account, "automountServiceAccountToken": False,
                     "enableServiceLinks": False, "securityContext": {"runAsNonRoot": True, "runAsUser": opts.run_as_user,
                                                                      "fsGroup": opts.run_as_user},
                     "containers": containers, "volumes": volumes if volumes is not None else _volumes(opts),
                     "terminationGracePeriodSeconds": 30}}


def spec_json(spec: Any) -> str:
    return spec.model_dump_json(indent=1)


def spec_hash(spec: Any, *, topology: bool = False) -> str:
    """Pods restart when the resolved spec changes (the ConfigMap alone would not restart them), except
    for the mixture: weights and phases reach the running planner live (UPDATE_MIXTURE), never by a restart;
    and except for the topology (`topology=False`): a new trainer world reaches the running planner live
    (RESHARD), and loaders do not depend on it. Constructors do (`topology=True`): a topology change replaces
    them with pods that read the new spec."""
    doc = json.loads(spec_json(spec))
    doc.pop("mixture", None)
    if not topology:
        doc.pop("topology", None)
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------- objects
def service_account(opts: ClusterOptions) -> dict[str, Any]:
    """The components' identity: bound to no Role, and its token is never mounted."""
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(opts, opts.service_account, "component"),
            "automountServiceAccountToken": False}


def config_map(spec: Any, opts: ClusterOptions) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(opts, opts.configmap_name, "spec"),
            "data": {"spec.json": spec_json(spec)}}


def cert_text(public: str, secret: str | None = None) -> str:
    """A ZeroMQ certificate file (what mixplane.wire's key loader reads): public, or public + secret."""
    body = f'metadata\ncurve\n    public-key = "{public}"\n'
    if secret is not None:
        body += f'    secret-key = "{secret}"\n'
    return "#   ****  Generated by the mixplane operator  ****\n" + body


# ---------------------------------------------------------------------------------------------- trainer pods and their keys
def trainer_pods(spec: Any) -> int:
    """Trainer pods of the mixture: kubernetes.trainer_pods, else one per node of the topology."""
    if spec.kubernetes.trainer_pods:
        return int(spec.kubernetes.trainer_pods)
    per_node = int(spec.topology.ranks_per_node)  # (>= 1: the model's bound)
    return max(1, -(-int(spec.world_size) // per_node))


def pod_rank_ranges(spec: Any) -> list[tuple[int, int]]:
    """The ranks of each trainer pod slot (first, last): the world split in order over the pods, as launchers
    number them (pod k of a node-per-pod job runs ranks k*n .. k*n+n-1)."""
    world, pods = int(spec.world_size), trainer_pods(spec)
    per = -(-world // pods)
    return [(lo, min(world, lo + per) - 1) for lo in range(0, world, per)]


def pod_rank_keys(spec: Any) -> tuple[str, ...]:
    """The rank-bound key of each trainer pod slot, `client-r<first>-<last>` (what the pod webhook mounts into
    slot k's pod), or none when the mixture does not bind ranks (runtime.rank_binding: off), has more trainer
    pods than one Secret can hold keys for, or has trainer pods the world's rank blocks do not reach (4 ranks
    on 3 pods: blocks of 2 leave the third pod none, and the webhook would refuse a pod the sidecar layout
    placed loaders on). `required` cannot be met then: an error saying why."""
    if spec.runtime.rank_binding == "off":
        return ()
    ranges, pods = pod_rank_ranges(spec), trainer_pods(spec)
    if len(ranges) > MAX_POD_KEYS:
        why = f"{len(ranges)} trainer pods exceed the {MAX_POD_KEYS} a Secret holds keys for"
    elif len(ranges) != pods:
        why = (f"kubernetes.trainer_pods {pods} do not split the world's {spec.world_size} ranks into one block per "
               f"pod (blocks of {ranges[0][1] - ranges[0][0] + 1} fill {len(ranges)} pods)")
    else:
        return tuple(f"client-r{lo}-{hi}" for lo, hi in ranges)
    if spec.runtime.rank_binding == "required":
        raise ValueError(f"runtime.rank_binding: required needs one key per trainer pod, and {why}; "
                         f"use auto (unbound) or another number of trainer pods")
    return ()


def spec_options(opts: ClusterOptions, spec: Any) -> ClusterOptions:
    """The options with what the mixture's spec decides: its trainer pod keys (component pods then admit them by
    name) and the Secret of its loaders' storage credentials."""
    return replace(opts, rank_keys=pod_rank_keys(spec), source_secret=spec.kubernetes.source_secret)


def key_secret(opts: ClusterOptions, keys: Mapping[str, tuple[str, str]]) -> dict[str, Any]:
    """CURVE key pairs laid out as a key dir, `<name>.key` (public) and `<name>.key_secret`: one per role and one
    per trainer pod (`opts.rank_keys`)."""
    missing = [r for r in (*ROLES, *opts.rank_keys, *opts.extra_rank_keys) if r not in keys]
    if missing:
        raise ValueError(f"CURVE keys missing for {', '.join(missing)}")
    data: dict[str, str] = {}
    for role in (*ROLES, *opts.rank_keys, *opts.extra_rank_keys):
        public, secret = keys[role]
        data[f"{role}.key"] = cert_text(public)
        data[f"{role}.key_secret"] = cert_text(public, secret)
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": _meta(opts, opts.secret_name, "keys"),
            "stringData": data}


def trainer_key_secret(opts: ClusterOptions, keys: Mapping[str, tuple[str, str]]) -> dict[str, Any]:
    """The public halves of the trainer pods' key pairs (`<name>.key`), nothing secret: projected whole into every
    component's key dir (so a grown or shrunk world's keys reach running components without a new pod template)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": _meta(opts, opts.trainer_keys_name, "keys"),
            "stringData": {f"{n}.key": cert_text(keys[n][0]) for n in (*opts.rank_keys, *opts.extra_rank_keys)}}


def journal_claim(spec: Any, opts: ClusterOptions) -> dict[str, Any] | None:
    """The planner journal's claim (ReadWriteOnce: the planner Deployment is Recreate, one pod mounts it at a time)."""
    k = spec.kubernetes
    if not k.journal_mb:
        return None
    out: dict[str, Any] = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": _meta(opts, opts.journal_claim, "planner", "planner"),
                           "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": f"{int(k.journal_mb)}Mi"}}}}
    if k.storage_class:
        out["spec"]["storageClassName"] = k.storage_class
    return out


def planner_args(args: Sequence[str]) -> list[str]:
    """The planner's args with its run dir (where the journal is) on the journal volume."""
    return set_flag(pod_args(args), "--run-dir", JOURNAL_MOUNT)


def planner_deployment(plan: Any, opts: ClusterOptions, digest: str, *, journal_claim: str | None = None) -> dict[str, Any]:
    """One planner pod. Its journal lives on the claim (a restarted pod recovers from it) or, without one, in
    an emptyDir that dies with the pod."""
    c = plan.planner
    res = resources(c.resources.cpu, c.resources.memory_bytes, opts)
    name = opts.planner_service
    ctr = container(c, opts, res, planner_args(c.args))
    ctr["volumeMounts"].append({"name": "journal", "mountPath": JOURNAL_MOUNT})
    ctr["env"].append({"name": "NUMBA_CACHE_DIR", "value": PLANNER_NUMBA_CACHE})
    vol: dict[str, Any] = {"name": "journal", "persistentVolumeClaim": {"claimName": journal_claim}} if journal_claim else \
        {"name": "journal", "emptyDir": {}}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(opts, name, "planner", "planner"),
            "spec": {"replicas": 1, "strategy": {"type": "Recreate"},  # never two planners of one mixture
                     "selector": {"matchLabels": selector(opts, "planner", "planner")},
                     "template": pod_template(opts, "planner", "planner", [ctr], digest, _volumes(opts) + [vol])}}


def planner_service(opts: ClusterOptions) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {**_meta(opts, opts.planner_service, "planner", "planner"),
                         "labels": {**labels(opts, "planner", "planner"), LABEL_METRICS: "true"}},
            "spec": {"type": "ClusterIP", "selector": selector(opts, "planner", "planner"),
                     "ports": [{"name": "planner", "port": opts.planner_port, "targetPort": opts.planner_port, "protocol": "TCP"},
                               {"name": "metrics", "port": opts.metrics_port, "targetPort": opts.metrics_port, "protocol": "TCP"}]}}


def constructor_args(plan: Any, opts: ClusterOptions) -> list[str]:
    """One template for every constructor: `--index $(POD_NAME)` (the StatefulSet ordinal is the index)."""
    comps = sorted(plan.of_role("constructor"), key=lambda c: c.index)
    if not comps:
        raise ValueError("the launch plan has no constructor")

    def generic(c: Any) -> list[str]:
        return set_flag(pod_args(c.args), "--index", "$(POD_NAME)")

    args = generic(comps[0])
    for c in comps[1:]:
        if generic(c) != args:
            raise ValueError(f"constructors differ in more than their index ({comps[0].name} vs {c.name}); one StatefulSet cannot run them")
    return args


def constructor_statefulset(plan: Any, opts: ClusterOptions, digest: str) -> dict[str, Any]:
    comps = sorted(plan.of_role("constructor"), key=lambda c: c.index)
    c = comps[0]
    res = resources(max(x.resources.cpu for x in comps), max(x.resources.memory_bytes for x in comps), opts)
    name = f"{opts.name}-constructor"
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(opts, name, "constructor"),
            "spec": {"replicas": len(comps), "serviceName": f"{opts.name}-constructors", "podManagementPolicy": "Parallel",
                     "selector": {"matchLabels": selector(opts, "constructor")},
                     "template": pod_template(opts, "constructor", None,
                                              [container(c, opts, res, constructor_args(plan, opts))], digest)}}


def constructor_service(opts: ClusterOptions) -> dict[str, Any]:
    """Headless: every constructor pod has its own DNS name (m-constructor-<i>.m-constructors)."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {**_meta(opts, f"{opts.name}-constructors", "constructor"),
                         "labels": {**labels(opts, "constructor"), LABEL_METRICS: "true"}},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": selector(opts, "constructor"),
                     "ports": [{"name": "data", "port": opts.data_port, "protocol": "TCP"},
                               {"name": "clients", "port": opts.client_port, "protocol": "TCP"},
                               {"name": "metrics", "port": opts.metrics_port, "protocol": "TCP"}]}}


def loader_deployment_name(opts: ClusterOptions, component: Any) -> str:
    return dns_label(f"{opts.name}-{component.name}")


def loader_deployment(component: Any, opts: ClusterOptions, digest: str, *, cpu: float, memory: int,
                      replicas: int = 1, cpu_limit: float | None = 1.0, shadow_of: str | None = None,
                      spread: bool = False) -> dict[str, Any]:
    """One loader pod group: a process hosting these partitions (0 replicas while none has weight). A shadow
    (runtime.shadow_loaders; `shadow_of` names its primary's host) opens the same partitions and stands by; its pods
    prefer nodes without the primary's (a lost node must not take both)."""
    name = loader_deployment_name(opts, component)
    parts = ",".join(f"{p.source}:{p.replica}" for p in component.partitions)
    ann = {f"{API_GROUP}/partitions": parts, ANN_HOST: component.name, **({ANN_SHADOW_OF: shadow_of} if shadow_of else {})}
    meta = _meta(opts, name, "loader", component.name, annotations=ann)
    tmpl = pod_template(opts, "loader", component.name, [container(component, opts, resources(cpu, memory, opts, cpu_limit=cpu_limit))], digest)
    tmpl["metadata"]["annotations"][f"{API_GROUP}/partitions"] = parts
    group = dns_label(shadow_of or component.name)
    tmpl["metadata"]["labels"][LABEL_LOADER_GROUP] = group
    if spread:
        tmpl["spec"]["affinity"] = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                                "labelSelector": {"matchLabels": {LABEL_MIXTURE: opts.name, LABEL_LOADER_GROUP: group}}}}]}}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
            "spec": {"replicas": int(replicas), "strategy": {"type": "Recreate"},  # a partition is read by one process
                     "selector": {"matchLabels": selector(opts, "loader", component.name)}, "template": tmpl}}


def loaders_service(opts: ClusterOptions) -> dict[str, Any]:
    """Headless, metrics only: remote loaders bind no other port, but Prometheus finds them through it."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {**_meta(opts, f"{opts.name}-loaders", "loader"), "labels": {**labels(opts, "loader"), LABEL_METRICS: "true"}},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": selector(opts, "loader"),
                     "ports": [{"name": "metrics", "port": opts.metrics_port, "targetPort": opts.metrics_port, "protocol": "TCP"}]}}


# ---------------------------------------------------------------------------------------------- sidecars
def sidecar_volumes(opts: ClusterOptions) -> list[dict[str, Any]]:
    """The components' volumes under names a trainer pod's own volumes do not use."""
    return [{**v, "name": SIDECAR_PREFIX + "loader-" + v["name"]} for v in _volumes(opts)]


def sidecar_container(component: Any, opts: ClusterOptions, res: dict[str, Any], index: int) -> dict[str, Any]:
    """A loader process as a container of a trainer pod: the remote loader's command line, its own metrics port
    (9191 + index: containers of a pod share one network namespace), no readiness probe (a loader that is not up
    yet must not take the trainer pod out of its Service)."""
    port = opts.sidecar_metrics_port + index
    c = container(component, opts, res, set_flag(pod_args(component.args), "--metrics-port", str(port)))
    c["name"] = dns_label(f"{SIDECAR_PREFIX}{component.name}")
    c["ports"] = [{"name": f"mx-metrics-{index}"[:15], "containerPort": port, "protocol": "TCP"}]
    c.pop("readinessProbe", None)
    for m in c["volumeMounts"]:
        m["name"] = SIDECAR_PREFIX + "loader-" + m["name"]
    return c


def network_policies(opts: ClusterOptions) -> list[dict[str, Any]]:
    """Only mixplane components reach loaders and constructors' data port; only this mixture's trainers
    (and components) reach the planner and the constructors' client port; metrics stay open to scrapers."""
    comp = {"podSelector": {"matchLabels": {LABEL_MIXTURE: opts.name}}}
    trainers = {"podSelector": {"matchLabels": {LABEL_TRAINER: opts.name}}}
    metrics = {"ports": [{"protocol": "TCP", "port": opts.metrics_port}]}

    def np(name: str, role_sel: dict[str, Any], rules: list[dict[str, Any]]) -> dict[str, Any]:
        return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _meta(opts, name, "network"),
                "spec": {"podSelector": role_sel, "policyTypes": ["Ingress"], "ingress": rules}}

    loaders = np(f"{opts.name}-loaders", {"matchLabels": selector(opts, "loader")}, [{"from": [comp]}, metrics])
    constructors = np(f"{opts.name}-constructors", {"matchLabels": selector(opts, "constructor")}, [
        {"from": [comp], "ports": [{"protocol": "TCP", "port": opts.data_port}]},
        {"from": [comp, trainers], "ports": [{"protocol": "TCP", "port": opts.client_port}]}, metrics])
    planner = np(f"{opts.name}-planner", {"matchLabels": selector(opts, "planner")}, [
        {"from": [comp, trainers], "ports": [{"protocol": "TCP", "port": opts.planner_port}]}, metrics])
    return [loaders, constructors, planner]


def pdb_api_version(policy_group: Mapping[str, Any] | None) -> str:
    """The PodDisruptionBudget API a server serves, from its `/apis/policy` discovery document: policy/v1 when it
    has it (a 1.25+ server has nothing else), else policy/v1beta1 (a 1.20 server)."""
    versions = [v.get("groupVersion") for v in (policy_group or {}).get("versions") or []]
    return "policy/v1beta1" if versions and "policy/v1" not in versions else "policy/v1"


def disruption_budgets(opts: ClusterOptions) -> list[dict[str, Any]]:
    """A voluntary eviction (node drain) must not take the planner or a constructor while training runs."""
    return [{"apiVersion": opts.pdb_api_version, "kind": "PodDisruptionBudget", "metadata": _meta(opts, f"{opts.name}-{role}", role),
             "spec": {"maxUnavailable": 0, "selector": {"matchLabels": selector(opts, role)}}}
            for role in ("planner", "constructor")]


def children(spec: Any, plan: Any, opts: ClusterOptions, keys: Mapping[str, tuple[str, str]],
             loader_resources: Mapping[str, tuple[float, int, int]] | None = None,
             sidecars: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Every child object of one mixture.

    `plan`: the mixplane.launch plan of the resolved spec (replicas = the auto-partitioner's partitions,
    loader groups = its pods); `loader_resources`: per loader component name (cpu cores, memory bytes,
    replicas) from the auto-partitioner; the launch plan's estimates otherwise. `sidecars`: loader components
    that run in trainer pods (injected by the pod webhook), not as Deployments."""
    opts = spec_options(opts, spec)
    digest = spec_hash(spec)
    claim = journal_claim(spec, opts)
    out = [service_account(opts), config_map(spec, opts), key_secret(opts, keys), trainer_key_secret(opts, keys)]
    if claim is not None:
        out.append(claim)
    out += [planner_deployment(plan, opts, digest, journal_claim=opts.journal_claim if claim else None), planner_service(opts)]
    if plan.of_role("constructor"):
        out += [constructor_statefulset(plan, opts, spec_hash(spec, topology=True)), constructor_service(opts)]
    primary_of = shadow_primaries(plan)
    for c in plan.of_role("loader"):
        if c.name in sidecars or primary_of.get(c.name) in sidecars:
            continue
        first = primary_of.get(c.name, c.name)  # a shadow is sized and scaled like its primary
        cpu, mem, replicas = (loader_resources or {}).get(first, (c.resources.cpu, c.resources.memory_bytes, 1))
        out.append(loader_deployment(c, opts, digest, cpu=cpu, memory=mem, replicas=replicas,
                                     shadow_of=primary_of.get(c.name), spread=bool(primary_of)))
    out += [loaders_service(opts)] + network_policies(opts) + disruption_budgets(opts)
    return out


def shadow_primaries(plan: Any) -> dict[str, str]:
    """Shadow loader component -> its primary (the loader of the same partitions that is not a shadow)."""
    loaders = plan.of_role("loader")
    primary = {c.partitions: c.name for c in loaders if not c.shadow}
    return {c.name: primary[c.partitions] for c in loaders if c.shadow and c.partitions in primary}



def owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    """What kopf.adopt sets: the DataMixture as controller, so deleting it deletes its children."""
    md = owner["metadata"]
    return {"apiVersion": owner.get("apiVersion", f"{API_GROUP}/v1alpha1"), "kind": owner.get("kind", "DataMixture"),
            "name": md["name"], "uid": md["uid"], "controller": True, "blockOwnerDeletion": True}


def manifest_json(objs: list[dict[str, Any]]) -> str:
    return json.dumps(objs, indent=1, sort_keys=True)


def loader_args_without(args: Sequence[str], sources: Collection[str]) -> tuple[str, ...]:
    """A loader's command line without the partitions of `sources` in its launch list (`--source S --replica R` or
    `--sources S:R,...`); `--host-name` stays, so a process left with none is an empty host (it serves what the
    planner's table hands it)."""
    out: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--source" and i + 1 < len(args) and args[i + 1] in sources:
            i += 4 if i + 2 < len(args) and args[i + 2] == "--replica" else 2
            continue
        if a == "--sources" and i + 1 < len(args):
            kept = [m for m in args[i + 1].split(",") if m and m.partition(":")[0] not in sources]
            if kept:
                out += [a, ",".join(kept)]
            i += 2
            continue
        out.append(a)
        i += 1
    return tuple(out)


def mixture_launch_plan(spec: Any, opts: ClusterOptions, pods: Sequence[Any], partitions: Mapping[str, int],
                        table_sources: Collection[str] = ()) -> tuple[Any, Any]:
    """The resolved spec (replicas = partitions) and its launch plan with one loader process per pod in `pods`.

    `table_sources`: sources re-partitioned while running. `partitions` stays the split the planner started with
    (the spec it reads, and the journal replays from); their partitions are left out of the loaders' launch lists
    (a launch list may only name partitions of that split): the planner's table hands them to the hosts."""
    from dataclasses import replace

    from mixplane.launch import LaunchTarget, launch_plan
    from mixplane.operator.autopartition import with_partitions

    resolved = with_partitions(spec, partitions)
    plan = launch_plan(resolved, LaunchTarget(**launch_target_kwargs(opts)), loaders=[list(p.members) for p in pods])
    if table_sources:
        plan = replace(plan, components=tuple(replace(c, args=loader_args_without(c.args, table_sources))
                                              if c.role == "loader" else c for c in plan.components))
    return resolved, plan


def render_mixture(spec: Any, opts: ClusterOptions, pods: Any, partitions: Mapping[str, int],
                   keys: Mapping[str, tuple[str, str]], sidecar_pods: Sequence[Any] = (),
                   table_sources: Collection[str] = ()) -> tuple[Any, list[dict[str, Any]]]:
    """The resolved spec (replicas = partitions) and every child object, remote loader pods from `pods` (a PodPlan);
    `sidecar_pods` (LoaderPods) run in trainer pods and get no Deployment. `table_sources`: see mixture_launch_plan
    (the pods may then hold partitions beyond `partitions`)."""
    from mixplane.launch import loader_name

    resolved, plan = mixture_launch_plan(spec, opts, [*pods.pods, *sidecar_pods], partitions, table_sources)
    res = {loader_name(list(p.members)): (p.cpu, p.memory, 0 if p.idle else 1) for p in pods.pods}
    side = [loader_name(list(p.members)) for p in sidecar_pods]
    return resolved, children(resolved, plan, opts, keys, res, side)


def sidecar_containers(spec: Any, opts: ClusterOptions, all_pods: Sequence[Any], partitions: Mapping[str, int],
                       slot_pods: Sequence[Any]) -> list[dict[str, Any]]:
    """The loader containers of one trainer pod: `slot_pods` (LoaderPods placed on it), rendered from the same
    launch plan as every other loader (`all_pods`: every loader pod of the mixture, remote and sidecar)."""
    from mixplane.launch import loader_name

    _, plan = mixture_launch_plan(spec, opts, all_pods, partitions)
    out = []
    for i, p in enumerate(slot_pods):
        comp = plan.component(loader_name(list(p.members)))
        out.append(sidecar_container(comp, opts, resources(p.cpu, p.memory, opts, cpu_limit=1.0), i))
    return out


# ---------------------------------------------------------------------------------------------- profiling Job
LABEL_PROFILE = f"{API_GROUP}/profile-of"  # profiling Jobs and their pods (not LABEL_MIXTURE: no NetworkPolicy admits them)
LABEL_PROFILE_DIGEST = f"{API_GROUP}/profile-digest"
ANN_PROFILE_SOURCES = f"{API_GROUP}/profile-sources"
TERMINATION_LOG = "/dev/termination-log"
PROFILE_CPU = 1.0  # profiling is one thread; its per-token cost is process CPU time, so a limit does not skew it
PROFILE_MEMORY = 1 << 30
PROFILE_DEADLINE_S = 900  # a pod that cannot be scheduled or hangs: the Job fails, the mixture runs on fallback costs


def profile_digest(spec: Any, opts: ClusterOptions) -> str:
    """What a profile depends on: the sources, the mixture's seed, the windows, the image and the credentials' Secret.
    A change of any of them is a new profiling Job (the old one is removed); an unchanged spec re-applies the same."""
    doc = json.loads(spec_json(spec))
    keep = {k: doc.get(k) for k in ("sources", "runtime", "batch")}
    keep["seed"] = (doc.get("mixture") or {}).get("seed")
    raw = json.dumps([keep, opts.image, spec.kubernetes.source_secret], sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:10]


def profile_shards(names: Sequence[str], limit: int, image: Collection[str] = ()) -> list[list[str]]:
    """Sources split, in order, into groups whose result surely fits one termination message of `limit` bytes
    (one profiling pod each: a pod's containers share 12 KiB of messages, so a pod per group, not a container);
    `image`: the image sources (their profile carries their image costs too)."""
    from mixplane.profile_message import message_envelope, slim_entry_bound

    room = limit - message_envelope()
    out: list[list[str]] = []
    used = room + 1
    for n in names:
        size = slim_entry_bound(n, image=n in image)
        if used + size > room:
            out.append([])
            used = 0
        out[-1].append(n)
        used += size
    return out


def profile_labels(opts: ClusterOptions, digest: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "mixplane", "app.kubernetes.io/instance": opts.name,
            "app.kubernetes.io/component": "profiler", "app.kubernetes.io/managed-by": "mixplane-operator",
            LABEL_PROFILE: opts.name, LABEL_PROFILE_DIGEST: digest}


def profile_spec_map(spec: Any, opts: ClusterOptions, digest: str) -> dict[str, Any]:
    """The spec as the user wrote it (profiling comes before partitioning), for the profiling pods."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": dns_label(f"{opts.name}-profile-{digest}"), "namespace": opts.namespace,
                         "labels": profile_labels(opts, digest)},
            "data": {"spec.json": spec_json(spec)}}


def profile_job(spec: Any, opts: ClusterOptions, digest: str, index: int, sources: Sequence[str]) -> dict[str, Any]:
    """One profiling pod: `mixplane profile` of `sources` with the loaders' image, their storage credentials (envFrom
    the source Secret, as loaders get it) and security context, no API token and no CURVE key. The result (or the
    redacted error) is the container's termination message, which the operator reads from the pod's status."""
    labels_ = profile_labels(opts, digest)
    cm = profile_spec_map(spec, opts, digest)["metadata"]["name"]
    ctr: dict[str, Any] = {
        "name": "profile", "image": opts.image, "imagePullPolicy": opts.image_pull_policy, "command": list(opts.command),
        "args": ["profile", f"{SPEC_MOUNT}/spec.json", "--sources", ",".join(sources), "--termination-log", TERMINATION_LOG],
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}, {"name": "TOKENIZERS_PARALLELISM", "value": "false"},
                {"name": "MIXPLANE_INDEX_CACHE", "value": "/tmp/pageindex"}],
        "resources": resources(PROFILE_CPU, PROFILE_MEMORY, opts, cpu_limit=PROFILE_CPU),
        "terminationMessagePath": TERMINATION_LOG, "terminationMessagePolicy": "File",
        "volumeMounts": [{"name": "spec", "mountPath": SPEC_MOUNT, "readOnly": True}, {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": _security(opts)}
    if spec.kubernetes.source_secret:
        ctr["envFrom"] = [{"secretRef": {"name": spec.kubernetes.source_secret}}]
    pod = {"metadata": {"labels": dict(labels_)},
           "spec": {"restartPolicy": "Never", "serviceAccountName": opts.service_account, "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": opts.run_as_user, "fsGroup": opts.run_as_user},
                    "containers": [ctr],
                    "volumes": [{"name": "spec", "configMap": {"name": cm, "items": [{"key": "spec.json", "path": "spec.json"}]}},
                                {"name": "tmp", "emptyDir": {}}]}}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": profile_job_name(opts, digest, index), "namespace": opts.namespace, "labels": labels_,
                         "annotations": {ANN_PROFILE_SOURCES: ",".join(sources)}},
            "spec": {"backoffLimit": 1, "activeDeadlineSeconds": PROFILE_DEADLINE_S, "template": pod}}


def profile_job_name(opts: ClusterOptions, digest: str, index: int) -> str:
    return dns_label(f"{opts.name}-profile-{digest}-{index}")


def profile_children(spec: Any, opts: ClusterOptions) -> list[dict[str, Any]]:
    """What profiling a mixture in the cluster takes: the components' ServiceAccount (no rights), the spec's
    ConfigMap and one Job per group of sources (`profile_shards`)."""
    from mixplane.profile_message import TERMINATION_LIMIT

    # not spec_options: profiling needs no trainer pod keys, and a mixture those keys refuse (rank_binding: required)
    # must reach reconcile's ReconcileError, not fail here with a bare ValueError
    digest = profile_digest(spec, opts)
    shards = profile_shards([s.name for s in spec.sources], TERMINATION_LIMIT,
                            image={s.name for s in spec.sources if s.kind == "image_text"})
    return [service_account(opts), profile_spec_map(spec, opts, digest),
            *[profile_job(spec, opts, digest, i, names) for i, names in enumerate(shards)]]

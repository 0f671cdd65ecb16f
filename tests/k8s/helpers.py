"""Helpers shared by the k8s tier: waiting, kubectl JSON, the operator as a process, pod templates run locally.

There is no kubelet here: pods stay Pending. `LocalPods` reads pod templates the operator created back from the
API server and runs every container's command, args and env as a local process (volumes from the ConfigMaps /
Secrets they name, downward-API values 127.0.0.1, each pod's container ports mapped to free local ports as its
own pod IP would keep them apart): the manifests are proven runnable, not only accepted.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.k8s.cluster import Cluster, free_port

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "datamixtures.mixplane.io.yaml"

__all__ = ["CRD", "ROOT", "LocalPods", "apply", "applied", "children", "free_port", "get", "operator", "run_job_pod", "run_trainers",
           "process_watch", "sa_kubeconfig", "status_of", "trainer_key_dir", "trainer_keys", "wait_for"]


def wait_for(what: str, fn: Callable[[], Any], timeout: float = 60.0, every: float = 0.25, *, tolerate: bool = False,
             abort: Callable[[bool], str | None] | None = None) -> Any:
    """fn() until it is truthy (and returns it); `tolerate`: exceptions count as 'not yet';
    `abort(False)` returning a message stops the wait at once (a process the wait depends on has died),
    `abort(True)` adds to the timeout's message (that process's log)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        if abort is not None and (why := abort(False)):
            raise AssertionError(f"gave up waiting for {what}: {why}")
        try:
            last = fn()
        except Exception as e:  # noqa: BLE001 - only with tolerate: the thing is not there yet
            if not tolerate:
                raise
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(every)
    why = abort(True) if abort is not None else None
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})" + (f"; {why}" if why else ""))


def process_watch(proc: subprocess.Popen[Any], name: str, log_path: Path, *, tail: int = 4000) -> Callable[[bool], str | None]:
    """An `abort` for wait_for: says that `proc` exited, with the end of its log (and the log's end at a
    timeout), so a failure in CI shows why."""

    def check(final: bool) -> str | None:
        code = proc.poll()
        if code is None and not final:
            return None
        text = log_path.read_text(errors="replace")[-tail:] if log_path.exists() else "(no log)"
        state = "is running" if code is None else f"exited with code {code}"
        return f"{name} {state}; the end of its log:\n{text}"

    return check


def get(cluster: Cluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def apply(cluster: Cluster, obj: Mapping[str, Any]) -> None:
    cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))


def status_of(cluster: Cluster, ns: str, name: str = "demo") -> dict[str, Any]:
    return get(cluster, "datamixture", name, "-n", ns).get("status") or {}


CHILD_KINDS = ("deployments", "statefulsets", "services", "configmaps", "secrets", "serviceaccounts",
               "networkpolicies", "poddisruptionbudgets", "persistentvolumeclaims")


def children(cluster: Cluster, ns: str, name: str = "demo") -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> object of every child a mixture's operator labelled."""
    out = {}
    for kind in CHILD_KINDS:
        for o in get(cluster, kind, "-n", ns, "-l", f"mixplane.io/instance={name}")["items"]:
            out[(o["kind"], o["metadata"]["name"])] = o
    return out


def applied(cluster: Cluster, ns: str, name: str = "demo", timeout: float = 90.0) -> dict[tuple[str, str], dict[str, Any]]:
    """Every child, once the operator has written the status (it does so after applying all of them)."""
    wait_for(f"the operator to write {ns}/{name}'s status", lambda: status_of(cluster, ns, name).get("sources"), timeout,
             abort=_operators_abort)
    return children(cluster, ns, name)


_OPERATORS: list[subprocess.Popen] = []  # operator() children running now (a wait on one fails with its log)


def _operators_abort(final: bool) -> str | None:
    """wait_for's abort: an operator that exited stops the wait at once; a timeout adds the operators' log tails."""
    for p in _OPERATORS:
        if p.poll() is not None:
            return f"the operator exited with {p.returncode}; its log ends:\n{p.log_text()[-4000:]}"  # type: ignore[attr-defined]
    if final and _OPERATORS:
        return "".join(f"\noperator log ends:\n{p.log_text()[-4000:]}" for p in _OPERATORS)  # type: ignore[attr-defined]
    return None


@contextmanager
def operator(cluster: Cluster, namespace: str, *, kubeconfig: str | os.PathLike | None = None,
             args: list[str] | None = None, **env: str) -> Iterator[subprocess.Popen]:
    """`mixplane operator --namespace NS` as a child process (what the chart's Deployment runs); `.log_text()`."""
    path = cluster.workdir / f"operator-{namespace}-{time.monotonic_ns()}.log"
    log = open(path, "w")  # noqa: SIM115 - the child writes it until the context ends
    e = {**cluster.env(), "PYTHONPATH": str(ROOT / "src"), "MIXPLANE_IMAGE": "mixplane:test",
         "MIXPLANE_SCALE_INTERVAL_S": "2", **env}
    if kubeconfig is not None:
        e["KUBECONFIG"] = str(kubeconfig)
    argv = args if args is not None else ["--log-level", "INFO", "operator", "--namespace", namespace]
    p = subprocess.Popen([sys.executable, "-m", "mixplane.cli", *argv], env=e, stdout=log, stderr=subprocess.STDOUT)
    p.log_text = lambda: path.read_text(errors="replace")  # type: ignore[attr-defined]
    _OPERATORS.append(p)
    try:
        yield p
    finally:
        _OPERATORS.remove(p)
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
        log.close()


def sa_kubeconfig(cluster: Cluster, ns: str, sa_name: str, path: Path) -> Path:
    """A kubeconfig holding the token the controller manager minted for ServiceAccount `sa_name` (what its pod mounts)."""

    def token() -> str | None:
        sa = get(cluster, "-n", ns, "sa", sa_name)
        if not sa.get("secrets"):
            return None
        sec = get(cluster, "-n", ns, "secret", sa["secrets"][0]["name"])
        return base64.b64decode(sec["data"]["token"]).decode() if (sec.get("data") or {}).get("token") else None

    tok = wait_for(f"the token of ServiceAccount {sa_name}", token, 90, 0.5, tolerate=True)
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "c", "cluster": {"server": cluster.server, "certificate-authority": str(cluster.ca_file)}}],
        "users": [{"name": "sa", "user": {"token": tok}}],
        "contexts": [{"name": "sa", "context": {"cluster": "c", "user": "sa", "namespace": ns}}]}))
    return path


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args and env values."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


class LocalPods:
    """Pod templates from the API server run as local processes.

    `ports[(pod, container)]` maps each declared containerPort to the local port the process got (the planner's
    `planner` port is `planner_port`, so other pods reach it through the planner Service name)."""

    def __init__(self, cluster: Cluster, ns: str, workdir: Path):
        self.cluster, self.ns, self.workdir = cluster, ns, workdir
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.ports: dict[tuple[str, str], dict[int, int]] = {}
        self.planner_port = free_port()

    def volumes(self, pod_name: str, spec: Mapping[str, Any], containers: list[Mapping[str, Any]]) -> dict[str, str]:
        """mountPath -> local dir with the volume's content (what the kubelet would mount)."""
        vols = {v["name"]: v for v in spec.get("volumes") or []}
        out = {}
        for c in containers:
            for m in c.get("volumeMounts") or []:
                v = vols[m["name"]]
                d = self.workdir / pod_name / m["name"]
                if "persistentVolumeClaim" in v:  # a claim outlives its pods: every pod mounting it sees one dir
                    d = self.workdir / "pvc" / v["persistentVolumeClaim"]["claimName"]
                d.mkdir(parents=True, exist_ok=True)
                if "configMap" in v:
                    cm = get(self.cluster, "configmap", v["configMap"]["name"], "-n", self.ns)
                    for it in v["configMap"].get("items") or [{"key": k, "path": k} for k in cm["data"]]:
                        (d / it["path"]).write_text(cm["data"][it["key"]])
                elif "secret" in v:
                    self.write_secret(d, v["secret"]["secretName"], v["secret"].get("items"))
                elif "projected" in v:  # secrets projected into one dir (a component's key dir)
                    self.write_projected(d, v["projected"])
                out[m["mountPath"]] = str(d)
        return out

    def write_secret(self, d: Path, name: str, items: list[Mapping[str, Any]] | None, optional: bool = False) -> None:
        """A Secret's keys (or `items` of it) as files in `d` (0600), as the kubelet mounts a secret volume."""
        os.chmod(d, 0o700)
        r = self.cluster.kubectl("get", "secret", name, "-n", self.ns, "-o", "json", check=not optional)
        if r.returncode:
            return
        data = json.loads(r.stdout).get("data") or {}
        for it in items or [{"key": k, "path": k} for k in data]:
            f = d / it["path"]
            f.write_bytes(base64.b64decode(data[it["key"]]))
            os.chmod(f, 0o600)

    def write_projected(self, d: Path, projected: Mapping[str, Any]) -> None:
        """A projected volume's secrets in `d`; called again, it refreshes them (what the kubelet does every sync:
        keys added to a Secret appear, keys removed from it go)."""
        for src in projected.get("sources") or []:
            if "secret" in src:
                sec = src["secret"]
                if not sec.get("items"):  # a whole Secret: what it no longer holds goes away
                    r = self.cluster.kubectl("get", "secret", sec["name"], "-n", self.ns, "-o", "json", check=False)
                    keep = set((json.loads(r.stdout).get("data") or {}) if not r.returncode else ())
                    for f in d.glob("client-r*"):
                        if f.name not in keep:
                            f.unlink()
                self.write_secret(d, sec["name"], sec.get("items"), optional=bool(sec.get("optional")))

    def start(self, pod_name: str, template: Mapping[str, Any], planner_host: str, *,
              only: Callable[[Mapping[str, Any]], bool] | None = None) -> list[subprocess.Popen]:
        """Run the template's containers (those `only` accepts; the mixplane ones must run `mixplane`)."""
        spec = template["spec"]
        containers = [c for c in spec["containers"] if only is None or only(c)]
        mounts = self.volumes(pod_name, spec, containers)
        started = []
        for c in containers:
            ports = {p["containerPort"]: (self.planner_port if c["name"] == "planner" and p["name"] == "planner" else free_port())
                     for p in c.get("ports") or []}
            self.ports[(pod_name, c["name"])] = ports
            env = {"POD_IP": "127.0.0.1", "POD_NAME": pod_name}
            for src in c.get("envFrom") or []:  # a Secret's keys as environment, as the kubelet sets them
                sec = get(self.cluster, "secret", src["secretRef"]["name"], "-n", self.ns)
                env.update({k: base64.b64decode(v).decode() for k, v in (sec.get("data") or {}).items()})
            for e in c.get("env") or []:
                if "value" in e:
                    env[e["name"]] = e["value"]

            def local(v: str, env: Mapping[str, str] = env, ports: Mapping[int, int] = ports) -> str:
                v = expand(v, env).replace("0.0.0.0", "127.0.0.1").replace(planner_host, f"127.0.0.1:{self.planner_port}")
                # one pass, longest mount first, only where a path starts: /tmp must not match inside another path
                alt = "|".join(re.escape(m) for m in sorted(mounts, key=len, reverse=True))
                v = re.sub(rf"(?<![\w/.-])({alt})(?=/|$)", lambda m: mounts[m.group(1)], v)
                for cp, lp in ports.items():
                    v = re.sub(rf"(?<=:){cp}\b", str(lp), v) if ":" in v else (str(lp) if v == str(cp) else v)
                return v

            args = [local(a) for a in c["args"]]
            penv = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **{k: local(v) for k, v in env.items()}}
            assert c["command"] == ["mixplane"], c["command"]
            log = open(self.workdir / f"{pod_name}.{c['name']}.log", "w")  # noqa: SIM115 - the child owns it
            p = subprocess.Popen([sys.executable, "-m", "mixplane.cli", "--log-level", "INFO", *args], env=penv,
                                 stdout=log, stderr=subprocess.STDOUT)
            log.close()
            self.procs.append((pod_name, p))
            started.append(p)
        return started

    def start_mixture(self, kids: Mapping[tuple[str, str], Mapping[str, Any]], planner_host: str, *,
                      planner_pod: str = "demo-planner-0", name: str = "demo") -> None:
        """What the kubelet would run of a mixture's children: its planner pod, every constructor of the
        StatefulSet, and one pod of every loader Deployment with replicas."""
        self.start(planner_pod, kids[("Deployment", f"{name}-planner")]["spec"]["template"], planner_host)
        time.sleep(1.0)
        sts = kids[("StatefulSet", f"{name}-constructor")]
        for i in range(sts["spec"]["replicas"]):
            self.start(f"{name}-constructor-{i}", sts["spec"]["template"], planner_host)
        for (kind, dep), o in kids.items():
            if kind == "Deployment" and o["metadata"]["labels"]["mixplane.io/role"] == "loader" and o["spec"]["replicas"]:
                self.start(f"{dep}-0", o["spec"]["template"], planner_host)

    def stop_pod(self, pod_name: str, sig: int = signal.SIGTERM) -> None:
        """What deleting one pod does: its processes get `sig` (SIGKILL: a node lost)."""
        for n, p in self.procs:
            if n == pod_name and p.poll() is None:
                p.send_signal(sig)
        for n, p in self.procs:
            if n == pod_name:
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)

    def stop(self) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _, p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)

    def dead(self) -> list[tuple[str, int | None]]:
        return [(n, p.returncode) for n, p in self.procs if p.poll() is not None]

    def logs(self, tail: int = 2000) -> str:
        return "\n".join(f"== {f.name}\n{f.read_text(errors='replace')[-tail:]}" for f in sorted(self.workdir.glob("*.log")))


def run_job_pod(pods: LocalPods, pod: Mapping[str, Any], timeout: float = 180.0) -> tuple[int, str]:
    """What a kubelet does with a Job's pod: run its one container here, its termination message file in a local dir
    (the kubelet mounts a file at terminationMessagePath), then write the end into the pod's status (phase, the
    container's terminated state with exit code and message) for the Job controller and the operator to read.
    Returns (exit code, message)."""
    name = pod["metadata"]["name"]
    (c,) = pod["spec"]["containers"]
    path = c.get("terminationMessagePath") or "/dev/termination-log"
    local = {"spec": {**pod["spec"], "volumes": [*pod["spec"].get("volumes", []), {"name": "termination-log", "emptyDir": {}}],
                      "containers": [{**c, "volumeMounts": [*c.get("volumeMounts", []),
                                                            {"name": "termination-log", "mountPath": os.path.dirname(path)}]}]}}
    (p,) = pods.start(name, local, "no-planner.invalid:0")  # a profiling pod talks to no planner
    code = p.wait(timeout)
    f = pods.workdir / name / "termination-log" / os.path.basename(path)
    message = f.read_text()[:4096] if f.exists() else ""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    url = f"/api/v1/namespaces/{pods.ns}/pods/{name}"
    cur = pods.cluster.api(url)
    cur["status"] = {**(cur.get("status") or {}), "phase": "Succeeded" if code == 0 else "Failed",
                     "containerStatuses": [{"name": c["name"], "ready": False, "restartCount": 0, "image": c["image"], "imageID": "",
                                            "state": {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                                                     "message": message, "startedAt": now, "finishedAt": now}}}]}
    pods.cluster.api(url + "/status", "PUT", cur)
    return code, message


def trainer_key_dir(cluster: Cluster, ns: str, secret: str, d: Path) -> Path:
    """The shared client key pair and the servers' public key (what a trainer pod gets under rank_binding: off)."""
    d.mkdir(mode=0o700, exist_ok=True)
    sec = get(cluster, "secret", secret, "-n", ns)
    for item in ("client.key", "client.key_secret", "server.key"):
        (d / item).write_bytes(base64.b64decode(sec["data"][item]))
        os.chmod(d / item, 0o600)
    return d


def trainer_keys(cluster: Cluster, ns: str, d: Path, name: str = "demo") -> dict[int, tuple[Path, str]]:
    """rank -> (key dir, key name) of the trainer pod holding that rank: for each trainer slot, exactly the key
    files the operator's pod webhook mounts into that slot's pod (its ranks' `client-r<A>-<B>` pair and the
    servers' public key), decided by the webhook's own resolver."""
    from mixplane.operator.admission import resolver
    from mixplane.operator.builders import pod_rank_keys
    from mixplane.operator.reconcile import spec_of
    from mixplane.wire import ranks_of_key_name

    obj = get(cluster, "datamixture", name, "-n", ns)
    sec = get(cluster, "secret", f"{name}-keys", "-n", ns)
    resolve = resolver(lambda _n, _ns: obj)
    out: dict[int, tuple[Path, str]] = {}
    for slot in range(len(pod_rank_keys(spec_of(obj)))):
        inj = resolve(name, ns, {"metadata": {"name": f"trainer-{slot}",
                                              "labels": {"mixplane.io/mixture": name, "mixplane.io/trainer-index": str(slot)}}})
        kd = d / f"slot-{slot}"
        kd.mkdir(mode=0o700, parents=True, exist_ok=True)
        for item in inj.key_items:
            (kd / item).write_bytes(base64.b64decode(sec["data"][item]))
            os.chmod(kd / item, 0o600)
        lo, hi = ranks_of_key_name(inj.key_name) or (0, -1)
        out.update({r: (kd, inj.key_name) for r in range(lo, hi + 1)})
    return out


def run_trainers(planner: str, keys: Path | Mapping[int, tuple[Path, str]], world_size: int, steps: int, *,
                 timeout: float = 120.0, keep: Callable[[Mapping[str, Any]], Any] | None = None,
                 pause_s: float = 0.0) -> dict[int, list[Any]]:
    """`world_size` MixtureLoader ranks (threads) reading `steps` batches each, as trainers with the injected env.
    `keys`: one key dir for every rank (its `client` key, or its rank's key when it holds rank keys), or per rank
    the (key dir, key name) its trainer pod got (`trainer_keys`).

    Returns rank -> what `keep(batch)` gave for each batch (default: the step)."""
    from mixplane.client import MixtureLoader
    from mixplane.wire import CurveSetup

    keep = keep or (lambda b: int(b["step"]))
    shared = keys if isinstance(keys, Path) else None
    env = {"MIXPLANE_PLANNER": planner, "MIXPLANE_TIMEOUT_S": str(int(timeout / 2)),
           **({"MIXPLANE_CURVE_DIR": str(shared), "MIXPLANE_CURVE_NAME": "client"} if shared is not None else {})}
    got: dict[int, list[Any]] = {r: [] for r in range(world_size)}
    errors: list[BaseException] = []

    def train(rank: int) -> None:
        try:
            curve = None if isinstance(keys, Path) else CurveSetup.from_dir(*keys[rank])
            loader = MixtureLoader(rank=rank, world_size=world_size, curve=curve)
            for batch in loader:
                got[rank].append(keep(batch))
                time.sleep(pause_s)  # a trainer's step time
                if len(got[rank]) >= steps:
                    break
            if hasattr(loader, "close"):
                loader.close()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors.append(e)

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        threads = [threading.Thread(target=train, args=(r,)) for r in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if errors:
        raise AssertionError(f"trainer failed: {errors!r}")
    return got

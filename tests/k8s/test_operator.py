"""The operator against a real kube-apiserver + controller manager (tests/k8s/conftest.py).

There is no kubelet: pods stay Pending. So the last test reads the pod templates the operator created back
from the API server and runs every container's command, args and env as a local process (volumes from
the ConfigMap / Secret the operator created, downward-API values 127.0.0.1, each pod's ports mapped to free
local ports as its own pod IP would keep them apart), then a MixtureLoader receives batches from them.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.unit.operator_testdata import write_text_and_images

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "datamixtures.mixplane.io.yaml"
pytestmark = pytest.mark.timeout(600)


def wait_for(what, fn, timeout=60.0, every=0.25):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


@pytest.fixture(scope="module")
def crd(k8s_cluster):
    k8s_cluster.kubectl("apply", "-f", str(CRD))
    wait_for("the CRD to be served", lambda: k8s_cluster.kubectl("get", "datamixtures", "-A", check=False).returncode == 0)
    return k8s_cluster


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_text_and_images(tmp_path_factory.mktemp("opdata"), text_rows=600, images=40, side=320)


@contextmanager
def operator(cluster, namespace, **env):
    """`mixplane operator --namespace NS` as a child process (what the chart's Deployment runs)."""
    path = cluster.workdir / f"operator-{namespace}-{time.monotonic_ns()}.log"
    log = open(path, "w")  # noqa: SIM115 - the child writes it until the context ends
    e = {**cluster.env(), "PYTHONPATH": str(ROOT / "src"), "MIXPLANE_IMAGE": "mixplane:test",
         "MIXPLANE_SCALE_INTERVAL_S": "2", **env}
    p = subprocess.Popen([sys.executable, "-m", "mixplane.cli", "--log-level", "INFO", "operator", "--namespace", namespace],
                         env=e, stdout=log, stderr=subprocess.STDOUT)
    p.log_text = lambda: path.read_text(errors="replace")  # type: ignore[attr-defined]
    try:
        yield p
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
        log.close()


def mixture(namespace, data, name="demo", **ann):
    return {
        "apiVersion": "mixplane.io/v1alpha1", "kind": "DataMixture",
        "metadata": {"name": name, "namespace": namespace,
                     "annotations": {"mixplane.io/tokens-per-second": "30000", **ann}},
        "spec": {
            "sources": [{"name": "text", "uri": data["text"], "tokenizer": data["tokenizer"]},
                        {"name": "pairs", "uri": data["pairs"], "kind": "image_text", "columns": ["image", "caption"],
                         "tokenizer": data["tokenizer"], "image": {"patch_size": 14, "max_side": 112, "merge": 4}}],
            "mixture": {"weights": {"text": 0.7, "pairs": 0.3}, "seed": 5},
            "batch": {"sequences": 4, "seq_len": 256},
            "topology": {"modules": {"backbone": {"dp": 2}, "encoder": {"dp": 2}}, "ranks_per_node": 1},
            "strategy": {"name": "vlm_balance"},
            "runtime": {"constructors": "per_node", "window": 8},
        },
    }


def get(cluster, *args):
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def applied(cluster, ns, name="demo"):
    """Every child, once the operator has written the status (it does so after applying all of them)."""
    wait_for("status", lambda: (status_of(cluster, ns, name).get("sources")), 90)
    return children(cluster, ns, name)


def children(cluster, ns, name="demo"):
    out = {}
    for kind in ("deployments", "statefulsets", "services", "configmaps", "secrets", "serviceaccounts",
                 "networkpolicies", "poddisruptionbudgets"):
        for o in get(cluster, kind, "-n", ns, "-l", f"mixplane.io/instance={name}")["items"]:
            out[(o["kind"], o["metadata"]["name"])] = o
    return out


def apply(cluster, obj):
    cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))


def status_of(cluster, ns, name="demo"):
    return get(cluster, "datamixture", name, "-n", ns).get("status") or {}


def test_a_mixture_becomes_owned_children_that_pass_dry_run_and_a_status(crd, k8s_namespace, data):
    cluster, ns = crd, k8s_namespace
    with operator(cluster, ns):
        apply(cluster, mixture(ns, data))
        kids = applied(cluster, ns)
        st = wait_for("status", lambda: (lambda s: s if s.get("sources") else None)(status_of(cluster, ns)), 60)
    owner = get(cluster, "datamixture", "demo", "-n", ns)
    kinds = sorted({k for k, _ in kids})
    assert kinds == ["ConfigMap", "Deployment", "NetworkPolicy", "PodDisruptionBudget", "Secret", "Service",
                     "ServiceAccount", "StatefulSet"]
    for (kind, name), o in kids.items():
        refs = o["metadata"].get("ownerReferences") or []
        assert [(r["kind"], r["name"], r["uid"], r.get("controller")) for r in refs] == \
            [("DataMixture", "demo", owner["metadata"]["uid"], True)], (kind, name)
    # every manifest is accepted by the server again in a server-side dry run
    for (kind, name), o in kids.items():
        o = {k: v for k, v in o.items() if k != "status"}
        o["metadata"] = {k: v for k, v in o["metadata"].items() if k in ("name", "namespace", "labels", "annotations", "ownerReferences")}
        r = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(o), check=False)
        assert r.returncode == 0, (kind, name, r.stderr)
    planner = kids[("Deployment", "demo-planner")]
    assert planner["spec"]["replicas"] == 1 and planner["spec"]["strategy"]["type"] == "Recreate"
    sts = kids[("StatefulSet", "demo-constructor")]
    assert sts["spec"]["replicas"] == 2  # ranks_per_node 1: one constructor per rank's node
    assert {c["type"] for c in st["conditions"]} == {"Ready", "Progressing", "Degraded"}
    assert all(c["observedGeneration"] == owner["metadata"]["generation"] for c in st["conditions"])
    assert st["plannerEndpoint"] == f"tcp://demo-planner.{ns}.svc:7000"
    by_source = {s["name"]: s for s in st["sources"]}
    assert by_source["pairs"]["profile"]["cpuSecondsPerToken"] > by_source["text"]["profile"]["cpuSecondsPerToken"]
    assert {c["type"]: c["reason"] for c in st["conditions"]}["Degraded"] == "AsPlanned"  # measured, not fallback costs
    loaders = [o for (k, _), o in kids.items() if k == "Deployment" and o["metadata"]["labels"]["mixplane.io/role"] == "loader"]
    hosted = sorted(p for o in loaders for p in o["metadata"]["annotations"]["mixplane.io/partitions"].split(","))
    assert hosted == sorted(f"{s}:{r}" for s in ("text", "pairs") for r in range(by_source[s]["partitions"]))


def test_restart_creates_no_duplicates_and_delete_collects_every_child(crd, k8s_namespace, data):
    cluster, ns = crd, k8s_namespace
    with operator(cluster, ns):
        apply(cluster, mixture(ns, data))
        first = applied(cluster, ns)
        wait_for("status", lambda: status_of(cluster, ns).get("sources"), 60)
    profiled = {s["name"]: s["profile"] for s in status_of(cluster, ns)["sources"]}
    with operator(cluster, ns) as op:
        wait_for("the resumed operator", lambda: "Resuming is processed" in op.log_text(), 60)
        second = children(cluster, ns)
        assert sorted(first) == sorted(second)
        assert {k: o["metadata"]["uid"] for k, o in first.items()} == {k: o["metadata"]["uid"] for k, o in second.items()}
        # the profile was kept in the status: the restart did not measure again
        assert {s["name"]: s["profile"] for s in status_of(cluster, ns)["sources"]} == profiled
        # deleting the mixture (the operator lets go of it) leaves the garbage collector to remove every child
        cluster.kubectl("delete", "datamixture", "demo", "-n", ns, "--wait=false")
        wait_for("garbage collection", lambda: not children(cluster, ns), 120, every=1.0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expand(value, env):
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


class LocalPods:
    """Pod templates from the API server run as local processes."""

    def __init__(self, cluster, ns, workdir: Path):
        self.cluster, self.ns, self.workdir = cluster, ns, workdir
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.planner_port = free_port()

    def volumes(self, pod_name, spec) -> dict[str, str]:
        """mountPath -> local dir with the volume's content (what the kubelet would mount)."""
        vols = {v["name"]: v for v in spec.get("volumes") or []}
        out = {}
        for c in spec["containers"]:
            for m in c.get("volumeMounts") or []:
                v = vols[m["name"]]
                d = self.workdir / pod_name / m["name"]
                d.mkdir(parents=True, exist_ok=True)
                if "configMap" in v:
                    cm = get(self.cluster, "configmap", v["configMap"]["name"], "-n", self.ns)
                    for it in v["configMap"].get("items") or [{"key": k, "path": k} for k in cm["data"]]:
                        (d / it["path"]).write_text(cm["data"][it["key"]])
                elif "secret" in v:
                    os.chmod(d, 0o700)
                    sec = get(self.cluster, "secret", v["secret"]["secretName"], "-n", self.ns)
                    for it in v["secret"].get("items") or [{"key": k, "path": k} for k in sec["data"]]:
                        f = d / it["path"]
                        f.write_bytes(base64.b64decode(sec["data"][it["key"]]))
                        os.chmod(f, 0o600)
                out[m["mountPath"]] = str(d)
        return out

    def start(self, pod_name, template, planner_host):
        spec = template["spec"]
        mounts = self.volumes(pod_name, spec)
        for c in spec["containers"]:
            ports = {p["containerPort"]: (self.planner_port if c["name"] == "planner" and p["name"] == "planner" else free_port())
                     for p in c.get("ports") or []}
            env = {"POD_IP": "127.0.0.1", "POD_NAME": pod_name}
            for e in c.get("env") or []:
                if "value" in e:
                    env[e["name"]] = e["value"]

            def local(v: str, env=env, ports=ports) -> str:
                v = expand(v, env).replace("0.0.0.0", "127.0.0.1").replace(planner_host, f"127.0.0.1:{self.planner_port}")
                # one pass, longest mount first, only where a path starts: /tmp must not match inside another path
                alt = "|".join(re.escape(m) for m in sorted(mounts, key=len, reverse=True))
                v = re.sub(rf"(?<![\w/.-])({alt})(?=/|$)", lambda m: mounts[m.group(1)], v)
                for cp, lp in ports.items():
                    v = re.sub(rf"(?<=:){cp}\b", str(lp), v) if ":" in v else (str(lp) if v == str(cp) else v)
                return v

            args = [local(a) for a in c["args"]]
            penv = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **{k: local(v) for k, v in env.items()}}
            assert c["command"] == ["mixplane"]
            log = open(self.workdir / f"{pod_name}.log", "w")
            p = subprocess.Popen([sys.executable, "-m", "mixplane.cli", "--log-level", "INFO", *args], env=penv,
                                 stdout=log, stderr=subprocess.STDOUT)
            log.close()
            self.procs.append((pod_name, p))

    def stop(self):
        for _, p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _, p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)

    def dead(self):
        return [(n, p.returncode) for n, p in self.procs if p.poll() is not None]


def test_manifests_are_runnable_and_a_weight_patch_is_live(crd, k8s_namespace, data, tmp_path):
    cluster, ns = crd, k8s_namespace
    pods = LocalPods(cluster, ns, tmp_path)
    health = free_port()
    with operator(cluster, ns, MIXPLANE_OPERATOR_PLANNER=f"tcp://127.0.0.1:{pods.planner_port}",
                  MIXPLANE_HEALTH_PORT=str(health), MIXPLANE_HEALTH_HOST="127.0.0.1"):
        apply(cluster, mixture(ns, data))
        kids = applied(cluster, ns)
        # the chart's livenessProbe: GET /healthz on MIXPLANE_HEALTH_PORT
        import urllib.request

        assert urllib.request.urlopen(f"http://127.0.0.1:{health}/healthz", timeout=5).status == 200
        planner_host = f"demo-planner.{ns}.svc:7000"
        try:
            pods.start("demo-planner-0", kids[("Deployment", "demo-planner")]["spec"]["template"], planner_host)
            time.sleep(1.0)
            sts = kids[("StatefulSet", "demo-constructor")]
            for i in range(sts["spec"]["replicas"]):
                pods.start(f"demo-constructor-{i}", sts["spec"]["template"], planner_host)
            for (kind, name), o in kids.items():
                if kind == "Deployment" and o["metadata"]["labels"]["mixplane.io/role"] == "loader" and o["spec"]["replicas"]:
                    pods.start(f"{name}-0", o["spec"]["template"], planner_host)
            # a trainer with what the pod webhook gives it: the planner endpoint and the client key
            keys = tmp_path / "trainer-keys"
            keys.mkdir(mode=0o700)
            sec = get(cluster, "secret", "demo-keys", "-n", ns)
            for item in ("client.key", "client.key_secret", "server.key"):
                (keys / item).write_bytes(base64.b64decode(sec["data"][item]))
                os.chmod(keys / item, 0o600)
            env = {"MIXPLANE_PLANNER": f"tcp://127.0.0.1:{pods.planner_port}", "MIXPLANE_CURVE_DIR": str(keys),
                   "MIXPLANE_CURVE_NAME": "client", "MIXPLANE_TIMEOUT_S": "60"}
            got: dict[int, list] = {0: [], 1: []}
            errors: list[BaseException] = []

            def train(rank):
                try:
                    from mixplane.client import MixtureLoader

                    old = dict(os.environ)
                    loader = MixtureLoader(rank=rank, world_size=2)
                    for batch in loader:
                        got[rank].append(int(batch["step"]))
                        if len(got[rank]) >= 6:
                            break
                    loader.close() if hasattr(loader, "close") else None
                    del old
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)

            os.environ.update(env)
            try:
                threads = [threading.Thread(target=train, args=(r,)) for r in (0, 1)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(120)
            finally:
                for k in env:
                    os.environ.pop(k, None)
            assert not errors, (errors, pods.dead())
            assert got[0] == got[1] == list(range(6)), (got, pods.dead())

            # the scaling timer reaches the running planner: the status follows its step
            wait_for("the timer's step", lambda: (status_of(cluster, ns).get("step") or 0) >= 1, 30)

            # kubectl patch of the weights: pairs off -> its loader Deployments run 0 replicas, and the
            # running planner takes the new mixture at a step boundary recorded in the status
            cluster.kubectl("patch", "datamixture", "demo", "-n", ns, "--type", "merge",
                            "-p", json.dumps({"spec": {"mixture": {"weights": {"text": 1.0, "pairs": 0.0}}}}))
            st = wait_for("the update's step", lambda: (status_of(cluster, ns).get("updates") or [None])[-1], 60)
            assert st["effectiveStep"] >= 6 and st["weights"]["pairs"] == 0.0
            deps = children(cluster, ns)
            for (kind, name), o in deps.items():
                if kind == "Deployment" and o["metadata"]["labels"]["mixplane.io/role"] == "loader":
                    parts = o["metadata"]["annotations"]["mixplane.io/partitions"].split(",")
                    want = 0 if all(p.startswith("pairs:") for p in parts) else 1
                    assert o["spec"]["replicas"] == want, (name, parts)
        finally:
            pods.stop()

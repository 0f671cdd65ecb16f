"""The chart's operator Deployment, run as it is written, with only the rights the chart's RBAC gives it.

No kubelet here, so the test applies the rendered chart to the API server, takes the operator container's
args and env from the Deployment, and runs them as a local process authenticated as the chart's
ServiceAccount (its token from the controller manager). Then the API server calls the operator's own webhooks,
and the operator creates a mixture's children: the chart's least-privilege RBAC is enough, and its pod runs.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import helm_python as helm
import pytest
import yaml

from mixplane.operator.crd import CRD_NAME
from tests.k8s.cluster import Cluster, free_port
from tests.k8s.helpers import LocalPods, process_watch, run_job_pod, sa_kubeconfig, wait_for
from tests.unit.operator_testdata import write_text_and_images

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "mixplane"
pytestmark = pytest.mark.timeout(600)


def test_chart_operator_runs_with_chart_rbac_and_serves_its_webhooks(k8s_cluster: Cluster, k8s_namespace: str, tmp_path):
    c, ns = k8s_cluster, k8s_namespace
    c.kubectl("label", "namespace", ns, "mixplane-chart-op=yes")
    c.kubectl("apply", "-f", str(CHART / "crds" / f"{CRD_NAME}.yaml"))
    hook_port, health_port = free_port(), free_port()
    values = {"webhook": {"port": hook_port, "namespaceSelector": {"matchLabels": {"mixplane-chart-op": "yes"}}},
              "operator": {"healthPort": health_port}}
    out = helm.Chart.load(str(CHART)).render(values, name="mixplane", namespace=ns, is_install=True)
    docs = [d for p, t in sorted(out.items()) if p.endswith(".yaml") for d in yaml.safe_load_all(t) if d]
    hooks = [d for d in docs if d["kind"].endswith("WebhookConfiguration")]
    rest = [d for d in docs if d not in hooks]
    c.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rest))

    # the API server cannot reach a Service without pods: point the chart's webhooks at the local process,
    # with a certificate for 127.0.0.1 from the test CA (the chart's own certificate is checked in test_chart)
    cert_dir = tmp_path / "webhook-cert"
    cert_dir.mkdir()
    crt, key = c.issue_cert("chart-operator")
    (cert_dir / "tls.crt").write_bytes(crt.read_bytes())
    (cert_dir / "tls.key").write_bytes(key.read_bytes())
    ca = base64.b64encode(c.ca_file.read_bytes()).decode()
    for h in hooks:
        for w in h["webhooks"]:
            svc = w["clientConfig"].pop("service")
            w["clientConfig"] = {"url": f"https://127.0.0.1:{hook_port}{svc['path']}", "caBundle": ca}
    c.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(hooks))

    # the chart's ServiceAccount token, as the pod would mount it
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    sa_name = dep["spec"]["template"]["spec"]["serviceAccountName"]

    kubeconfig = sa_kubeconfig(c, ns, sa_name, tmp_path / "sa-kubeconfig")

    (container,) = dep["spec"]["template"]["spec"]["containers"]
    env = {}
    for e in container["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        elif e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace":
            env[e["name"]] = ns
    env["MIXPLANE_WEBHOOK_CERT_DIR"] = str(cert_dir)  # the Secret volume's mount path, here
    env["MIXPLANE_WEBHOOK_HOST"] = "127.0.0.1"
    log_path = tmp_path / "operator.log"
    log = open(log_path, "w")  # noqa: SIM115 - the child writes it until the end
    proc = subprocess.Popen([sys.executable, "-m", "mixplane.cli", *container["args"]],
                            env={**os.environ, **env, "KUBECONFIG": str(kubeconfig), "PYTHONPATH": str(REPO / "src"),
                                 "MIXPLANE_SCALE_INTERVAL_S": "2"},
                            stdout=log, stderr=subprocess.STDOUT)
    operator_alive = process_watch(proc, "the operator", log_path)
    try:
        # the liveness probe of the Deployment
        probe = container["livenessProbe"]["httpGet"]
        port = {p["name"]: p["containerPort"] for p in container["ports"]}[probe["port"]]
        wait_for("the operator's liveness endpoint", lambda: urllib.request.urlopen(
            f"http://127.0.0.1:{port}{probe['path']}", timeout=2).status == 200, 90, 0.5, tolerate=True, abort=operator_alive)

        # the API server calls the operator's validating webhook
        data = write_text_and_images(tmp_path / "data", text_rows=300, images=20, side=160)
        good = {"apiVersion": "mixplane.io/v1alpha1", "kind": "DataMixture",
                # profiled by a Job: the chart's rights must cover its Jobs and reading its pods' termination messages
                "metadata": {"name": "demo", "namespace": ns, "annotations": {"mixplane.io/tokens-per-second": "20000",
                                                                              "mixplane.io/profiler": "job"}},
                "spec": {"sources": [{"name": "text", "uri": data["text"], "tokenizer": data["tokenizer"]}],
                         "mixture": {"weights": {"text": 1.0}}, "batch": {"sequences": 4, "seq_len": 128},
                         "topology": {"modules": {"backbone": {"dp": 2}}}, "strategy": {"name": "vanilla"}}}
        bad = json.loads(json.dumps(good))
        bad["metadata"]["name"] = "bad"
        bad["spec"]["mixture"]["weights"]["video"] = 1.0
        r = wait_for("the operator's webhook to refuse a bad mixture", lambda: (lambda r: r if r.returncode else
                     c.kubectl("-n", ns, "delete", "dmix", "bad", "--wait=false", check=False) and None)(
            c.kubectl("apply", "--validate=false", "-f", "-", input=json.dumps(bad), check=False)), 90, 0.5, tolerate=True, abort=operator_alive)
        assert 'admission webhook "datamixtures.mixplane.io" denied the request' in r.stderr
        assert "spec.mixture.weights.video: unknown source 'video' (sources: text)" in r.stderr

        # with the chart's rights only, the operator builds the mixture's children and reports status
        c.kubectl("apply", "-f", "-", input=json.dumps(good))
        job_pod = wait_for("the profiling Job's pod", lambda: json.loads(c.kubectl(
            "-n", ns, "get", "pods", "-l", "mixplane.io/profile-of=demo", "-o", "json").stdout)["items"], 120, 0.5, tolerate=True,
            abort=operator_alive)[0]
        (tmp_path / "pods").mkdir()
        code, message = run_job_pod(LocalPods(c, ns, tmp_path / "pods"), job_pod)
        assert code == 0, message
        deps = wait_for("the operator's Deployments", lambda: json.loads(c.kubectl(
            "-n", ns, "get", "deployments", "-l", "mixplane.io/instance=demo", "-o", "json").stdout)["items"], 120, 0.5, tolerate=True, abort=operator_alive)
        assert all(d["metadata"]["ownerReferences"][0]["kind"] == "DataMixture" for d in deps)
        st = wait_for("status", lambda: (lambda st: st.get("sources") and st)(json.loads(c.kubectl(
            "-n", ns, "get", "dmix", "demo", "-o", "json").stdout).get("status") or {}), 120, 0.5, tolerate=True, abort=operator_alive)
        assert st["sources"][0]["profile"]["measuredBy"] == "job" and st["profiling"]["state"] == "Succeeded", st

        # and the pod webhook injects a labelled trainer pod of slot 0, with the key bound to that pod's ranks
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "trainer", "labels": {
            "mixplane.io/mixture": "demo", "mixplane.io/trainer-index": "0"}},
               "spec": {"containers": [{"name": "train", "image": "trainer:1"}]}}
        c.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(pod))
        got = json.loads(c.kubectl("-n", ns, "get", "pod", "trainer", "-o", "json").stdout)
        envs = {e["name"]: e.get("value") for e in got["spec"]["containers"][0].get("env", [])}
        assert {"MIXPLANE_PLANNER", "MIXPLANE_CURVE_DIR"} <= set(envs)
        assert envs["MIXPLANE_CURVE_NAME"].startswith("client-r0-"), envs
        # the journal claim is among the children (the chart lets the operator create it)
        wait_for("the planner journal's claim", lambda: json.loads(c.kubectl(
            "-n", ns, "get", "pvc", "demo-journal", "-o", "json", check=False).stdout or "{}"), 60, 0.5, tolerate=True, abort=operator_alive)
        # deleting the mixture: the operator removes its finalizer (an update of the object) with the chart's rights
        c.kubectl("-n", ns, "delete", "dmix", "demo", "--wait=false")
        wait_for("the mixture to be gone", lambda: c.kubectl("-n", ns, "get", "dmix", "demo", check=False).returncode != 0,
                 60, 0.5, abort=operator_alive)
        text = log_path.read_text(errors="replace")
        assert "forbidden" not in text.lower(), text[-3000:]
        # every call the operator made under the chart's ServiceAccount succeeded (the API server's audit log;
        # a GET of something not there yet, e.g. the key Secret before the first reconcile, answers 404)
        user = f"system:serviceaccount:{ns}:{sa_name}"
        calls = [e for e in c.audit(user) if e.get("stage") == "ResponseComplete"]
        assert len(calls) > 20, len(calls)
        failed = [(e["verb"], e["requestURI"], e["responseStatus"].get("code")) for e in calls
                  if e["responseStatus"].get("code", 200) >= 400 and not (e["verb"] == "get" and e["responseStatus"]["code"] == 404)]
        assert not failed, failed
        verbs = {(e["verb"], (e.get("objectRef") or {}).get("resource"), (e.get("objectRef") or {}).get("subresource")) for e in calls}
        assert ("patch", "persistentvolumeclaims", None) in verbs and ("patch", "deployments", None) in verbs
        assert ("patch", "datamixtures", "status") in verbs
        assert ("patch", "jobs", None) in verbs and ("list", "pods", None) in verbs  # the profiling Job and its result
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()
        c.kubectl("delete", "validatingwebhookconfiguration,mutatingwebhookconfiguration", "-l",
                  "app.kubernetes.io/instance=mixplane", check=False)

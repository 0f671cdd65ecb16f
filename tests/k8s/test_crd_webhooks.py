"""The DataMixture CRD and the admission webhooks against a real kube-apiserver.

The webhooks are served over HTTPS (certificate from the test CA) by a small server around the pure
functions of mixplane.operator.webhooks, registered with the API server like the chart registers the
operator's: the API server itself calls them.
"""

from __future__ import annotations

import base64
import http.server
import json
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from mixplane.operator.crd import CRD_NAME, crd_yaml
from mixplane.operator.webhooks import INJECTED_ANNOTATION, KEY_MOUNT, Injection, mutate_review, validate_review
from mixplane.spec import DataMixtureSpec, unwrap_document
from tests.k8s.cluster import Cluster

REPO = Path(__file__).resolve().parents[2]


def mixture(name: str = "demo", **spec) -> dict:
    body = {"sources": [{"name": "web", "uri": "/data/web", "kind": "tokens", "columns": ["tokens"]},
                        {"name": "code", "uri": "/data/code", "kind": "tokens", "columns": ["tokens"]}],
            "mixture": {"weights": {"web": 0.7, "code": 0.3}},
            "batch": {"sequences": 8, "seq_len": 256},
            "topology": {"modules": {"backbone": {"dp": 2}}}}
    body.update(spec)
    return {"apiVersion": "mixplane.io/v1alpha1", "kind": "DataMixture", "metadata": {"name": name}, "spec": body}


def apply(c: Cluster, ns: str, obj: dict, check: bool = True):
    """kubectl apply without its client-side check: what is tested here is what the API server refuses."""
    return c.kubectl("-n", ns, "apply", "--validate=false", "-f", "-", input=json.dumps(obj), check=check)


def test_crd_on_disk_is_the_generated_one():
    assert (REPO / "crds" / f"{CRD_NAME}.yaml").read_text() == crd_yaml()


def test_server_fills_in_the_models_defaults(crd: Cluster, k8s_namespace: str):
    apply(crd, k8s_namespace, mixture())
    stored = json.loads(crd.kubectl("-n", k8s_namespace, "get", "datamixture", "demo", "-o", "json").stdout)
    spec = stored["spec"]
    assert spec["runtime"]["window"] == 32 and spec["sources"][0]["shuffle"] == "page" and spec["batch"]["packing"] == "best_fit"
    assert spec["topology"]["order"] == ["tp", "cp", "dp", "pp"] and spec["kubernetes"]["placement"] == "remote"
    assert "name" not in spec, "spec.name is left to metadata.name"
    # what the API server stored is exactly the model's reading of what the user wrote
    raw, _ = unwrap_document(stored)
    written, _ = unwrap_document(mixture())
    assert DataMixtureSpec.model_validate(raw) == DataMixtureSpec.model_validate(written)


def test_schema_refuses_bad_shapes_naming_the_field(crd: Cluster, k8s_namespace: str):
    bad = mixture(name="bad")
    bad["spec"]["sources"][0]["kind"] = "video"
    bad["spec"]["sources"][1]["replicas"] = 0
    bad["spec"]["batch"]["packing"] = "tight"
    r = apply(crd, k8s_namespace, bad, check=False)
    assert r.returncode != 0
    # (1.20 names list items without their index)
    for text in ('spec.sources.kind: Unsupported value: "video"', "spec.sources.replicas: Invalid value: 0",
                 'spec.batch.packing: Unsupported value: "tight"'):
        assert text in r.stderr, r.stderr
    nobatch = mixture(name="nobatch")
    del nobatch["spec"]["batch"]
    r = apply(crd, k8s_namespace, nobatch, check=False)
    assert r.returncode != 0 and "spec.batch" in r.stderr and "Required" in r.stderr


def test_status_subresource_and_printer_columns(crd: Cluster, k8s_namespace: str):
    apply(crd, k8s_namespace, mixture(name="st"))
    path = f"/apis/mixplane.io/v1alpha1/namespaces/{k8s_namespace}/datamixtures/st"
    obj = crd.api(path)
    status = {"phase": "Running", "step": 42, "sourceCount": 2, "loaderPods": 3, "observedGeneration": obj["metadata"]["generation"],
              "conditions": [{"type": "Ready", "status": "True", "reason": "AllUp"},
                             {"type": "Progressing", "status": "False"}, {"type": "Degraded", "status": "False"}],
              "sources": [{"name": "web", "targetWeight": 0.7, "realisedWeight": 0.69, "partitions": 2, "loaderPods": 2}]}
    crd.api(path + "/status", "PUT", {**obj, "status": status})
    # the main resource ignores status; the status subresource ignores spec
    obj2 = crd.api(path)
    assert obj2["status"]["step"] == 42 and obj2["metadata"]["generation"] == obj["metadata"]["generation"]
    table = crd.kubectl("-n", k8s_namespace, "get", "dmix", "st").stdout.splitlines()
    assert table[0].split() == ["NAME", "PHASE", "STEP", "SOURCES", "LOADERS", "READY", "REALISED", "AGE"]
    assert table[1].split()[:7] == ["st", "Running", "42", "2", "3", "True", "0.69"]


# ---- webhooks, called by the API server ----

class _Handler(http.server.BaseHTTPRequestHandler):
    injections: dict[tuple[str, str], Injection] = {}

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        try:
            if self.path.startswith("/validate-mixture"):
                out = validate_review(review)
            else:
                out = mutate_review(review, lambda name, ns, pod: self.injections.get((name, ns)))
        except Exception as e:  # noqa: BLE001 - answered as a server error, the API server then refuses
            self.send_error(500, repr(e))
            return
        body = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def webhooks(crd: Cluster) -> Iterator[type[_Handler]]:
    cert, key = crd.issue_cert("webhook")
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    port = srv.server_address[1]
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    ca = base64.b64encode(crd.ca_file.read_bytes()).decode()

    def hook(name: str, path: str, rules: list[dict], **extra) -> dict:
        return {"name": name, "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Fail",
                "timeoutSeconds": 10, "clientConfig": {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca},
                "rules": rules, **extra}

    configs = [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
         "metadata": {"name": "mixplane-test"},
         "webhooks": [hook("datamixtures.mixplane.io", "/validate-mixture",
                           [{"apiGroups": ["mixplane.io"], "apiVersions": ["v1alpha1"], "resources": ["datamixtures"],
                             "operations": ["CREATE", "UPDATE"]}])]},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
         "metadata": {"name": "mixplane-test"},
         "webhooks": [hook("pods.mixplane.io", "/mutate-pod",
                           [{"apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"], "operations": ["CREATE"]}],
                           objectSelector={"matchExpressions": [{"key": "mixplane.io/mixture", "operator": "Exists"}]},
                           reinvocationPolicy="IfNeeded")]},
    ]
    crd.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(configs))
    try:
        yield _Handler
    finally:
        crd.kubectl("delete", "validatingwebhookconfiguration,mutatingwebhookconfiguration", "mixplane-test", check=False)
        srv.shutdown()
        srv.server_close()


def _apply_eventually(c: Cluster, ns: str, obj: dict):
    """Webhook configurations take a moment to reach the API server's admission chain."""
    deadline = time.monotonic() + 20
    while True:
        r = apply(c, ns, obj, check=False)
        if r.returncode != 0 or time.monotonic() > deadline:
            return r
        c.kubectl("-n", ns, "delete", obj["kind"].lower(), obj["metadata"]["name"], "--wait=false", check=False)
        time.sleep(0.5)


def test_validating_webhook_refuses_cross_field_problems(webhooks, crd: Cluster, k8s_namespace: str):
    bad = mixture(name="cross", mixture={"weights": {"web": 1.0, "video": 2.0}})
    bad["spec"]["batch"]["sequences"] = 7
    r = _apply_eventually(crd, k8s_namespace, bad)
    assert r.returncode != 0
    assert 'admission webhook "datamixtures.mixplane.io" denied the request' in r.stderr
    assert "spec.mixture.weights.video: unknown source 'video' (sources: web, code)" in r.stderr
    assert "spec.batch: 7 sequences per step do not divide into dp (2) x microbatches (1)" in r.stderr
    # a valid one passes both the schema and the webhook; an update that breaks a rule is refused too
    apply(crd, k8s_namespace, mixture(name="good"))
    broken = mixture(name="good", mixture={"weights": {"web": 1.0}, "phases": [{"start_step": 5, "weights": {"nope": 1.0}}]})
    r = apply(crd, k8s_namespace, broken, check=False)
    assert r.returncode != 0 and "spec.mixture.phases[0].weights.nope: unknown source 'nope'" in r.stderr


def test_mutating_webhook_injects_trainer_pods(webhooks, crd: Cluster, k8s_namespace: str):
    webhooks.injections[("demo", k8s_namespace)] = Injection(
        mixture="demo", planner=f"tcp://demo-planner.{k8s_namespace}.svc:5555", secret_name="demo-curve",
        sidecars=({"name": "loader-web-0", "image": "mixplane:0.1.0", "args": ["loader", "--source", "web"]},))
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "trainer-0", "labels": {"mixplane.io/mixture": "demo"}},
           "spec": {"containers": [{"name": "train", "image": "trainer:1"}]}}
    deadline = time.monotonic() + 20
    while True:  # until the webhook configuration is live
        apply(crd, k8s_namespace, pod)
        got = json.loads(crd.kubectl("-n", k8s_namespace, "get", "pod", "trainer-0", "-o", "json").stdout)
        if INJECTED_ANNOTATION in (got["metadata"].get("annotations") or {}) or time.monotonic() > deadline:
            break
        crd.kubectl("-n", k8s_namespace, "delete", "pod", "trainer-0", "--wait=false", "--grace-period=0", "--force", check=False)
        time.sleep(0.5)
    containers = {c["name"]: c for c in got["spec"]["containers"]}
    assert set(containers) == {"train", "loader-web-0"}
    env = {e["name"]: e.get("value") for e in containers["train"]["env"]}
    assert env["MIXPLANE_PLANNER"] == f"tcp://demo-planner.{k8s_namespace}.svc:5555"
    assert env["MIXPLANE_CURVE_DIR"] == KEY_MOUNT
    vols = {v["name"]: v for v in got["spec"]["volumes"]}
    assert vols["mixplane-keys"]["secret"]["secretName"] == "demo-curve"
    # a pod naming a mixture that does not exist is refused with the label's path
    other = {**pod, "metadata": {"name": "trainer-1", "labels": {"mixplane.io/mixture": "nope"}}}
    r = apply(crd, k8s_namespace, other, check=False)
    assert r.returncode != 0 and "metadata.labels.mixplane.io/mixture: no DataMixture 'nope'" in r.stderr
    # pods without the label are not touched
    plain = {**pod, "metadata": {"name": "plain"}}
    apply(crd, k8s_namespace, plain)
    got = json.loads(crd.kubectl("-n", k8s_namespace, "get", "pod", "plain", "-o", "json").stdout)
    assert [c["name"] for c in got["spec"]["containers"]] == ["train"]

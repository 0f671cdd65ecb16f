"""The operator's admission endpoint: AdmissionReviews over HTTP answered by the webhook functions."""

from __future__ import annotations

import base64
import json
import threading
import urllib.request

from mixplane.operator.admission import make_server


def post(port, path, review):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(review).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def test_validate_and_mutate_over_http():
    known = {("demo", "ml")}
    srv = make_server("127.0.0.1", 0, None, lambda name, ns: {"metadata": {"name": name}} if (name, ns) in known else None)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    port = srv.server_address[1]
    try:
        bad = {"apiVersion": "mixplane.io/v1alpha1", "kind": "DataMixture", "metadata": {"name": "demo", "namespace": "ml"},
               "spec": {"sources": [{"name": "a", "uri": "/x", "kind": "tokens", "columns": ["t"]}],
                        "mixture": {"weights": {"zz": 1.0}}, "batch": {"sequences": 4, "seq_len": 16}}}
        out = post(port, "/validate-datamixture", {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                                                   "request": {"uid": "1", "operation": "CREATE", "object": bad}})
        assert out["response"]["uid"] == "1" and out["response"]["allowed"] is False
        assert "spec.mixture.weights.zz: unknown source" in out["response"]["status"]["message"]

        pod = {"metadata": {"name": "trainer-0", "namespace": "ml", "labels": {"mixplane.io/mixture": "demo"}},
               "spec": {"containers": [{"name": "train", "image": "x"}]}}
        out = post(port, "/mutate-pod", {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                                         "request": {"uid": "2", "operation": "CREATE", "namespace": "ml", "object": pod}})
        assert out["response"]["allowed"] is True
        patch = json.loads(base64.b64decode(out["response"]["patch"]))
        env = next(op["value"] for op in patch if op["path"] == "/spec/containers")[0]["env"]
        assert {"name": "MIXPLANE_PLANNER", "value": "tcp://demo-planner.ml.svc:7000"} in env
        vols = next(op["value"] for op in patch if op["path"] == "/spec/volumes")
        assert vols[0]["secret"]["secretName"] == "demo-keys"  # the Secret the builders create

        pod["metadata"]["labels"]["mixplane.io/mixture"] = "other"
        out = post(port, "/mutate-pod", {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                                         "request": {"uid": "3", "operation": "CREATE", "namespace": "ml", "object": pod}})
        assert out["response"]["allowed"] is False and "no DataMixture 'other'" in out["response"]["status"]["message"]
    finally:
        srv.shutdown()
        srv.server_close()

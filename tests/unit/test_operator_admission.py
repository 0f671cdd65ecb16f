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


def mixture(name: str, ns: str, **runtime) -> dict:
    return {"apiVersion": "mixplane.io/v1alpha1", "kind": "DataMixture", "metadata": {"name": name, "namespace": ns},
            "spec": {"sources": [{"name": "a", "uri": "/x", "kind": "tokens", "columns": ["t"]}],
                     "batch": {"sequences": 4, "seq_len": 16}, "runtime": runtime,
                     "topology": {"modules": {"backbone": {"dp": 4}}, "ranks_per_node": 2}}}


def test_validate_and_mutate_over_http():
    known = {("demo", "ml"): mixture("demo", "ml")}
    srv = make_server("127.0.0.1", 0, None, lambda name, ns: known.get((name, ns)))
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

        pod = {"metadata": {"name": "trainer-0", "namespace": "ml", "labels": {"mixplane.io/mixture": "demo",
                                                                             "mixplane.io/trainer-index": "1"}},
               "spec": {"containers": [{"name": "train", "image": "x"}]}}
        out = post(port, "/mutate-pod", {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                                         "request": {"uid": "2", "operation": "CREATE", "namespace": "ml", "object": pod}})
        assert out["response"]["allowed"] is True
        patch = json.loads(base64.b64decode(out["response"]["patch"]))
        env = next(op["value"] for op in patch if op["path"] == "/spec/containers")[0]["env"]
        assert {"name": "MIXPLANE_PLANNER", "value": "tcp://demo-planner.ml.svc:7000"} in env
        vols = next(op["value"] for op in patch if op["path"] == "/spec/volumes")
        assert vols[0]["secret"]["secretName"] == "demo-keys"  # the Secret the builders create
        # 4 ranks, 2 per trainer pod: the pod of slot 1 gets the key pair of ranks 2..3 and no other secret
        assert [it["key"] for it in vols[0]["secret"]["items"]] == ["client-r2-3.key", "client-r2-3.key_secret", "server.key"]
        assert {"name": "MIXPLANE_CURVE_NAME", "value": "client-r2-3"} in env

        # a pod with no slot cannot be given its ranks' key: refused with what to do, never given another's key
        loose = {**pod, "metadata": {**pod["metadata"], "labels": {"mixplane.io/mixture": "demo"}}}
        out = post(port, "/mutate-pod", {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                                         "request": {"uid": "4", "operation": "CREATE", "namespace": "ml", "object": loose}})
        assert out["response"]["allowed"] is False
        assert "no trainer slot: label it mixplane.io/trainer-index" in out["response"]["status"]["message"]
        # a slot past the last trainer pod is refused too
        far = {**pod, "metadata": {**pod["metadata"], "labels": {"mixplane.io/mixture": "demo", "mixplane.io/trainer-index": "2"}}}
        out = post(port, "/mutate-pod", {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                                         "request": {"uid": "5", "operation": "CREATE", "namespace": "ml", "object": far}})
        assert out["response"]["allowed"] is False and "outside the mixture's 2 trainer pods" in out["response"]["status"]["message"]
        # rank_binding off: every trainer pod gets the shared client key, slot or not
        known[("open", "ml")] = mixture("open", "ml", rank_binding="off")
        loose["metadata"]["labels"]["mixplane.io/mixture"] = "open"
        out = post(port, "/mutate-pod", {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                                         "request": {"uid": "6", "operation": "CREATE", "namespace": "ml", "object": loose}})
        vols = next(op["value"] for op in json.loads(base64.b64decode(out["response"]["patch"])) if op["path"] == "/spec/volumes")
        assert [it["key"] for it in vols[0]["secret"]["items"]] == ["client.key", "client.key_secret", "server.key"]

        pod["metadata"]["labels"]["mixplane.io/mixture"] = "other"
        out = post(port, "/mutate-pod", {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                                         "request": {"uid": "3", "operation": "CREATE", "namespace": "ml", "object": pod}})
        assert out["response"]["allowed"] is False and "no DataMixture 'other'" in out["response"]["status"]["message"]
    finally:
        srv.shutdown()
        srv.server_close()

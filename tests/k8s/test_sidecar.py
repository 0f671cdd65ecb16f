"""Sidecar placement through the real API server: the operator's pod webhook injects the loader containers the
placement put on each trainer pod's slot, only what does not fit becomes remote loader Deployments, and the
injected containers plus the remote pods, run as local processes, feed trainers.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import yaml

from tests.k8s.helpers import (
    LocalPods,
    applied,
    apply,
    free_port,
    get,
    operator,
    run_trainers,
    status_of,
    wait_for,
)
from tests.unit.operator_testdata import write_text_and_images

pytestmark = pytest.mark.timeout(600)
MIB = 1 << 20


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_text_and_images(tmp_path_factory.mktemp("sidecar-data"), text_rows=400, images=24, side=160)


def sidecar_mixture(ns, data):
    # a fixed profile: pairs needs ~1.1 cores at its share (2 partitions of ~0.57), text ~0.03 (one small pod);
    # 2 trainer pods x 0.6 cores take one pairs partition each, text no longer fits: it scales out to a remote pod
    prof = {"version": 1, "sources": {"text": {"cpu_s_per_token": 1.5e-6, "memory_per_partition": 40 * MIB},
                                      "pairs": {"cpu_s_per_token": 1.2e-4, "memory_per_partition": 60 * MIB}}}
    return {
        "apiVersion": "mixplane.io/v1alpha1", "kind": "DataMixture",
        "metadata": {"name": "demo", "namespace": ns,
                     "annotations": {"mixplane.io/tokens-per-second": "30000", "mixplane.io/profile": json.dumps(prof)}},
        "spec": {
            "sources": [{"name": "text", "uri": data["text"], "tokenizer": data["tokenizer"]},
                        {"name": "pairs", "uri": data["pairs"], "kind": "image_text", "columns": ["image", "caption"],
                         "tokenizer": data["tokenizer"], "image": {"patch_size": 14, "max_side": 112, "merge": 4}}],
            "mixture": {"weights": {"text": 0.7, "pairs": 0.3}, "seed": 5},
            "batch": {"sequences": 4, "seq_len": 256},
            "topology": {"modules": {"backbone": {"dp": 2}, "encoder": {"dp": 2}}, "ranks_per_node": 1},
            "strategy": {"name": "vlm_balance"},
            "runtime": {"constructors": "per_node", "window": 8},
            "kubernetes": {"placement": "sidecar", "trainer_pods": 2, "sidecar_cpu": 0.6, "sidecar_memory_mb": 1024},
        },
    }


def trainer_pod(name, index=None):
    labels = {"mixplane.io/mixture": "demo", "app": "trainer"}
    if index is not None:
        labels["mixplane.io/trainer-index"] = str(index)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "train", "image": "trainer:1", "command": ["python", "train.py"]}]}}


def test_pod_webhook_injects_the_slots_loaders_and_only_the_rest_is_remote(crd, k8s_namespace, data, tmp_path):
    cluster, ns = crd, k8s_namespace
    cluster.kubectl("label", "namespace", ns, f"mixplane-sidecar-test={ns}")
    hook_port = free_port()
    cert_dir = tmp_path / "webhook-cert"
    cert_dir.mkdir()
    crt, key = cluster.issue_cert("sidecar-operator")
    (cert_dir / "tls.crt").write_bytes(crt.read_bytes())
    (cert_dir / "tls.key").write_bytes(key.read_bytes())
    hook = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": f"mixplane-sidecar-{ns}"[:63]},
            "webhooks": [{"name": "pods.mixplane.io", "admissionReviewVersions": ["v1"], "sideEffects": "None",
                          "failurePolicy": "Fail", "timeoutSeconds": 10,
                          "clientConfig": {"url": f"https://127.0.0.1:{hook_port}/mutate-pod",
                                           "caBundle": base64.b64encode(cluster.ca_file.read_bytes()).decode()},
                          "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"], "operations": ["CREATE"]}],
                          "namespaceSelector": {"matchLabels": {"mixplane-sidecar-test": ns}},
                          "objectSelector": {"matchExpressions": [{"key": "mixplane.io/mixture", "operator": "Exists"}]}}]}
    pods = LocalPods(cluster, ns, tmp_path / "pods")
    (tmp_path / "pods").mkdir()
    env = {"MIXPLANE_WEBHOOK_PORT": str(hook_port), "MIXPLANE_WEBHOOK_HOST": "127.0.0.1",
           "MIXPLANE_WEBHOOK_CERT_DIR": str(cert_dir), "MIXPLANE_WEBHOOK_MUTATE_PATH": "/mutate-pod",
           "MIXPLANE_OPERATOR_PLANNER": f"tcp://127.0.0.1:{pods.planner_port}"}
    with operator(cluster, ns, **env) as op:
        try:
            cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(hook))
            apply(cluster, sidecar_mixture(ns, data))
            kids = applied(cluster, ns)
            st = status_of(cluster, ns)
            # the placement: one pairs partition per trainer pod, text scaled out to a remote loader pod
            side = {s["slot"]: s for s in st["sidecars"]}
            assert sorted(side) == [0, 1]
            assert sorted(side[k]["partitions"] for k in side) == ["pairs:0", "pairs:1"]
            assert all(side[k]["cpu"] <= 0.6 for k in side)
            by_source = {s["name"]: s for s in st["sources"]}
            assert by_source["pairs"]["sidecarPartitions"] == 2 and by_source["pairs"]["loaderPods"] == 0
            assert by_source["text"]["sidecarPartitions"] == 0 and by_source["text"]["loaderPods"] == 1
            loaders = {n: o for (k, n), o in kids.items() if k == "Deployment" and o["metadata"]["labels"]["mixplane.io/role"] == "loader"}
            assert [o["metadata"]["annotations"]["mixplane.io/partitions"] for o in loaders.values()] == ["text:0"]

            # trainer pods of slot 0 and 1 get their loaders; a pod without a slot gets the env and key only
            def create(pod):
                r = cluster.kubectl("-n", ns, "create", "-f", "-", input=json.dumps(pod), check=False)
                if r.returncode:
                    cluster.kubectl("-n", ns, "delete", "pod", pod["metadata"]["name"], "--wait=false", check=False)
                    return None
                got = get(cluster, "-n", ns, "pod", pod["metadata"]["name"])
                if "mixplane.io/injected" not in (got["metadata"].get("annotations") or {}):
                    cluster.kubectl("-n", ns, "delete", "pod", pod["metadata"]["name"], "--wait=false", check=False)
                    return None  # created before the webhook configuration reached the admission chain
                return got

            t0 = wait_for("an injected trainer pod", lambda: create(trainer_pod("trainer-0", 0)), 60, 1.0)
            t1 = create(trainer_pod("trainer-1", 1))
            assert t1
            # a pod without a slot cannot be given its ranks' key (rank binding): refused, saying what to do
            r = cluster.kubectl("-n", ns, "create", "-f", "-", input=json.dumps(trainer_pod("trainer-x")), check=False)
            assert r.returncode != 0 and "label it mixplane.io/trainer-index" in r.stderr, r.stderr
            for k, t in ((0, t0), (1, t1)):
                names = [c["name"] for c in t["spec"]["containers"]]
                assert names[0] == "train" and len(names) == 2 and names[1].startswith("mixplane-loader-pairs")
                (car,) = t["spec"]["containers"][1:]
                args = car["args"]
                assert f"{args[args.index('--source') + 1]}:{args[args.index('--replica') + 1]}" == side[k]["partitions"]
                assert car["resources"]["requests"]["cpu"] and car["resources"]["limits"]["memory"]
                assert car["ports"] == [{"name": "mx-metrics-0", "containerPort": 9191, "protocol": "TCP"}]
                envs = {e["name"]: e.get("value") for e in t["spec"]["containers"][0]["env"]}
                assert envs["MIXPLANE_PLANNER"] == f"tcp://demo-planner.{ns}.svc:7000"
                vols = {v["name"]: v for v in t["spec"]["volumes"]}
                assert {"mixplane-keys", "mixplane-loader-spec", "mixplane-loader-keys"} <= set(vols)
                # the trainer's key is its own rank's (2 pods x 1 rank), and the only secret it gets
                assert envs["MIXPLANE_CURVE_NAME"] == f"client-r{k}-{k}"
                assert [i["key"] for i in vols["mixplane-keys"]["secret"]["items"]] == \
                    [f"client-r{k}-{k}.key", f"client-r{k}-{k}.key_secret", "server.key"]

            # runnable: planner, constructors, the remote text loader and the two injected sidecars as processes
            planner_host = f"demo-planner.{ns}.svc:7000"
            pods.start("demo-planner-0", kids[("Deployment", "demo-planner")]["spec"]["template"], planner_host)
            sts = kids[("StatefulSet", "demo-constructor")]
            for i in range(sts["spec"]["replicas"]):
                pods.start(f"demo-constructor-{i}", sts["spec"]["template"], planner_host)
            for name, o in loaders.items():
                pods.start(f"{name}-0", o["spec"]["template"], planner_host)
            for t in (t0, t1):
                pods.start(t["metadata"]["name"], t, planner_host, only=lambda c: c["name"].startswith("mixplane-"))
            # each rank with the key files the webhook mounted into its pod (rank k runs in trainer pod k)
            keys = {}
            for k, t in ((0, t0), (1, t1)):
                train = t["spec"]["containers"][0]
                mounts = pods.volumes(t["metadata"]["name"] + "-train", t["spec"], [train])
                envs = {e["name"]: e.get("value") for e in train["env"]}
                keys[k] = (Path(mounts[envs["MIXPLANE_CURVE_DIR"]]), envs["MIXPLANE_CURVE_NAME"])
            try:
                got = run_trainers(f"tcp://127.0.0.1:{pods.planner_port}", keys, 2, 4, timeout=150)
            except AssertionError as e:
                raise AssertionError(f"{e}; dead: {pods.dead()}\n{pods.logs()}") from None
            assert got[0] == got[1] == list(range(4)), (got, pods.dead())
            assert "Traceback" not in op.log_text(), op.log_text()[-3000:]
        finally:
            pods.stop()
            cluster.kubectl("delete", "mutatingwebhookconfiguration", hook["metadata"]["name"], check=False)

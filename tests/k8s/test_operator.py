"""The operator against a real kube-apiserver + controller manager (tests/k8s/conftest.py).

There is no kubelet: pods stay Pending. So the last test reads the pod templates the operator created back
from the API server and runs every container's command, args and env as a local process (volumes from
the ConfigMap / Secret the operator created, downward-API values 127.0.0.1, each pod's ports mapped to free
local ports as its own pod IP would keep them apart), then a MixtureLoader receives batches from them.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from tests.k8s.helpers import (
    LocalPods,
    applied,
    apply,
    children,
    free_port,
    get,
    operator,
    run_trainers,
    status_of,
    trainer_keys,
    wait_for,
)
from tests.unit.operator_testdata import write_text_and_images

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_text_and_images(tmp_path_factory.mktemp("opdata"), text_rows=600, images=40, side=320)


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


def test_a_mixture_becomes_owned_children_that_pass_dry_run_and_a_status(crd, k8s_namespace, data):
    cluster, ns = crd, k8s_namespace
    with operator(cluster, ns):
        apply(cluster, mixture(ns, data))
        kids = applied(cluster, ns)
        st = wait_for("status", lambda: (lambda s: s if s.get("sources") else None)(status_of(cluster, ns)), 60)
    owner = get(cluster, "datamixture", "demo", "-n", ns)
    kinds = sorted({k for k, _ in kids})
    assert kinds == ["ConfigMap", "Deployment", "NetworkPolicy", "PersistentVolumeClaim", "PodDisruptionBudget", "Secret",
                     "Service", "ServiceAccount", "StatefulSet"]
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
    assert {c["type"] for c in st["conditions"]} == {"Ready", "Progressing", "Degraded", "MixtureApplied", "TopologyApplied",
                                                    "PartitionsApplied"}
    assert all(c["observedGeneration"] == owner["metadata"]["generation"] for c in st["conditions"])
    assert st["plannerEndpoint"] == f"tcp://demo-planner.{ns}.svc:7000"
    by_source = {s["name"]: s for s in st["sources"]}
    assert by_source["pairs"]["profile"]["cpuSecondsPerToken"] > by_source["text"]["profile"]["cpuSecondsPerToken"]
    assert {c["type"]: c["reason"] for c in st["conditions"]}["Degraded"] == "AsPlanned"  # measured, not fallback costs
    loaders = [o for (k, _), o in kids.items() if k == "Deployment" and o["metadata"]["labels"]["mixplane.io/role"] == "loader"]
    hosted = sorted(p for o in loaders for p in o["metadata"]["annotations"]["mixplane.io/partitions"].split(","))
    assert hosted == sorted(f"{s}:{r}" for s in ("text", "pairs") for r in range(by_source[s]["partitions"]))
    # image.decode_at auto: resolved from the profile's image costs into the spec every component reads
    costs = by_source["pairs"]["profile"]["imageCosts"]
    assert costs["images"] > 0 and costs["decodeSeconds"] > 0 and costs["decodedBytes"] > 0
    place = by_source["pairs"]["decodeAt"]
    assert place in ("loader", "constructor", "client") and "decodeAt" not in by_source["text"]
    (spec_map,) = [o for (k, _), o in kids.items() if k == "ConfigMap" and "spec.json" in o.get("data", {})
                   and "-profile-" not in o["metadata"]["name"]]
    pairs_spec = next(s for s in json.loads(spec_map["data"]["spec.json"])["sources"] if s["name"] == "pairs")
    assert pairs_spec["image"]["decode_at"] == place


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


def test_manifests_are_runnable_and_a_weight_patch_is_live(crd, k8s_namespace, data, tmp_path):
    cluster, ns = crd, k8s_namespace
    pods = LocalPods(cluster, ns, tmp_path)
    health = free_port()
    with operator(cluster, ns, MIXPLANE_OPERATOR_PLANNER=f"tcp://127.0.0.1:{pods.planner_port}",
                  MIXPLANE_HEALTH_PORT=str(health), MIXPLANE_HEALTH_HOST="127.0.0.1"):
        apply(cluster, mixture(ns, data))
        kids = applied(cluster, ns)
        # the chart's livenessProbe: GET /healthz on MIXPLANE_HEALTH_PORT
        assert urllib.request.urlopen(f"http://127.0.0.1:{health}/healthz", timeout=5).status == 200
        planner_host = f"demo-planner.{ns}.svc:7000"
        try:
            pods.start_mixture(kids, planner_host)
            # a trainer with what the pod webhook gives it: the planner endpoint and the client key
            keys = trainer_keys(cluster, ns, tmp_path / "trainer-keys")
            try:
                got = run_trainers(f"tcp://127.0.0.1:{pods.planner_port}", keys, 2, 6)
            except AssertionError as e:
                raise AssertionError(f"{e}; dead pods: {pods.dead()}") from None
            assert got[0] == got[1] == list(range(6)), (got, pods.dead())
            # loaders keep their page index on the pod's run volume (the image's home is not writable)
            assert list(tmp_path.glob("demo-loader*/run/pageindex/*.npz")), sorted(p.name for p in tmp_path.iterdir())
            # the planner journals onto its claim (demo-journal), not into the pod's emptyDir
            journal = tmp_path / "pvc" / "demo-journal" / "journal.jsonl"
            # complete lines only: the running planner may be writing the last one
            events = [json.loads(line).get("event") for line in journal.read_text().split("\n")[:-1] if line.strip()]
            assert events[0] == "open" and "step" in events, events[:5]

            # every process serves its metrics on the pod's fixed `metrics` port (here mapped to a local one),
            # a loader hosting several partitions too (merged)
            for (pod, ctr), ports in pods.ports.items():
                if 9090 in ports:
                    body = urllib.request.urlopen(f"http://127.0.0.1:{ports[9090]}/metrics", timeout=5).read().decode()
                    assert "mixplane_component_info" in body, (pod, ctr)
                    if ctr == "loader":
                        assert "mixplane_loader_tokens_total{source=" in body, pod

            # the scaling timer reaches the running planner: the status follows its step
            wait_for("the timer's step", lambda: (status_of(cluster, ns).get("step") or 0) >= 1, 30)
            # and the planner's measured per-source rate reaches the status (what scaling corrects its costs with)
            rates = wait_for("delivered rates", lambda: {s["name"]: s.get("deliveredTokensPerSecond") for s in
                                                         status_of(cluster, ns).get("sources") or []
                                                         if s.get("deliveredTokensPerSecond") is not None}, 30)
            assert set(rates) == {"text", "pairs"} and rates["text"] > 0 and rates["pairs"] > 0
            # with the weight each source realised so far in the phase, next to its target
            srcs = {s["name"]: s for s in status_of(cluster, ns)["sources"]}
            assert abs(sum(s["realisedWeight"] for s in srcs.values()) - 1.0) < 1e-3, srcs
            assert srcs["text"]["targetWeight"] == 0.7 and 0 < srcs["pairs"]["realisedWeight"] < 1, srcs

            # kubectl patch of the weights: pairs off -> its loader Deployments run 0 replicas, and the
            # running planner takes the new mixture at a step boundary recorded in the status
            t0 = time.monotonic()
            cluster.kubectl("patch", "datamixture", "demo", "-n", ns, "--type", "merge",
                            "-p", json.dumps({"spec": {"mixture": {"weights": {"text": 1.0, "pairs": 0.0}}}}))
            st = wait_for("the update's step", lambda: (status_of(cluster, ns).get("updates") or [None])[-1], 60, every=0.05)
            print(f"kubectl patch -> acknowledged in the status: {time.monotonic() - t0:.2f} s")
            mu = status_of(cluster, ns)["mixtureUpdate"]
            assert mu["state"] == "Acknowledged" and mu["effectiveStep"] == st["effectiveStep"]
            assert {c["type"]: c["status"] for c in status_of(cluster, ns)["conditions"]}["MixtureApplied"] == "True"
            assert st["effectiveStep"] >= 6 and st["weights"]["pairs"] == 0.0
            deps = children(cluster, ns)
            for (kind, name), o in deps.items():
                if kind == "Deployment" and o["metadata"]["labels"]["mixplane.io/role"] == "loader":
                    parts = o["metadata"]["annotations"]["mixplane.io/partitions"].split(",")
                    want = 0 if all(p.startswith("pairs:") for p in parts) else 1
                    assert o["spec"]["replicas"] == want, (name, parts)
        finally:
            pods.stop()

"""Mixture-driven scaling end to end in the cluster: the operator's timer follows the schedule's phase change,
re-groups the loader Deployments in the real API server within K intervals, records the decision in the status,
and moves the partitions to the new pods with the data plane's handoff: trainers get exactly the batches of a
run that never scaled.

No kubelet: a thread here plays it. It runs every loader Deployment the operator creates (its pod template as a
local process) and stops the processes of a Deployment the operator deletes.
"""

from __future__ import annotations

import hashlib
import json
import threading

import numpy as np
import pytest

from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from tests.k8s.helpers import (
    LocalPods,
    applied,
    apply,
    get,
    operator,
    run_trainers,
    status_of,
    trainer_keys,
    wait_for,
)
from tests.unit.operator_testdata import write_text_and_images

pytestmark = pytest.mark.timeout(900)
MIB = 1 << 20
STEPS, PHASE = 64, 32
KEYS = ("input_ids", "labels", "source_ids", "segment_source", "segment_key", "segment_start")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_text_and_images(tmp_path_factory.mktemp("scaling-data"), text_rows=1500, images=4, side=64)


def scaling_mixture(ns, data):
    # fixed costs: `code` is expensive. Before the phase it needs ~0.2 cores and shares one loader pod with `web`;
    # from step PHASE it needs ~1.4 cores: 2 partitions in pods of their own (the partitions are sized for the peak)
    prof = {"version": 1, "sources": {"web": {"cpu_s_per_token": 1.5e-6, "memory_per_partition": 40 * MIB},
                                      "code": {"cpu_s_per_token": 6e-5, "memory_per_partition": 40 * MIB}}}
    return {
        "apiVersion": "mixplane.io/v1alpha1", "kind": "DataMixture",
        "metadata": {"name": "demo", "namespace": ns,
                     "annotations": {"mixplane.io/tokens-per-second": "30000", "mixplane.io/profile": json.dumps(prof),
                                     "mixplane.io/scale-on": "declared"}},
        "spec": {
            "sources": [{"name": "web", "uri": data["text"], "tokenizer": data["tokenizer"]},
                        {"name": "code", "uri": data["text"], "tokenizer": data["tokenizer"]}],
            "mixture": {"weights": {"web": 0.9, "code": 0.1}, "seed": 11,
                        "phases": [{"start_step": PHASE, "weights": {"web": 0.2, "code": 0.8}}]},
            "batch": {"sequences": 4, "seq_len": 128},
            "topology": {"modules": {"backbone": {"dp": 2}}},
            "strategy": {"name": "vanilla"},
            "runtime": {"window": 16, "failover_after_s": 2.0},
            "kubernetes": {"journal_mb": 0},
        },
    }


def digest(batch) -> str:
    h = hashlib.sha1()
    for k in KEYS:
        h.update(np.ascontiguousarray(batch[k].numpy()).tobytes())
    return h.hexdigest()


class Kubelet(threading.Thread):
    """Runs the loader Deployments of the mixture as local processes, stops those that go away or go to 0."""

    every_s = 0.5

    def __init__(self, cluster, ns, pods: LocalPods, planner_host: str):
        super().__init__(daemon=True)
        self.cluster, self.ns, self.pods, self.planner_host = cluster, ns, pods, planner_host
        self.running: dict[str, str] = {}  # Deployment -> its partitions annotation
        self.hosts: dict[str, str] = {}  # Deployment -> its host in the planner's partition table
        self.started: list[str] = []
        self.stopped: list[str] = []
        self.stop_flag = threading.Event()
        self.error: BaseException | None = None

    def sync(self) -> None:
        deps = {d["metadata"]["name"]: d for d in get(self.cluster, "deployments", "-n", self.ns, "-l",
                                                       "mixplane.io/instance=demo,mixplane.io/role=loader")["items"]}
        for name in list(self.running):
            if name not in deps or not deps[name]["spec"].get("replicas", 1):
                self.before_stop(name)
                self.pods.stop_pod(f"{name}-0")
                del self.running[name]
                self.stopped.append(name)
        for name, d in deps.items():
            if name not in self.running and d["spec"].get("replicas", 1):
                self.pods.start(f"{name}-0", d["spec"]["template"], self.planner_host)
                self.running[name] = d["metadata"]["annotations"]["mixplane.io/partitions"]
                self.hosts[name] = d["metadata"]["annotations"]["mixplane.io/host"]
                self.started.append(name)

    def before_stop(self, name: str) -> None:
        """Called before the process of a Deployment that went away (or to 0) is stopped."""

    def run(self) -> None:
        try:
            while not self.stop_flag.wait(self.every_s):
                self.sync()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def test_phase_change_regroups_loaders_with_handoff_and_batches_stay_the_same(crd, k8s_namespace, data, tmp_path):
    cluster, ns = crd, k8s_namespace
    pods = LocalPods(cluster, ns, tmp_path / "pods")
    (tmp_path / "pods").mkdir()
    planner_host = f"demo-planner.{ns}.svc:7000"
    with operator(cluster, ns, MIXPLANE_OPERATOR_PLANNER=f"tcp://127.0.0.1:{pods.planner_port}",
                  MIXPLANE_SCALE_INTERVAL_S="1") as op:
        kubelet = None
        try:
            apply(cluster, scaling_mixture(ns, data))
            kids = applied(cluster, ns)
            before = sorted(o["metadata"]["annotations"]["mixplane.io/partitions"] for (k, n), o in kids.items()
                            if k == "Deployment" and o["metadata"]["labels"]["mixplane.io/role"] == "loader")
            st = status_of(cluster, ns)
            assert {s["name"]: s["partitions"] for s in st["sources"]} == {"web": 1, "code": 2}
            assert len(before) == 1 and set(before[0].split(",")) == {"web:0", "code:0", "code:1"}, before
            spec_json = get(cluster, "configmap", "demo-spec", "-n", ns)["data"]["spec.json"]

            pods.start("demo-planner-0", kids[("Deployment", "demo-planner")]["spec"]["template"], planner_host)
            sts = kids[("StatefulSet", "demo-constructor")]
            for i in range(sts["spec"]["replicas"]):
                pods.start(f"demo-constructor-{i}", sts["spec"]["template"], planner_host)
            kubelet = Kubelet(cluster, ns, pods, planner_host)
            kubelet.sync()
            kubelet.start()
            keys = trainer_keys(cluster, ns, tmp_path / "trainer-keys")
            try:
                got = run_trainers(f"tcp://127.0.0.1:{pods.planner_port}", keys, 2, STEPS, timeout=400, keep=digest,
                                   pause_s=0.4)
            except AssertionError as e:
                raise AssertionError(f"{e}; dead: {pods.dead()}\n{pods.logs()}") from None
            assert kubelet.error is None, kubelet.error
            log = op.log_text()

            # the timer decided, ahead of the phase (lookahead) and within K intervals of seeing it, and says so
            st = status_of(cluster, ns)
            ups = [d for d in st.get("scaling") or [] if d["source"] == "code" and d["direction"] == "up"]
            assert ups, (st.get("scaling"), log[-3000:])
            assert ups[0]["step"] < PHASE + 8 and ups[0]["toCores"] > ups[0]["fromCores"]
            # and stayed sane: waits while partitions moved are not taken for a source too expensive for its cores
            assert all(d["toCores"] <= 3.0 for d in st["scaling"]), st["scaling"]
            # the API server now holds the new grouping: code in pods of its own, the shared pod is gone
            now = wait_for("the old loader Deployment to go", lambda: (lambda x: x if len(x) == 3 else None)(sorted(
                d["metadata"]["annotations"]["mixplane.io/partitions"] for d in get(
                    cluster, "deployments", "-n", ns, "-l", "mixplane.io/instance=demo,mixplane.io/role=loader")["items"])), 60)
            assert now == ["code:0", "code:1", "web:0"], now
            # the partitions moved with the data plane's handoff, not by restarting loaders
            assert "handoff: code:0" in log and "handoff: code:1" in log and "handoff: web:0" in log, log[-3000:]
            wait_for("the kubelet to stop the old loader's process", lambda: kubelet.stopped, 10)  # it syncs every 0.5 s
            assert set(kubelet.started) >= {"demo-loader-code-0", "demo-loader-code-1", "demo-loader-web-0"}
        finally:
            if kubelet is not None:
                kubelet.stop_flag.set()
                kubelet.join(10)
            pods.stop()

    # the reference: the same resolved spec in an embedded run that never scaled
    spec = parse_spec(json.loads(spec_json))
    with EmbeddedRuntime(spec, tmp_path / "reference") as rt:
        ref = run_trainers(rt.planner_endpoint, rt.key_dir, 2, STEPS, timeout=300, keep=digest)
    for r in (0, 1):
        assert len(got[r]) == STEPS
        diff = [i for i, (a, b) in enumerate(zip(got[r], ref[r])) if a != b]
        assert not diff, f"rank {r}: steps {diff[:10]} differ from the run that never scaled"

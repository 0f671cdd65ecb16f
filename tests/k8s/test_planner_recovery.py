"""A planner pod lost mid-run in the cluster tier (issue 12 with issue 11's recovery): the operator puts the
planner's journal on a PersistentVolumeClaim (`demo-journal`); the planner process is SIGKILLed (a node lost)
and the Deployment's replacement pod, started from the same template and mounting the same claim, recovers
the session from the journal. Trainers, which keep reading through the loss, get exactly the batches of a
run that never lost its planner.

No kubelet: the pods run as local processes (tests/k8s/helpers.LocalPods); a claim is one local directory
shared by every pod that mounts it, as a ReadWriteOnce volume re-attached to the new pod would be.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from tests.k8s.helpers import LocalPods, applied, apply, get, operator, run_trainers, trainer_keys, wait_for
from tests.k8s.test_scaling import digest
from tests.unit.operator_testdata import write_text_and_images

pytestmark = pytest.mark.timeout(900)
MIB = 1 << 20
STEPS, KILL_AT = 40, 10


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_text_and_images(tmp_path_factory.mktemp("recovery-data"), text_rows=1200, images=4, side=64)


def recovery_mixture(ns: str, data: dict) -> dict:
    prof = {"version": 1, "sources": {"web": {"cpu_s_per_token": 1.5e-6, "memory_per_partition": 40 * MIB},
                                      "docs": {"cpu_s_per_token": 3e-6, "memory_per_partition": 40 * MIB}}}
    return {
        "apiVersion": "mixplane.io/v1alpha1", "kind": "DataMixture",
        "metadata": {"name": "demo", "namespace": ns,
                     "annotations": {"mixplane.io/tokens-per-second": "30000", "mixplane.io/profile": json.dumps(prof)}},
        "spec": {
            "sources": [{"name": "web", "uri": data["text"], "tokenizer": data["tokenizer"]},
                        {"name": "docs", "uri": data["text"], "tokenizer": data["tokenizer"]}],
            "mixture": {"weights": {"web": 0.6, "docs": 0.4}, "seed": 13},
            "batch": {"sequences": 4, "seq_len": 128},
            "topology": {"modules": {"backbone": {"dp": 2}}, "ranks_per_node": 1},
            "strategy": {"name": "vanilla"},
            "runtime": {"window": 16, "constructors": "per_node"},
            # kubernetes.journal_mb keeps its default: the journal lives on a claim
        },
    }


def _events(journal) -> list[dict]:
    """The journal's records so far; a line the planner is still writing (read mid-append) is not one yet."""
    out = []
    for line in journal.read_text().splitlines() if journal.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def test_a_planner_pod_lost_mid_run_recovers_from_its_journal_claim(crd, k8s_namespace, data, tmp_path):
    cluster, ns = crd, k8s_namespace
    pods = LocalPods(cluster, ns, tmp_path / "pods")
    (tmp_path / "pods").mkdir()
    planner_host = f"demo-planner.{ns}.svc:7000"
    with operator(cluster, ns, MIXPLANE_OPERATOR_PLANNER=f"tcp://127.0.0.1:{pods.planner_port}"):
        try:
            apply(cluster, recovery_mixture(ns, data))
            kids = applied(cluster, ns)
            planner = kids[("Deployment", "demo-planner")]
            (vol,) = [v for v in planner["spec"]["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v]
            assert vol["persistentVolumeClaim"]["claimName"] == "demo-journal"
            assert ("PersistentVolumeClaim", "demo-journal") in kids
            spec_json = get(cluster, "configmap", "demo-spec", "-n", ns)["data"]["spec.json"]

            template = planner["spec"]["template"]
            pods.start_mixture(kids, planner_host, planner_pod="demo-planner-a")
            keys = trainer_keys(cluster, ns, tmp_path / "trainer-keys")

            got: dict[int, list[str]] = {}
            failed: list[BaseException] = []

            def train() -> None:
                try:
                    got.update(run_trainers(f"tcp://127.0.0.1:{pods.planner_port}", keys, 2, STEPS, timeout=400,
                                            keep=digest, pause_s=0.15))
                except BaseException as e:  # noqa: BLE001 - reported below
                    failed.append(e)

            trainers = threading.Thread(target=train, daemon=True)
            trainers.start()
            journal = tmp_path / "pods" / "pvc" / "demo-journal" / "journal.jsonl"
            wait_for(f"the planner to journal step {KILL_AT}", lambda: any(
                e.get("event") == "step" and int(e.get("step", -1)) >= KILL_AT for e in _events(journal)), 120,
                abort=lambda final: None if final or not pods.dead() else f"dead: {pods.dead()}\n{pods.logs()}")

            # a node lost: the planner pod's process dies at once; the Deployment's next pod mounts the same claim
            pods.stop_pod("demo-planner-a", signal.SIGKILL)
            killed_at = time.monotonic()
            planned_before = max(int(e["step"]) for e in _events(journal) if e.get("event") == "step")
            assert planned_before < STEPS - 1  # the rest of the run needs the new pod
            pods.start("demo-planner-b", template, planner_host)
            trainers.join(600)
            assert not trainers.is_alive(), "trainers still waiting"
            assert not failed, f"{failed!r}; dead: {pods.dead()}\n{pods.logs()}"
            recovered = [e for e in _events(journal) if e.get("event") == "recover"]
            assert recovered, [e.get("event") for e in _events(journal)][-20:]
            assert max(int(e["step"]) for e in _events(journal) if e.get("event") == "step") >= STEPS - 1
            alive = [n for n, code in pods.dead() if n != "demo-planner-a"]
            assert not alive, pods.logs()
            print(f"planner killed after planning step {planned_before}, recovered from its claim; "
                  f"trainers done {time.monotonic() - killed_at:.1f} s after the kill")
        finally:
            pods.stop()

    # the reference: the same resolved spec in an embedded run whose planner was never lost
    with EmbeddedRuntime(parse_spec(json.loads(spec_json)), tmp_path / "reference") as rt:
        ref = run_trainers(rt.planner_endpoint, rt.key_dir, 2, STEPS, timeout=300, keep=digest)
    for r in (0, 1):
        assert len(got[r]) == STEPS
        diff = [i for i, (a, b) in enumerate(zip(got[r], ref[r])) if a != b]
        assert not diff, (f"rank {r}: steps {diff[:10]} differ from the run that never lost its planner; journal events: "
                          f"{[(e.get('event'), e.get('step')) for e in _events(journal)][-60:]}")

"""Shadow loaders in the cluster: with runtime.shadow_loaders the operator renders a shadow Deployment beside every
loader Deployment; a primary loader lost mid-run (its process SIGKILLed, as a node loss does) is replaced by its
shadow, the trainers get exactly the batches of a run that lost nothing, and the operator neither hands the
partitions back nor deletes anything.

No kubelet: as in test_scaling, a thread here runs the loader Deployments (primaries and shadows) as local processes.
"""

from __future__ import annotations

import json
import signal
import threading

import pytest

from mixplane import control
from mixplane.operator.keys import admin_key_dir, existing_keys
from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from tests.k8s.helpers import LocalPods, applied, apply, get, operator, run_trainers, status_of, trainer_keys, wait_for
from tests.k8s.test_scaling import Kubelet, digest, scaling_mixture
from tests.unit.operator_testdata import write_text_and_images

pytestmark = pytest.mark.timeout(600)
STEPS, KILL_AT = 40, 12


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_text_and_images(tmp_path_factory.mktemp("shadow-data"), text_rows=1500, images=4, side=64)


def shadow_mixture(ns, data):
    """test_scaling's mixture without the phase, every loader with a shadow."""
    m = scaling_mixture(ns, data)
    # a fixed layout for the whole run: this test is about a layout's failover. With the profile's costs as they are
    # (`scale-costs: profiled`; `scale-on: declared`) the scaler's decisions depend on the spec, the profile and the
    # annotations only -- not on what a loaded machine measures, which could make it re-partition or regroup mid-run
    # -- and for these weights they keep one partition per source (checked at the end: no re-partition)
    m["metadata"]["annotations"]["mixplane.io/scale-costs"] = "profiled"
    m["spec"]["mixture"] = {"weights": {"web": 0.6, "code": 0.4}, "seed": 3}
    m["spec"]["runtime"] = {"window": 16, "failover_after_s": 1.0, "shadow_loaders": 1}
    return m


def test_a_lost_primary_loader_is_replaced_by_its_shadow_and_the_batches_stay(crd, k8s_namespace, data, tmp_path):
    cluster, ns = crd, k8s_namespace
    pods = LocalPods(cluster, ns, tmp_path / "pods")
    (tmp_path / "pods").mkdir()
    planner_host = f"demo-planner.{ns}.svc:7000"
    with operator(cluster, ns, MIXPLANE_OPERATOR_PLANNER=f"tcp://127.0.0.1:{pods.planner_port}",
                  MIXPLANE_SCALE_INTERVAL_S="1") as op:
        kubelet = None
        try:
            apply(cluster, shadow_mixture(ns, data))
            kids = applied(cluster, ns)
            loaders = {n: o for (k, n), o in kids.items() if k == "Deployment" and o["metadata"]["labels"]["mixplane.io/role"] == "loader"}
            shadows = {n: o for n, o in loaders.items() if "mixplane.io/shadow-of" in o["metadata"]["annotations"]}
            primaries = {n: o for n, o in loaders.items() if n not in shadows}
            assert len(shadows) == len(primaries) >= 1
            spec_json = get(cluster, "configmap", "demo-spec", "-n", ns)["data"]["spec.json"]
            pods.start("demo-planner-0", kids[("Deployment", "demo-planner")]["spec"]["template"], planner_host)
            sts = kids[("StatefulSet", "demo-constructor")]
            for i in range(sts["spec"]["replicas"]):
                pods.start(f"demo-constructor-{i}", sts["spec"]["template"], planner_host)
            kubelet = Kubelet(cluster, ns, pods, planner_host)
            kubelet.sync()
            kubelet.start()
            keys = trainer_keys(cluster, ns, tmp_path / "trainer-keys")
            admin = control.ControlCurve(admin_key_dir("demo", f"{ns}-test", existing_keys(get(cluster, "secret", "demo-keys", "-n", ns))))
            progress = {"step": -1}
            got: dict[int, list] = {}
            errors: list[BaseException] = []

            def keep(batch):
                progress["step"] = int(batch["step"])
                return digest(batch)

            def train():
                try:
                    got.update(run_trainers(f"tcp://127.0.0.1:{pods.planner_port}", keys, 2, STEPS, timeout=400, keep=keep,
                                            pause_s=0.2))
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)

            t = threading.Thread(target=train)
            t.start()
            wait_for("the kill step", lambda: progress["step"] >= KILL_AT, 240)
            victim = sorted(primaries)[0]
            victim_host = primaries[victim]["metadata"]["annotations"]["mixplane.io/host"]
            shadow_host = next(o["metadata"]["annotations"]["mixplane.io/host"] for o in shadows.values()
                               if o["metadata"]["annotations"]["mixplane.io/shadow-of"] == victim_host)
            moved = [p for p in primaries[victim]["metadata"]["annotations"]["mixplane.io/partitions"].split(",")]

            def following() -> dict:
                parts = control.status(f"tcp://127.0.0.1:{pods.planner_port}", 5.0, curve=admin)["partitions"]
                return {p: parts[p] for p in moved}

            # the shadow follows the victim's partitions before the victim is lost (on a loaded machine its process
            # may start late)
            wait_for("the shadow to follow the victim's partitions", lambda: all(
                a["host"] == victim_host and shadow_host in a["shadows"] for a in following().values()), 120)
            pods.stop_pod(f"{victim}-0", signal.SIGKILL)  # the primary's node is gone; nothing restarts it
            t.join(420)
            assert not errors, f"{errors}; dead: {pods.dead()}\n{pods.logs()}"
            # the planner notices the lost primary within failover_after_s of its last beat; the trainers may have
            # finished before that (their steps planned and built ahead), so the promotion is waited for, not read once
            served: dict = {}

            def promoted() -> bool:
                st = control.status(f"tcp://127.0.0.1:{pods.planner_port}", 5.0, curve=admin)
                served.update({p: a["host"] for p, a in st["partitions"].items()})
                return all(served[p] == shadow_host for p in moved)

            wait_for(f"the shadow {shadow_host} promoted for {moved} (served: {served})", promoted, 60)
            # the operator saw the promotion and left it alone: nothing handed back, nothing deleted
            log = op.log_text()
            assert "handoff:" not in log, log[-3000:]
            st = status_of(cluster, ns)
            assert not st.get("repartitions") and not st.get("repartition"), st  # the layout stayed as it was
            assert set(loaders) == {n for (k, n), o in applied(cluster, ns).items() if k == "Deployment"
                                    and o["metadata"]["labels"]["mixplane.io/role"] == "loader"}
            assert kubelet.error is None and not kubelet.stopped, (kubelet.error, kubelet.stopped)
        finally:
            if kubelet is not None:
                kubelet.stop_flag.set()
                kubelet.join(10)
            pods.stop()

    spec = parse_spec(json.loads(spec_json))
    with EmbeddedRuntime(spec.model_copy(update={"runtime": spec.runtime.model_copy(update={"shadow_loaders": 0})}),
                         tmp_path / "reference") as rt:
        ref = run_trainers(rt.planner_endpoint, rt.key_dir, 2, STEPS, timeout=300, keep=digest)
    for r in (0, 1):
        assert len(got[r]) == STEPS
        diff = [i for i, (a, b) in enumerate(zip(got[r], ref[r])) if a != b]
        assert not diff, f"rank {r}: steps {diff[:10]} differ from the run that lost no loader"

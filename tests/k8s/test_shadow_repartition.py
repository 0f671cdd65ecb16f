"""Shadow loaders across a re-partition through the operator: with runtime.shadow_loaders 1, a `kubectl patch` of the
weights makes the operator re-partition `code` 1 -> 2 (test_operator_repartition's scenario). The new loader pods'
shadow Deployments name their primaries' hosts (`--shadow-of`) although their launch lists name no code partition,
so once the partitions moved to the new pods every partition is shadowed again by its own pod's shadow. Then the
primary of the NEW partition is SIGKILLed (a node loss: nothing restarts it): its shadow is promoted, the operator
hands nothing back, and the trainers' batches equal an embedded run given the same update and re-partition at the
same steps (no shadows, no kill).

No kubelet: as in test_scaling, a thread here runs the loader Deployments (primaries and shadows) as local processes.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import pytest

from mixplane import control
from mixplane.operator.keys import admin_key_dir, existing_keys
from tests.k8s.helpers import LocalPods, applied, apply, get, operator, run_trainers, status_of, trainer_keys, wait_for
from tests.k8s.test_operator_repartition import BUSY, PATCH_AT, Kubelet, _repartitioned, calm_mixture, reference
from tests.k8s.test_scaling import digest
from tests.unit.operator_testdata import write_text_and_images

pytestmark = pytest.mark.timeout(1200)
STEPS = 240
HOLD_AT = STEPS - 40  # the trainers wait here until the kill happened: it always lands with steps left to serve


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_text_and_images(tmp_path_factory.mktemp("shadow-repartition-data"), text_rows=1500, images=4, side=64)


def loader_deployments(cluster, ns) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in get(cluster, "deployments", "-n", ns, "-l",
                                                   "mixplane.io/instance=demo,mixplane.io/role=loader")["items"]}


def test_the_new_partitions_keep_their_shadows_and_a_lost_new_primary_is_replaced_by_its_shadow(
        crd, k8s_namespace, data, tmp_path):
    cluster, ns = crd, k8s_namespace
    (tmp_path / "pods").mkdir()
    pods = LocalPods(cluster, ns, tmp_path / "pods")
    planner_host = f"demo-planner.{ns}.svc:7000"
    planner_ep = f"tcp://127.0.0.1:{pods.planner_port}"
    env = {"MIXPLANE_OPERATOR_PLANNER": planner_ep, "MIXPLANE_SCALE_INTERVAL_S": "1"}
    m = calm_mixture(ns, data)
    m["spec"]["runtime"] = {**m["spec"]["runtime"], "shadow_loaders": 1, "failover_after_s": 1.0}
    got: dict[int, list] = {}
    errors: list[BaseException] = []
    progress = {"step": -1}
    killed = threading.Event()
    kubelet = None
    seen: dict[str, Any] = {}
    try:
        with operator(cluster, ns, **env) as op:
            apply(cluster, m)
            kids = applied(cluster, ns)
            spec_json = get(cluster, "configmap", "demo-spec", "-n", ns)["data"]["spec.json"]
            pods.start("demo-planner-0", kids[("Deployment", "demo-planner")]["spec"]["template"], planner_host)
            sts = kids[("StatefulSet", "demo-constructor")]
            for i in range(sts["spec"]["replicas"]):
                pods.start(f"demo-constructor-{i}", sts["spec"]["template"], planner_host)
            admin = control.ControlCurve(admin_key_dir("demo", f"{ns}-test",
                                                       existing_keys(get(cluster, "secret", "demo-keys", "-n", ns))))
            kubelet = Kubelet(cluster, ns, pods, planner_host, admin)
            kubelet.sync()
            kubelet.start()
            tkeys = trainer_keys(cluster, ns, tmp_path / "trainer-keys")

            def keep(batch):
                step = int(batch["step"])
                progress["step"] = max(progress["step"], step)
                if step == HOLD_AT:
                    killed.wait(600)
                return digest(batch)

            def train():
                try:
                    got.update(run_trainers(planner_ep, tkeys, 2, STEPS, timeout=1000, keep=keep, pause_s=0.2))
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            trainers = threading.Thread(target=train)
            trainers.start()
            try:
                wait_for("the trainers to reach the patch step", lambda: progress["step"] >= PATCH_AT or errors, 300)
                cluster.kubectl("patch", "datamixture", "demo", "-n", ns, "--type", "merge", "-p",
                                json.dumps({"spec": {"mixture": {"weights": BUSY}}}))
                wait_for("the re-partition", lambda: _repartitioned(status_of(cluster, ns)) or errors, 300)
                assert not errors, errors

                def shadowed():
                    """Every partition served where the layout wants it and shadowed by a live shadow of its own pod."""
                    deps = loader_deployments(cluster, ns)
                    ann = {n: d["metadata"]["annotations"] for n, d in deps.items() if d["spec"].get("replicas", 1)}
                    of = {a["mixplane.io/host"]: a["mixplane.io/shadow-of"] for a in ann.values() if "mixplane.io/shadow-of" in a}
                    want = {p: a["mixplane.io/host"] for a in ann.values() if "mixplane.io/shadow-of" not in a
                            for p in a["mixplane.io/partitions"].split(",")}
                    t = control.status(planner_ep, 5.0, curve=admin)
                    parts, hosts = t["partitions"], t["hosts"]
                    seen.update(parts=parts, want=want, shadow_of=of,
                                alive=sorted(h for h, x in hosts.items() if x.get("alive")))
                    if {p: a["host"] for p, a in parts.items()} != want:
                        return None
                    if not all(any(of.get(s) == a["host"] and hosts.get(s, {}).get("alive") for s in a["shadows"])
                               for a in parts.values()):
                        return None
                    return want, of, deps

                want, of, deps = wait_for("every partition served where the layout wants it and shadowed by its pod's "
                                          "shadow", shadowed, 300,
                                          abort=lambda final: f"last seen: {seen}" if final else None)
                assert set(want) == {"web:0", "code:0", "code:1"}, want
                for d in deps.values():  # the launch lists name no code partition; the shadows name their primaries
                    args = d["spec"]["template"]["spec"]["containers"][0]["args"]
                    assert not any(a.startswith("code") for a in args), args
                    a = d["metadata"]["annotations"]
                    if "mixplane.io/shadow-of" in a:
                        assert args[args.index("--shadow-of") + 1] == a["mixplane.io/shadow-of"], args
                victim_host = want["code:1"]
                victim = next(n for n, d in deps.items() if d["metadata"]["annotations"]["mixplane.io/host"] == victim_host
                              and "mixplane.io/shadow-of" not in d["metadata"]["annotations"])
                shadow_host = next(s for s, p in of.items() if p == victim_host)
                at_kill = progress["step"]
                mark = len(op.log_text())
                t0 = time.monotonic()
                pods.stop_pod(f"{victim}-0", signal.SIGKILL)  # the new partition's primary is lost; nothing restarts it
                killed.set()

                def promoted() -> bool:
                    st = control.status(planner_ep, 5.0, curve=admin)
                    return st["partitions"]["code:1"]["host"] == shadow_host

                wait_for(f"the shadow {shadow_host} promoted for code:1", promoted, 60)
                promoted_s = time.monotonic() - t0
                trainers.join(900)
            finally:
                killed.set()
            assert not errors, f"{errors}; dead: {pods.dead()}\n{pods.logs()}"
            time.sleep(3)  # a few operator passes after the promotion
            after = op.log_text()[mark:]
            st = status_of(cluster, ns)
            final = control.status(planner_ep, 5.0, curve=admin)
        assert "handoff: code:1" not in after, after[-3000:]  # the promoted shadow is where the layout wants code:1
        assert final["partitions"]["code:1"]["host"] == shadow_host
        assert len(st["repartitions"]) == 1 and st["repartitions"][0]["partitions"] == 2, st["repartitions"]
        assert kubelet.error is None and not kubelet.violations, (kubelet.error, kubelet.violations)
    finally:
        if kubelet is not None:
            kubelet.stop_flag.set()
            kubelet.join(10)
        pods.stop()

    doc = json.loads(spec_json)
    doc["runtime"] = {**doc.get("runtime", {}), "shadow_loaders": 0}
    ref = reference({"status": st, "spec_json": json.dumps(doc), "steps": STEPS}, tmp_path)
    for r in (0, 1):
        assert len(got[r]) == STEPS == len(ref[r])
        diff = [i for i, (a, b) in enumerate(zip(got[r], ref[r])) if a != b]
        assert not diff, f"rank {r}: steps {diff[:10]} differ from the embedded run (no shadows, no kill)"
    print("shadow across re-partition: " + json.dumps({
        "steps": STEPS, "repartition": f"code 1 -> 2 at step {st['repartitions'][0]['effectiveStep']}",
        "killed": victim_host, "at_trainer_step": at_kill, "promoted": shadow_host, "promoted_after_s": round(promoted_s, 2)}))

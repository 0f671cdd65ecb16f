"""Operator chaos: the operator SIGKILLed between API calls, over and over, while a mixture scales up at a phase,
takes a live update and scales down again with handoffs. Trainers must get exactly the batches of a run whose
operator never died, no loader Deployment may go before the planner moved its partitions, every update is
acknowledged once, and the operator left alone at the end converges to the children a never-killed one renders.

The cut points: `MIXPLANE_OPERATOR_KILL_AFTER_CALLS=N` makes the operator SIGKILL itself before its N-th mutating
API call (status patch, apply, delete) -- N drawn at random for every start, so kills fall before the intent is
written, between the intent and the children, between a handoff and a deletion, between an update's send and
its acknowledgment. Some starts are instead killed from outside at a random time (mid-request, mid-send).

No kubelet: as in test_scaling, a thread here runs the loader Deployments as local processes. Before it stops
the process of a Deployment the operator deleted, it asks the planner whether that host still serves a partition.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import pytest

from mixplane import control
from mixplane.operator.annotations import annotations_of
from mixplane.operator.builders import ClusterOptions
from mixplane.operator.keys import existing_keys
from mixplane.operator.reconcile import desired, segments_of, spec_of
from mixplane.operator.scaling import ScalingConfig, projected_shares
from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from tests.k8s.helpers import LocalPods, applied, apply, get, operator, run_trainers, status_of, trainer_keys, wait_for
from tests.k8s.test_scaling import PHASE, digest, scaling_mixture
from tests.k8s.test_scaling import Kubelet as ScalingKubelet
from tests.unit.operator_testdata import write_text_and_images

pytestmark = pytest.mark.timeout(1500)
STEPS = int(os.environ.get("MIXPLANE_CHAOS_STEPS", "240"))
UPDATE_AT = 70  # the trainers' step at which the live update is patched in
MIN_KILLS = int(os.environ.get("MIXPLANE_OPERATOR_KILLS", "50"))
CALM = {"web": 0.9, "code": 0.1}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_text_and_images(tmp_path_factory.mktemp("chaos-data"), text_rows=3000, images=4, side=64)


class Kubelet(ScalingKubelet):
    """test_scaling's kubelet; a Deployment deleted while its host still serves a partition in the planner's table is
    recorded as a violation (checked before its process stops)."""

    every_s = 0.3

    def __init__(self, cluster, ns, pods: LocalPods, planner_host: str, admin):
        super().__init__(cluster, ns, pods, planner_host)
        self.admin = admin
        self.violations: list[str] = []

    def before_stop(self, name: str) -> None:
        st = control.status(f"tcp://127.0.0.1:{self.pods.planner_port}", 5.0, curve=self.admin)
        still = [p for p, a in (st.get("partitions") or {}).items() if a.get("host") == self.hosts[name]]
        if still:
            self.violations.append(f"{name} deleted while host {self.hosts[name]} serves {still}")


def loader_children(cluster, ns):
    out = {}
    for d in get(cluster, "deployments", "-n", ns, "-l", "mixplane.io/instance=demo,mixplane.io/role=loader")["items"]:
        c = d["spec"]["template"]["spec"]["containers"][0]
        out[d["metadata"]["name"]] = (d["metadata"]["annotations"]["mixplane.io/partitions"], d["spec"].get("replicas", 1),
                                      json.dumps(c.get("resources"), sort_keys=True), c["args"])
    return out


def test_operator_killed_between_api_calls_changes_nothing(crd, k8s_namespace, data, tmp_path):
    cluster, ns = crd, k8s_namespace
    rng = random.Random(20261126)
    pods = LocalPods(cluster, ns, tmp_path / "pods")
    (tmp_path / "pods").mkdir()
    planner_host = f"demo-planner.{ns}.svc:7000"
    env = {"MIXPLANE_OPERATOR_PLANNER": f"tcp://127.0.0.1:{pods.planner_port}", "MIXPLANE_SCALE_INTERVAL_S": "1"}
    kills: list[str] = []
    got: dict[int, list] = {}
    trainer_error: list[BaseException] = []
    kubelet = None
    with operator(cluster, ns, **env):  # a calm start: the children exist, the profile is kept
        apply(cluster, scaling_mixture(ns, data))
        kids = applied(cluster, ns)
        wait_for("status", lambda: status_of(cluster, ns).get("mixtureUpdate"), 60)
    try:
        spec_json = get(cluster, "configmap", "demo-spec", "-n", ns)["data"]["spec.json"]
        pods.start("demo-planner-0", kids[("Deployment", "demo-planner")]["spec"]["template"], planner_host)
        sts = kids[("StatefulSet", "demo-constructor")]
        for i in range(sts["spec"]["replicas"]):
            pods.start(f"demo-constructor-{i}", sts["spec"]["template"], planner_host)
        keys = existing_keys(get(cluster, "secret", "demo-keys", "-n", ns))
        from mixplane.operator.keys import admin_key_dir

        admin = control.ControlCurve(admin_key_dir("demo", f"{ns}-test", keys))
        kubelet = Kubelet(cluster, ns, pods, planner_host, admin)
        kubelet.sync()
        kubelet.start()
        tkeys = trainer_keys(cluster, ns, tmp_path / "trainer-keys")
        progress = {"step": -1}
        stamps: list[float] = []

        def keep(batch):
            progress["step"] = int(batch["step"])
            stamps.append(time.monotonic())
            return digest(batch)

        def train():
            try:
                got.update(run_trainers(f"tcp://127.0.0.1:{pods.planner_port}", tkeys, 2, STEPS, timeout=1200, keep=keep,
                                        pause_s=0.25))
            except BaseException as e:  # noqa: BLE001
                trainer_error.append(e)

        trainers = threading.Thread(target=train)
        trainers.start()
        patched = False
        patched_at = acked_at = None
        stages: list[str] = []

        def stage() -> str:
            if not patched:
                return "scale-up" if progress["step"] < PHASE + 8 else "phase"
            return "update" if acked_at is None else "scale-down"
        while trainers.is_alive() or len(kills) < MIN_KILLS:
            if not patched and progress["step"] >= UPDATE_AT:
                # the live update: back to the calm mixture without the phase (scales code down, hands partitions back)
                cluster.kubectl("patch", "datamixture", "demo", "-n", ns, "--type", "merge", "-p",
                                json.dumps({"spec": {"mixture": {"weights": CALM, "phases": [], "temperature": 2.0}}}))
                patched = True
                patched_at = time.monotonic()
                # the two cuts that matter most for "acknowledged exactly once": before the update is sent, and after
                # the planner acknowledged it but before the status says so
                for at in ("update", "after-update"):
                    with operator(cluster, ns, **env, MIXPLANE_OPERATOR_KILL_AT=at) as op:
                        wait_for(f"the cut at {at}", lambda op=op: op.poll() is not None, 60)
                        assert op.returncode == -signal.SIGKILL, op.log_text()[-3000:]
                        kills.append(at)
                        stages.append("update")
                continue
            outside = rng.random() < 0.2
            n = rng.randint(1, 14)  # a pass that applies every child makes ~14 calls: cuts land in every stage
            extra = {} if outside else {"MIXPLANE_OPERATOR_KILL_AFTER_CALLS": str(n)}
            with operator(cluster, ns, **env, **extra) as op:
                deadline = time.monotonic() + (rng.uniform(1.0, 6.0) if outside else 40.0)
                while op.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                if op.poll() is None:
                    op.send_signal(signal.SIGKILL)
                    op.wait(10)
                    kills.append("outside")
                    stages.append(stage())
                else:
                    assert op.returncode == -signal.SIGKILL, op.log_text()[-3000:]
                    line = [x for x in op.log_text().splitlines() if "fault point" in x]
                    kills.append(line[-1].split("(", 1)[-1].rstrip(")").split(" ")[0] if line else "?")
                    stages.append(stage())
            if patched and acked_at is None and (status_of(cluster, ns).get("updates") or []):
                acked_at = time.monotonic()
            if len(kills) > 4 * MIN_KILLS + 200:
                break
        trainers.join()
        assert not trainer_error, trainer_error
        assert patched
        # left alone, the operator converges: the update acknowledged, nothing draining, and the loader Deployments a
        # scaler never restarted settles at for the final mixture (its projected shares)
        body = get(cluster, "datamixture", "demo", "-n", ns)
        prof = json.loads(body["metadata"]["annotations"]["mixplane.io/profile"])
        spec = spec_of(body)

        def expected():
            step = int(status_of(cluster, ns).get("step") or 0)
            proj = projected_shares(segments_of(spec, prof), step, ScalingConfig().lookahead_steps)
            d = desired(body, ClusterOptions(name="demo", namespace=ns, image="mixplane:test"), prof, keys, step=step, shares=proj)
            return proj, {o["metadata"]["name"]: o["metadata"]["annotations"]["mixplane.io/partitions"] for o in d.objects
                          if o["kind"] == "Deployment" and o["metadata"]["labels"].get("mixplane.io/role") == "loader"}

        with operator(cluster, ns, **env):
            st = wait_for("convergence", lambda: (lambda s: s if (s.get("mixtureUpdate") or {}).get("state") == "Acknowledged"
                                                  and s.get("updates")
                                                  and not (s.get("layout") or {}).get("draining")
                                                  and {k: v[0] for k, v in loader_children(cluster, ns).items()} == expected()[1]
                                                  else None)(status_of(cluster, ns)), 180)
        proj, _ = expected()
        if acked_at is None:  # acknowledged only once the operator was left alone
            acked_at = time.monotonic()
        assert kubelet.error is None, kubelet.error
        assert not kubelet.violations, kubelet.violations
        plan_status = control.status(f"tcp://127.0.0.1:{pods.planner_port}", 5.0, curve=admin)
    finally:
        if kubelet is not None:
            kubelet.stop_flag.set()
            kubelet.join(10)
        pods.stop()

    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    print("operator chaos: " + json.dumps({
        "kills": len(kills), "by_cut": {k: kills.count(k) for k in sorted(set(kills))},
        "by_stage": {k: stages.count(k) for k in sorted(set(stages))},
        "patch_to_ack_s": None if acked_at is None or patched_at is None else round(acked_at - patched_at, 2),
        "longest_trainer_stall_s": round(max(gaps), 2) if gaps else None, "steps": STEPS}))
    assert len(kills) >= MIN_KILLS
    # every update acknowledged exactly once: one entry in the status, one application in the planner
    ups = st.get("updates") or []
    assert [u["generation"] for u in ups] == [2], ups
    ids = [u["update_id"] for u in plan_status.get("updates") or []]
    assert ids.count(st["mixtureUpdate"]["updateId"]) == 1, ids
    effective = int(st["mixtureUpdate"]["effectiveStep"])
    assert effective > UPDATE_AT
    # the shares the status keeps are those a scaler never restarted settles at
    shares = (st.get("layout") or {}).get("shares") or {}
    assert set(shares) == set(proj) and all(abs(shares[k] - proj[k]) <= 1e-9 * max(1.0, proj[k]) for k in proj), (shares, proj)
    assert annotations_of(body).tokens_per_s > 0 and spec.mixture.temperature == 2.0

    # the reference: the same spec in an embedded run that never scaled nor had an operator, given the same update
    # at the same step
    from mixplane.mixing import mixture_update_meta

    ref_spec = parse_spec(json.loads(spec_json))
    with EmbeddedRuntime(ref_spec, tmp_path / "reference") as rt:
        control.update_mixture(rt.planner_endpoint, mixture_update_meta(spec, "reference", effective_step=effective),
                               10.0, curve=control.ControlCurve(str(rt.key_dir)))
        ref = run_trainers(rt.planner_endpoint, rt.key_dir, 2, STEPS, timeout=600, keep=digest)
    for r in (0, 1):
        assert len(got[r]) == STEPS
        diff = [i for i, (a, b) in enumerate(zip(got[r], ref[r])) if a != b]
        assert not diff, f"rank {r}: steps {diff[:10]} differ from the run whose operator never died"
    assert PHASE < UPDATE_AT


REPART_KILLS = int(os.environ.get("MIXPLANE_OPERATOR_REPARTITION_KILLS", "20"))
REPART_STEPS = int(os.environ.get("MIXPLANE_OPERATOR_REPARTITION_STEPS", "200"))


def end_state(out, ns) -> dict:
    """What the run ended with, without what names its namespace or object: the loader Deployments (partitions, host,
    replicas, resources, launch args), the applied re-partitions, the update's step, the partitions per source, the
    scaler's allocation."""
    st = out["status"]
    loaders = {}
    for name, d in out["loaders"].items():
        c = d["spec"]["template"]["spec"]["containers"][0]
        ann = d["metadata"]["annotations"]
        loaders[name] = json.loads(json.dumps({"partitions": ann["mixplane.io/partitions"], "host": ann["mixplane.io/host"],
                                               "replicas": d["spec"].get("replicas", 1), "resources": c.get("resources"),
                                               "args": c["args"]}).replace(ns, "NS"))
    return {"loaders": loaders,
            "repartitions": [{k: v for k, v in rp.items() if k != "repartitionId"} for rp in st["repartitions"]],
            "update_step": st["mixtureUpdate"]["effectiveStep"],
            "sources": {s["name"]: (s["partitions"], s["startPartitions"]) for s in st["sources"]},
            "alloc": st["scaler"]["state"]["alloc"], "costs": st["scaler"]["state"]["costs"]}


def test_operator_killed_during_a_repartition_changes_nothing(crd, k8s_namespace, tmp_path):
    """test_operator_repartition's scenario (a patch of the weights makes `code` need 2 partitions: REPARTITION, new
    loader pods, handoffs) run twice with its inputs pinned (run_scenario `pinned`: the scaler sizes by the profile's
    costs and the declared rate, `mixplane.io/scale-costs: profiled`; the trainers wait after the patch step until the
    planner took the update and the re-partition, so both take effect at the step after the last one planned): once
    with one operator, once with the operator SIGKILLed at random mutating API calls, at the two cuts around the
    REPARTITION (before it is sent; after the planner accepted it, before the status says so) and from outside at
    random times, at least REPART_KILLS times. The run without restarts matches the embedded run given the same update
    and re-partition at the same steps; the run with them reaches the same re-partition at the same step, the same
    children and status, and every trainer batch equals the run without restarts'; the re-partition applied and
    recorded exactly once and no loader Deployment deleted while its host served a partition, in both."""
    from tests.k8s.test_operator_repartition import check, run_scenario

    cluster = crd
    data = write_text_and_images(tmp_path / "data", text_rows=1500, images=4, side=64)
    calm = run_scenario(cluster, k8s_namespace, data, tmp_path / "calm", steps=REPART_STEPS, pinned=True)
    assert calm["stages"] == [] and calm["held_through"] is not None
    (tmp_path / "ref").mkdir()
    calm_fig = check(calm, tmp_path / "ref")  # against the embedded run
    ns = f"{k8s_namespace}-chaos"[:63]
    cluster.kubectl("create", "namespace", ns)
    try:
        out = run_scenario(cluster, ns, data, tmp_path / "run", chaos=True, min_kills=REPART_KILLS, steps=REPART_STEPS,
                           pinned=True)
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    want, have = end_state(calm, k8s_namespace), end_state(out, ns)
    diffs = {r: [i for i, (a, b) in enumerate(zip(out["got"][r], calm["got"][r])) if a != b] for r in (0, 1)}
    kills = out["kills"]
    print("operator chaos, re-partition (pinned): " + json.dumps({
        "without_restarts": calm_fig, "held_through": [calm["held_through"], out["held_through"]],
        "kills": len(kills), "by_cut": {k: kills.count(k) for k in sorted(set(kills))},
        "by_stage": {k: out["stages"].count(k) for k in sorted(set(out["stages"]))},
        "repartitions": [want["repartitions"], have["repartitions"]],
        "batches_compared": sum(len(out["got"][r]) for r in (0, 1)),
        "batches_differing": sum(len(d) for d in diffs.values()),
        "end_state_differs": sorted(k for k in want if want[k] != have[k])}))
    # the same re-partition at the same step, the same update step, the same children and status
    assert calm["held_through"] == out["held_through"]
    assert have["repartitions"] == want["repartitions"], (have["repartitions"], want["repartitions"])
    assert have["update_step"] == want["update_step"] == calm["held_through"] + 1
    assert [rp["effectiveStep"] for rp in have["repartitions"]] == [calm["held_through"] + 1]
    assert have == want
    # every batch of both ranks equal to the run whose operator never died (and the invariants of a re-partition)
    assert not any(diffs.values()), {r: d[:10] for r, d in diffs.items()}
    (tmp_path / "ref2").mkdir()
    check(out, tmp_path / "ref2", ref=calm["got"])
    assert len(kills) >= REPART_KILLS
    assert {"repartition", "after-repartition"} <= set(kills), kills

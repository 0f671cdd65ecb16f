"""Partitions follow demand through the operator (issue 20 item 4): a `kubectl patch` of the weights makes one source
need more read throughput than its one partition (one single-threaded loader process) can give. The operator's scaler
raises the source's allocation, wants it re-partitioned, and the operator sends REPARTITION (with an id the planner
applies once); once the planner applied it, the loader layout is packed for the new count, new loader pods start
(their launch lists name none of the re-partitioned source's partitions: the planner's table hands them over) and
the partitions move to them by HANDOFF. The status says so (status.repartitions, sources[*].partitions /
startPartitions, PartitionsApplied), and the trainers' batches equal an embedded run given the same live update and
the same re-partition at the same steps.

`run_scenario` is shared with test_operator_chaos.py, which runs it with the operator SIGKILLed over and over.
No kubelet: as in test_scaling, a thread here runs the loader Deployments as local processes and, before it stops
the process of a Deployment the operator deleted, asks the planner whether that host still serves a partition.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from typing import Any

import pytest

from mixplane import control
from mixplane.operator.keys import admin_key_dir, existing_keys
from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from tests.k8s.helpers import LocalPods, applied, apply, get, operator, run_trainers, status_of, trainer_keys, wait_for
from tests.k8s.test_scaling import Kubelet as ScalingKubelet
from tests.k8s.test_scaling import digest, scaling_mixture
from tests.unit.operator_testdata import write_text_and_images

pytestmark = pytest.mark.timeout(1200)
STEPS = int(os.environ.get("MIXPLANE_REPARTITION_STEPS", "200"))
PATCH_AT = 20  # the trainers' step at which the weights are patched
CALM = {"web": 0.9, "code": 0.1}  # code: ~0.2 cores, one partition sharing a pod with web
BUSY = {"web": 0.2, "code": 0.8}  # code: ~1.5 cores, more than one loader process can use
MAX_PARTITIONS = 2  # code's profiled bound: on a loaded machine the scaler's measured costs rise, and would take
# code to more partitions one after the other (each a separate REPARTITION, checked the same way)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_text_and_images(tmp_path_factory.mktemp("repartition-data"), text_rows=1500, images=4, side=64)


def calm_mixture(ns, data, pinned: bool = False, follow: bool = False) -> dict[str, Any]:
    """`pinned`: the scaler's inputs do not depend on what the machine measures (`scale-costs: profiled`; the rate is
    declared) and the trainers keep a fixed number of steps requested (`prefetch_s: 0`), so how far the planner plans
    while the trainers wait is the same in every run (see run_scenario)."""
    m = scaling_mixture(ns, data)
    m["spec"]["mixture"] = {"weights": dict(CALM), "seed": 11}
    # the planner plans at most 8 steps ahead, the trainers hold 2 s of steps: the embedded reference can then ask a
    # later re-partition after an earlier one was applied, and a stall is not hidden by 10 s of prefetch
    m["spec"]["runtime"] = {**m["spec"]["runtime"], "max_lead_steps": 8, "prefetch_s": 0.0 if pinned else 2.0}
    if pinned:
        m["metadata"]["annotations"]["mixplane.io/scale-costs"] = "profiled"
    if follow:  # partitions may also shrink when demand falls
        m["metadata"]["annotations"]["mixplane.io/repartition"] = "follow"
    prof = json.loads(m["metadata"]["annotations"]["mixplane.io/profile"])
    for p in prof["sources"].values():
        p["max_partitions"] = MAX_PARTITIONS
    m["metadata"]["annotations"]["mixplane.io/profile"] = json.dumps(prof)
    return m


class Kubelet(ScalingKubelet):
    """test_scaling's kubelet; a Deployment deleted while its host still serves a partition in the planner's table is
    recorded as a violation (checked before its process stops)."""

    every_s = 0.3

    def __init__(self, cluster, ns, pods: LocalPods, planner_host: str, admin):
        super().__init__(cluster, ns, pods, planner_host)
        self.admin = admin
        self.violations: list[str] = []
        self.args: dict[str, list[str]] = {}

    def sync(self) -> None:
        super().sync()
        for d in get(self.cluster, "deployments", "-n", self.ns, "-l",
                     "mixplane.io/instance=demo,mixplane.io/role=loader")["items"]:
            self.args.setdefault(d["metadata"]["name"], d["spec"]["template"]["spec"]["containers"][0]["args"])

    def before_stop(self, name: str) -> None:
        st = control.status(f"tcp://127.0.0.1:{self.pods.planner_port}", 5.0, curve=self.admin)
        still = [p for p, a in (st.get("partitions") or {}).items() if a.get("host") == self.hosts[name]]
        if still:
            self.violations.append(f"{name} deleted while host {self.hosts[name]} serves {still}")


def _repartitioned(s: dict[str, Any]) -> bool:
    return bool(s.get("repartitions")) and (s.get("repartition") or {}).get("state") == "Acknowledged"


def run_scenario(cluster, ns, data, tmp_path, *, chaos: bool = False, min_kills: int = 0, seed: int = 20261127,
                 steps: int = STEPS, pinned: bool = False, follow: bool = False) -> dict[str, Any]:
    """The mixture runs calm, the weights are patched at trainer step PATCH_AT, code gets re-partitioned; with
    `chaos`, operators are started and SIGKILLed one after the other (at a random mutating API call, at the named
    cuts around the REPARTITION, or from outside at a random time) until the trainers are done and `min_kills`
    kills happened; then one operator is left alone to converge. Returns what the test checks.

    `pinned`: the update and the re-partition take effect at the same step in every run, however long the operator
    takes. The mixture is `calm_mixture(pinned=True)`; the trainers wait after step PATCH_AT, the weights are patched
    once the planner stopped planning further (`held_through`: the last step planned), and the trainers go on only
    when the planner took both the update and the re-partition: each from the first step not planned,
    `held_through + 1`, whatever happened meanwhile (operator kills, handoffs, retries).

    `follow` (one operator, not pinned): the mixture says `mixplane.io/repartition: follow`, and once code was
    re-partitioned the weights are patched back to CALM: code is re-partitioned to 1 again."""
    assert not (follow and (chaos or pinned))
    rng = random.Random(seed)
    (tmp_path / "pods").mkdir(parents=True)
    pods = LocalPods(cluster, ns, tmp_path / "pods")
    planner_host = f"demo-planner.{ns}.svc:7000"
    env = {"MIXPLANE_OPERATOR_PLANNER": f"tcp://127.0.0.1:{pods.planner_port}", "MIXPLANE_SCALE_INTERVAL_S": "1"}
    kills: list[str] = []
    stages: list[str] = []
    got: dict[int, list] = {}
    trainer_error: list[BaseException] = []
    kubelet = None
    held = threading.Event()  # pinned: set once the planner took the update and the re-partition
    if not pinned:
        held.set()
    with operator(cluster, ns, **env):  # a calm start: the children exist, the profile is kept
        apply(cluster, calm_mixture(ns, data, pinned, follow))
        kids = applied(cluster, ns)
        wait_for("status", lambda: status_of(cluster, ns).get("mixtureUpdate"), 60)
    st0 = status_of(cluster, ns)
    try:
        spec_json = get(cluster, "configmap", "demo-spec", "-n", ns)["data"]["spec.json"]
        pods.start("demo-planner-0", kids[("Deployment", "demo-planner")]["spec"]["template"], planner_host)
        sts = kids[("StatefulSet", "demo-constructor")]
        for i in range(sts["spec"]["replicas"]):
            pods.start(f"demo-constructor-{i}", sts["spec"]["template"], planner_host)
        keys = existing_keys(get(cluster, "secret", "demo-keys", "-n", ns))
        admin = control.ControlCurve(admin_key_dir("demo", f"{ns}-test", keys))
        kubelet = Kubelet(cluster, ns, pods, planner_host, admin)
        kubelet.sync()
        kubelet.start()
        tkeys = trainer_keys(cluster, ns, tmp_path / "trainer-keys")
        progress = {"step": -1}
        stamps: dict[int, float] = {}
        planner_ep = f"tcp://127.0.0.1:{pods.planner_port}"

        def keep(batch):
            step = int(batch["step"])
            progress["step"] = max(progress["step"], step)
            stamps.setdefault(step, time.monotonic())
            if step == PATCH_AT:
                held.wait(900)
            return digest(batch)

        held_through: list[int] = []

        def steady_planned() -> int:
            """The planner's last planned step once it stayed the same for 2 s (the trainers wait: it plans no further)."""
            last, since, deadline = None, time.monotonic(), time.monotonic() + 120
            while time.monotonic() < deadline:
                p = int(control.status(planner_ep, 5.0, curve=admin)["planned_through"])
                if p != last:
                    last, since = p, time.monotonic()
                elif time.monotonic() - since >= 2.0:
                    return p
                time.sleep(0.1)
            raise AssertionError(f"the planner kept planning while the trainers waited (at {last})")

        def release_when_taken() -> None:
            """The trainers go on once the planner lists the update and the re-partition (accepted: its step is set)."""
            try:
                while not trainer_error:
                    try:
                        t = control.status(planner_ep, 5.0, curve=admin)
                    except (TimeoutError, RuntimeError, OSError):
                        t = {}
                    if t.get("updates") and t.get("repartitions"):
                        break
                    time.sleep(0.2)
            finally:
                held.set()

        def train():
            try:
                got.update(run_trainers(f"tcp://127.0.0.1:{pods.planner_port}", tkeys, 2, steps, timeout=1000, keep=keep,
                                        pause_s=0.2))
            except BaseException as e:  # noqa: BLE001
                trainer_error.append(e)

        patched_at: list[float] = []

        def patch(weights=BUSY) -> None:
            if pinned:
                held_through.append(steady_planned())
            cluster.kubectl("patch", "datamixture", "demo", "-n", ns, "--type", "merge", "-p",
                            json.dumps({"spec": {"mixture": {"weights": weights}}}))
            patched_at.append(time.monotonic())
            if pinned:
                threading.Thread(target=release_when_taken, daemon=True).start()

        trainers = threading.Thread(target=train)
        trainers.start()
        named: list[str] = []

        def stage() -> str:
            if not patched_at:
                return "calm"
            s = status_of(cluster, ns)
            if _repartitioned(s):
                return "after-repartition"
            return "repartition" if (s.get("repartition") or ((s.get("scaler") or {}).get("state") or {}).get("repartitions")) \
                else "update/scale-up"

        if not chaos:
            with operator(cluster, ns, **env) as op:
                wait_for("the trainers to reach the patch step", lambda: progress["step"] >= PATCH_AT or trainer_error, 300)
                patch()
                wait_for("the re-partition", lambda: _repartitioned(status_of(cluster, ns)) or trainer_error, 300)
                if follow:  # demand falls again: code back to one partition
                    patch(CALM)
                    wait_for("the re-partition to fewer partitions", lambda: trainer_error or (
                        lambda s: _repartitioned(s) and s["repartitions"][-1]["partitions"] == 1)(status_of(cluster, ns)), 300)
                trainers.join()
                log = op.log_text()
        else:
            log = ""
            while trainers.is_alive() or len(kills) < min_kills:
                if not patched_at and progress["step"] >= PATCH_AT:
                    patch()
                    continue
                s = stage()
                # the two cuts that matter most for "applied exactly once": before the REPARTITION is sent, and after
                # the planner accepted it but before the status says so (each once, armed from the patch on until the
                # re-partition is applied: an operator that takes the update and the re-partition in one life -- the
                # scaler may want it at once -- dies at the cut instead of passing it between two random kills)
                cut = next((c for c in ("repartition", "after-repartition")
                            if s in ("update/scale-up", "repartition") and c not in named), None)
                if cut is not None:
                    named.append(cut)
                    with operator(cluster, ns, **env, MIXPLANE_OPERATOR_KILL_AT=cut) as op:
                        wait_for(f"the cut at {cut}", lambda op=op: op.poll() is not None
                                 or _repartitioned(status_of(cluster, ns)), 120)
                        if op.poll() is not None:
                            assert op.returncode == -signal.SIGKILL, op.log_text()[-3000:]
                            kills.append(cut)
                            stages.append(s)
                            log += op.log_text()
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
                    else:
                        assert op.returncode == -signal.SIGKILL, op.log_text()[-3000:]
                        line = [x for x in op.log_text().splitlines() if "fault point" in x]
                        kills.append(line[-1].split("(", 1)[-1].rstrip(")").split(" ")[0] if line else "?")
                    stages.append(s)
                    log += op.log_text()
                if len(kills) > 4 * min_kills + 200:
                    break
            trainers.join()
        assert not trainer_error, trainer_error
        assert patched_at
        # left alone, the operator converges: the update and the re-partition acknowledged, nothing draining, every
        # partition served where the layout wants it
        with operator(cluster, ns, **env) as op:
            def settled():
                s = status_of(cluster, ns)
                if not (_repartitioned(s) and (s.get("mixtureUpdate") or {}).get("state") == "Acknowledged"
                        and not (s.get("layout") or {}).get("draining")):
                    return None
                table = control.status(f"tcp://127.0.0.1:{pods.planner_port}", 5.0, curve=admin)
                want = {p: d["metadata"]["annotations"]["mixplane.io/host"] for d in get(
                    cluster, "deployments", "-n", ns, "-l", "mixplane.io/instance=demo,mixplane.io/role=loader")["items"]
                    if d["spec"].get("replicas", 1)
                    for p in d["metadata"]["annotations"]["mixplane.io/partitions"].split(",")}
                served = {p: a.get("host") for p, a in (table.get("partitions") or {}).items()}
                return (s, table) if served == want else None

            st, plan_status = wait_for("convergence", settled, 240)
            log += op.log_text()
        assert kubelet.error is None, kubelet.error
        loaders = {d["metadata"]["name"]: d for d in get(cluster, "deployments", "-n", ns, "-l",
                                                          "mixplane.io/instance=demo,mixplane.io/role=loader")["items"]}
        violations = list(kubelet.violations)
        started = list(kubelet.started)
        args = dict(kubelet.args)
    finally:
        held.set()  # a failed run does not leave the trainers waiting
        if kubelet is not None:
            kubelet.stop_flag.set()
            kubelet.join(10)
        pods.stop()
    return {"got": got, "stamps": stamps, "status": st, "start_status": st0, "planner": plan_status,
            "spec_json": spec_json, "kills": kills, "stages": stages, "violations": violations, "started": started,
            "loaders": loaders, "args": args, "log": log, "patched_at": patched_at[0], "steps": steps,
            "held_through": held_through[0] if held_through else None, "follow": follow}


def reference(out: dict[str, Any], tmp_path) -> dict[int, list]:
    """An embedded run of the same resolved spec given the same live updates (status.updates) and the same
    re-partitions at the same steps (no operator, no scaling, no handoffs). A later re-partition of a source can only be asked once the one
    before it was applied: the trainers wait at the step after it until it is asked."""
    from mixplane.mixing import mixture_update_meta

    st = out["status"]
    doc = json.loads(out["spec_json"])
    spec0 = parse_spec(doc)
    rps = list(st["repartitions"])
    gates = {int(rp["effectiveStep"]) + 1: threading.Event() for rp in rps[:-1]}
    errors: list[BaseException] = []
    with EmbeddedRuntime(spec0, tmp_path / "reference") as rt:
        assert [u["generation"] for u in st["updates"]] == list(range(2, 2 + len(st["updates"]))), st["updates"]
        assert st["updates"][-1]["effectiveStep"] == st["mixtureUpdate"]["effectiveStep"]
        for u in st["updates"]:  # each acknowledged update, in order, from its step
            patched = parse_spec({**doc, "mixture": {**doc["mixture"], "weights": u["weights"]}})
            control.update_mixture(rt.planner_endpoint, mixture_update_meta(patched, f"reference-{u['generation']}",
                                                                            effective_step=int(u["effectiveStep"])),
                                   10.0, curve=control.ControlCurve(str(rt.key_dir)))
        rt.repartition(rps[0]["source"], int(rps[0]["partitions"]), step=int(rps[0]["effectiveStep"]), wait=False)

        def ask_the_later_ones():
            try:
                for prev, (_, ev), rp in zip(rps, sorted(gates.items()), rps[1:]):
                    wait_for(f"the re-partition at step {prev['effectiveStep']} applied", lambda prev=prev: any(
                        r.get("applied") and r["step"] == int(prev["effectiveStep"])
                        for r in rt.status().get("repartitions", [])), 300)
                    rt.repartition(rp["source"], int(rp["partitions"]), step=int(rp["effectiveStep"]), wait=False)
                    ev.set()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
                for ev in gates.values():
                    ev.set()

        asker = threading.Thread(target=ask_the_later_ones, daemon=True)
        asker.start()

        def keep(batch):
            ev = gates.get(int(batch["step"]))
            if ev is not None:
                ev.wait(300)
            return digest(batch)

        ref = run_trainers(rt.planner_endpoint, rt.key_dir, 2, out["steps"], timeout=600, keep=keep)
        asker.join(10)
    assert not errors, errors
    return ref


def stall_around(stamps: dict[int, float], step: int, before: int = 2, after: int = 30) -> float:
    """The longest gap between the trainers' batches of consecutive steps around `step`."""
    xs = [stamps[s] for s in sorted(stamps) if step - before <= s <= step + after]
    return max((b - a for a, b in zip(xs, xs[1:])), default=0.0)


def check(out: dict[str, Any], tmp_path, ref: dict[int, list] | None = None) -> dict[str, Any]:
    """What holds with or without operator restarts; returns the figures. The trainers' batches are compared with
    `ref` (another run's) when given, else with the embedded run given the same update and re-partitions."""
    import math

    st, plan_status = out["status"], out["planner"]
    rps = st["repartitions"]  # each applied and recorded exactly once, growing
    assert rps and [rp["source"] for rp in rps] == ["code"] * len(rps), rps
    assert [rp["from"] for rp in rps] == [1] + [rp["partitions"] for rp in rps[:-1]], rps
    if out.get("follow"):  # up for the busy weights, down again for the calm ones
        assert [rp["partitions"] for rp in rps] == [2, 1], rps
    else:
        assert all(rp["partitions"] > rp["from"] for rp in rps) and rps[-1]["partitions"] <= MAX_PARTITIONS, rps
    last = rps[-1]
    assert st["repartition"]["repartitionId"] == last["repartitionId"]
    ids = [r.get("repartition_id") for r in plan_status.get("repartitions") or []]
    assert ids == [rp["repartitionId"] for rp in rps], plan_status.get("repartitions")  # each sent, applied once
    for entry, rp in zip(plan_status["repartitions"], rps):
        assert entry["applied"] and int(entry["step"]) == int(rp["effectiveStep"]) and not entry.get("error"), entry
    assert plan_status["source_partitions"] == {"web": 1, "code": last["partitions"]}
    # the status: partitions read now, the split the planner started with, the condition
    assert {s["name"]: (s["partitions"], s["startPartitions"]) for s in st["sources"]} == \
        {"web": (1, 1), "code": (last["partitions"], 1)}
    cond = {c["type"]: c for c in st["conditions"]}["PartitionsApplied"]
    assert cond["status"] == "True" and cond["reason"] == "Acknowledged", cond
    # the scaler's allocation asks for exactly that many (one process uses at most one core), within the source's
    alloc = st["scaler"]["state"]["alloc"]["code"]
    assert last["partitions"] == min(MAX_PARTITIONS, math.ceil(alloc * 1.05 / 1.0 - 1e-9)), (alloc, rps)
    # the spec the planner reads keeps its start split; no loader names a code partition in its launch list
    assert [s["replicas"] for s in json.loads(out["spec_json"])["sources"]] == [1, 1]
    code_pods = []
    for name, d in out["loaders"].items():
        c = d["spec"]["template"]["spec"]["containers"][0]
        assert not any(a.startswith("code") for a in c["args"]), (name, c["args"])
        parts = d["metadata"]["annotations"]["mixplane.io/partitions"].split(",")
        if any(p.startswith("code:") for p in parts):
            code_pods.append((name, parts))
    placed = sorted(p for _, parts in code_pods for p in parts if p.startswith("code:"))
    assert placed == [f"code:{k}" for k in range(last["partitions"])], code_pods
    # the new pods were started by the kubelet from their Deployments, and partitions moved to them by handoff
    assert any(n in out["started"] for n, _ in code_pods)
    assert "handoff: code:" in out["log"], out["log"][-3000:]
    assert not out["violations"], out["violations"]

    what = "the embedded run" if ref is None else "the run whose operator never died"
    ref = reference(out, tmp_path) if ref is None else ref
    for r in (0, 1):
        assert len(out["got"][r]) == out["steps"] == len(ref[r])
        diff = [i for i, (a, b) in enumerate(zip(out["got"][r], ref[r])) if a != b]
        assert not diff, f"rank {r}: steps {diff[:10]} differ from {what} (re-partitioned at steps " \
                         f"{[rp['effectiveStep'] for rp in rps]})"
    stamps = out["stamps"]
    # (a pinned run's trainers wait after PATCH_AT on purpose: that gap is not a stall)
    gaps = [stamps[b] - stamps[a] for a, b in zip(sorted(stamps), sorted(stamps)[1:])
            if not (out.get("held_through") is not None and a == PATCH_AT)]
    return {"repartitions": [f"{rp['source']} {rp['from']} -> {rp['partitions']} at step {rp['effectiveStep']}" for rp in rps],
            "at_step": rps[0]["effectiveStep"], "update_step": st["mixtureUpdate"]["effectiveStep"],
            "stall_around_repartition_s": round(max(stall_around(stamps, int(rp["effectiveStep"])) for rp in rps), 2),
            "longest_trainer_stall_s": round(max(gaps), 2) if gaps else None, "steps": out["steps"]}


def test_a_patch_that_needs_more_read_throughput_re_partitions_the_source(crd, k8s_namespace, data, tmp_path):
    out = run_scenario(crd, k8s_namespace, data, tmp_path)
    assert out["stages"] == []
    fig = check(out, tmp_path)
    assert fig["at_step"] < STEPS - 20, fig  # the trainers read well past the change
    print("operator re-partition: " + json.dumps(fig))


def test_with_repartition_follow_a_source_whose_demand_falls_is_re_partitioned_to_fewer(crd, k8s_namespace, data, tmp_path):
    """`mixplane.io/repartition: follow`: code is re-partitioned 1 -> 2 for the busy weights, then a second patch back to
    the calm ones makes its allocation fall, and the operator re-partitions it 2 -> 1: the new count served by the pods
    of the layout, the old pods deleted only once they serve nothing, and every batch equal to the embedded run given
    the same two updates and the same two re-partitions at the same steps."""
    out = run_scenario(crd, k8s_namespace, data, tmp_path, follow=True, steps=2 * STEPS)
    fig = check(out, tmp_path)
    print("operator re-partition, follow: " + json.dumps(fig))

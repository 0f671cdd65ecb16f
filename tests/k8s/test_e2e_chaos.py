"""Chaos on the real node during a trainer run (issue 21 item 5, the part done so far): while two trainer pods train,
a loader pod is deleted (`kubectl delete pod`) and a constructor's container is killed (`docker kill`: the kubelet
restarts it in the same pod); in a second run the planner pod is deleted (its journal on the PVC; the Deployment
starts a new one, which recovers from the journal). The trainers' per-step digests are then compared with an embedded
run of the same spec: lost, duplicated and mismatched samples 0 (every (step, rank) once, each digest equal); the longest stall after each kill is reported by
role. Setup as in test_e2e.py (chart, S3 on the bridge, hostPath journal, CPU requests shrunk)."""

from __future__ import annotations

import json
import time

import pytest

from tests.k8s.cluster import Cluster
from tests.k8s.helpers import wait_for
from tests.k8s.test_e2e import (TRAINER, WORLD, bucket, install_chart, journal_volume, kget, reference,  # noqa: F401
                                small_cpu_requests, spec, trainer_job)

STEPS = 60
STEP_S = 0.5
pytestmark = pytest.mark.timeout(1500)


def _lines(c: Cluster, ns: str) -> list[dict]:
    out = []
    for rank in range(WORLD):
        for pod in kget(c, "pods", "-n", ns, "-l", f"job-name=train-{rank}")["items"]:
            log = c.kubectl("-n", ns, "logs", pod["metadata"]["name"], "-c", "train", check=False).stdout
            out += [json.loads(x) for x in log.splitlines() if x.startswith("{") and '"digest"' in x]
    return out


def _pod(c: Cluster, ns: str, selector: str) -> str:
    items = [p for p in kget(c, "pods", "-n", ns, "-l", selector)["items"] if not p["metadata"].get("deletionTimestamp")]
    return items[0]["metadata"]["name"]


@pytest.mark.parametrize("roles", [("loader", "constructor"), ("planner",)], ids=["loader+constructor", "planner"])
def test_kills_during_training_lose_nothing(k8s_node: Cluster, k8s_node_namespace: str, bucket, tmp_path, roles):  # noqa: F811
    c, ns = k8s_node, k8s_node_namespace
    endpoint, creds = bucket
    cfg = install_chart(c, ns)
    try:
        c.kubectl("-n", ns, "create", "secret", "generic", "s3-creds", *[f"--from-literal={k}={v}" for k, v in creds.items()])
        journal_volume(c, ns)
        c.kubectl("-n", ns, "create", "configmap", "trainer", f"--from-file=e2e_trainer.py={TRAINER}")
        mix = {"apiVersion": "mixplane.io/v1alpha1", "kind": "DataMixture",
               "metadata": {"name": "demo", "namespace": ns, "annotations": {"mixplane.io/tokens-per-second": "30000"}},
               "spec": spec(endpoint, "remote")}
        wait_for("the mixture accepted", lambda: c.kubectl("apply", "-f", "-", input=json.dumps(mix), check=False).returncode == 0,
                 30, 1.0)

        def rolled_out() -> bool:
            work = kget(c, "deployments,statefulsets", "-n", ns, "-l", "mixplane.io/instance=demo")["items"]
            return bool(work) and all((o.get("status") or {}).get("readyReplicas", 0) == o["spec"]["replicas"] for o in work)

        wait_for("the mixture's components Ready", rolled_out, 300, 2.0)
        image = f"mixplane-trainer:{c.image.split(':')[1]}"
        for rank in range(WORLD):
            c.kubectl("apply", "-f", "-", input=json.dumps(trainer_job(ns, rank, image, STEPS, STEP_S)))

        def reached(step: int) -> bool:
            lines = _lines(c, ns)
            return all(any(x["rank"] == r and x["step"] >= step for x in lines) for r in range(WORLD))

        kills: list[tuple[str, str, float]] = []  # (role, how, time)
        at = 6
        for role in roles:
            wait_for(f"the trainers at step {at}", lambda at=at: reached(at), 300, 1.0)
            if role == "constructor":  # the container killed; the kubelet restarts it in the same pod
                (cid,) = c.node.docker("ps", "-q", "--filter", f"name=k8s_constructor_demo-constructor-0_{ns}_").stdout.split()
                kills.append((role, f"docker kill {cid[:12]} (demo-constructor-0)", time.time()))
                c.node.docker("kill", cid)
            else:  # the pod deleted; its Deployment starts another (the planner's journal is on the PVC)
                pod = _pod(c, ns, f"mixplane.io/role={role}")
                kills.append((role, f"kubectl delete pod {pod}", time.time()))
                c.kubectl("-n", ns, "delete", "pod", pod, "--wait=false")
            at += 14

        def done() -> bool:
            states = []
            for r in range(WORLD):
                pods = kget(c, "pods", "-n", ns, "-l", f"job-name=train-{r}")["items"]
                states += [x["state"].get("terminated") for p in pods for x in (p.get("status") or {}).get("containerStatuses") or []]
            if any(t and t["exitCode"] for t in states):
                logs = "".join(c.kubectl("-n", ns, "logs", "-l", f"job-name=train-{r}", "-c", "train", "--tail=25", check=False).stdout
                               for r in range(WORLD))
                raise AssertionError(f"a trainer failed after {[(role, how) for role, how, _ in kills]}: {states}\n{logs}")
            return len(states) == WORLD and all(states)

        wait_for("the trainers' end", done, 600, 2.0)
        lines = _lines(c, ns)
        want = reference(endpoint, creds, "remote", tmp_path, STEPS)
        seen: dict[tuple[int, int], list[str]] = {}
        for x in lines:
            seen.setdefault((x["step"], x["rank"]), []).append(x["digest"])
        lost = [k for k in want if k not in seen]
        dup = [k for k, v in seen.items() if len(v) > 1]
        mismatched = [k for k, v in seen.items() if k in want and v[0] != want[k]]
        stalls = {}
        for role, _how, t in kills:
            gaps = []
            for r in range(WORLD):
                ts = sorted(x["t"] for x in lines if x["rank"] == r)
                gaps += [b - a for a, b in zip(ts, ts[1:]) if b > t and a < t + 120]
            stalls[role] = max(gaps) - STEP_S if gaps else None
        print(f"\nchaos: {[(role, how) for role, how, _ in kills]}; steps {STEPS} x ranks {WORLD}: lost {len(lost)}, "
              f"duplicated {len(dup)}, mismatched {len(mismatched)}; longest stall by role (s, a step's "
              f"{STEP_S} s apart): " + ", ".join(f"{k} {v:.1f}" for k, v in stalls.items() if v is not None))
        assert not lost and not dup and not mismatched, (lost[:10], dup[:10], mismatched[:10])
        if "constructor" in roles:  # the kill was real: the kubelet restarted the container in its pod
            (st,) = kget(c, "pod", "demo-constructor-0", "-n", ns)["status"]["containerStatuses"]
            assert st["restartCount"] >= 1, st
    finally:
        c.kubectl("-n", ns, "delete", "datamixture", "demo", "--wait=true", "--timeout=120s", check=False, timeout=150)
        c.kubectl("delete", "pv", f"journal-{ns}"[:63], "--wait=false", check=False)
        cfg.uninstall("mixplane", timeout=120)

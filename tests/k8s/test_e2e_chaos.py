"""Chaos on the real node during a trainer run (issue 21 item 5): two trainer pods train 60 steps while components
are killed, one run per group of kills:
  loader+constructor     a loader pod deleted (`kubectl delete pod`), a constructor's container `docker kill`ed (the
                         kubelet restarts it in the same pod);
  planner                the planner pod deleted (its journal on the PVC; the Deployment's new pod recovers from it);
  loader-primary+shadow  with `runtime.shadow_loaders: 1`, a primary loader's pod deleted (its shadow takes over),
                         then, once the primary's Deployment has a new pod Ready, the shadow's container `docker kill`ed;
  operator+trainer       the operator's pod deleted (its Deployment starts another, which must leave the running
                         components alone), then a trainer pod deleted: its Job starts another, which resumes from the
                         checkpoint (the MixtureLoader's state_dict) the trainer wrote every 4 steps.
The trainers write each step's digest to a host directory (a deleted pod's log is gone), and compare with an embedded
run of the same spec: lost, duplicated and mismatched samples 0 (every (step, rank) once in what the trainers kept --
the steps after a restored checkpoint are trained again, and replace those of the lost pod -- and every digest,
replayed ones included, equal); the longest trainer stall after each kill is reported by role. Setup as in
test_e2e.py (chart, S3 on the bridge, hostPath journal, CPU requests shrunk)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.k8s.cluster import Cluster
from tests.k8s.helpers import wait_for
from tests.k8s.test_e2e import (TRAINER, WORLD, bucket, install_chart, journal_volume, kget, reference,  # noqa: F401
                                small_cpu_requests, spec, trainer_job)

STEPS = 60
STEP_S = 0.5
TRAINER_KILLED = 1  # the rank whose pod is deleted in the trainer kill
COMPONENTS = "mixplane.io/instance=demo,mixplane.io/role in (planner,constructor,loader)"
OPERATOR = "app.kubernetes.io/instance=mixplane,app.kubernetes.io/component=operator"
pytestmark = pytest.mark.timeout(1500)


def _lines(d: Path) -> dict[int, list[dict]]:
    """Each rank's lines, in the order its pods wrote them (steps, and a restarted pod's `resumed`)."""
    out: dict[int, list[dict]] = {}
    for r in range(WORLD):
        f = d / f"digests-rank{r}.jsonl"
        text = f.read_text() if f.exists() else ""
        out[r] = [json.loads(x) for x in text.splitlines() if x.endswith("}")]
    return out


def kept(lines: list[dict]) -> tuple[list[dict], list[dict], list[int], list[dict]]:
    """(the steps the trainer kept, the steps a restored checkpoint dropped, the steps it resumed at, the steps a pod
    received after its successor had started): a restarted pod goes on from its checkpoint, so the lost pod's steps
    from there on are trained again. A rank's pods are taken in the order they started."""
    pods: dict[str, list[dict]] = {}
    for x in lines:
        pods.setdefault(x["pod"], []).append(x)
    starts = [ps[0]["t"] for ps in pods.values()]
    late = [x for (_, ps), nxt in zip(pods.items(), [*starts[1:], None]) for x in ps if nxt is not None and x["t"] > nxt]
    seq: list[dict] = []
    dropped: list[dict] = []
    resumed: list[int] = []
    for x in (x for ps in pods.values() for x in ps):
        if "resumed" in x:
            resumed.append(int(x["resumed"]))
            dropped += [y for y in seq if y["step"] >= x["resumed"]]
            seq = [y for y in seq if y["step"] < x["resumed"]]
        else:
            seq.append(x)
    return seq, dropped, resumed, late


def _pod(c: Cluster, ns: str, selector: str) -> str:
    items = [p for p in kget(c, "pods", "-n", ns, "-l", selector)["items"] if not p["metadata"].get("deletionTimestamp")]
    return items[0]["metadata"]["name"]


def _container(c: Cluster, ns: str, pod: str) -> str:
    """The docker id of the pod's (one) container, not its sandbox."""
    rows = [x.split() for x in c.node.docker("ps", "--format", "{{.ID}} {{.Names}}").stdout.splitlines()]
    (cid,) = [i for i, name in rows if f"_{pod}_{ns}_" in name and not name.startswith("k8s_POD_")]
    return cid


def _loader_pair(c: Cluster, ns: str) -> tuple[dict, dict]:
    """(a primary loader Deployment, its shadow)."""
    deps = kget(c, "deployments", "-n", ns, "-l", "mixplane.io/instance=demo,mixplane.io/role=loader")["items"]
    shadows = [d for d in deps if "mixplane.io/shadow-of" in d["metadata"]["annotations"]]
    primaries = sorted((d for d in deps if d not in shadows), key=lambda d: d["metadata"]["name"])
    assert primaries and len(shadows) == len(primaries), [d["metadata"]["name"] for d in deps]
    p = primaries[0]
    (s,) = [d for d in shadows if d["metadata"]["annotations"]["mixplane.io/shadow-of"] == p["metadata"]["annotations"]["mixplane.io/host"]]
    return p, s


def _pods_of(c: Cluster, ns: str, dep: dict) -> list[dict]:
    sel = ",".join(f"{k}={v}" for k, v in dep["spec"]["selector"]["matchLabels"].items())
    return [p for p in kget(c, "pods", "-n", ns, "-l", sel)["items"] if not p["metadata"].get("deletionTimestamp")]


def _ready(pod: dict) -> bool:
    return any(x["type"] == "Ready" and x["status"] == "True" for x in (pod.get("status") or {}).get("conditions") or [])


def _unix(stamp: str) -> float:
    """An RFC 3339 time of the API server (seconds) or of `kubectl logs --timestamps` (nanoseconds) as unix time."""
    from datetime import datetime, timezone

    head, _, frac = stamp.rstrip("Z").partition(".")
    return datetime.strptime(head, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp() + (float("0." + frac) if frac else 0.0)


def _timeline(c: Cluster, ns: str, role: str, t_kill: float, lines: dict[int, list[dict]]) -> str:
    """Where a killed component's stall went, in seconds after the kill: its new pod's creation, container start and
    Ready (the API server's times, whole seconds), the new container's log lines (WARNING and above, with the kubelet's
    timestamps), the trainers' own log lines after the kill (the client's warnings), and each rank's first step after."""
    ev: list[tuple[float, str]] = []
    pods = [p for p in kget(c, "pods", "-n", ns, "-l", f"mixplane.io/instance=demo,mixplane.io/role={role}")["items"]
            if _unix(p["metadata"]["creationTimestamp"]) >= t_kill - 1]
    for p in pods:
        name = p["metadata"]["name"]
        ev.append((_unix(p["metadata"]["creationTimestamp"]), f"{name} created"))
        for st in (p.get("status") or {}).get("containerStatuses") or []:
            if (st.get("state") or {}).get("running"):
                ev.append((_unix(st["state"]["running"]["startedAt"]), f"{name} container started"))
        for cond in (p.get("status") or {}).get("conditions") or []:
            if cond["type"] == "Ready" and cond["status"] == "True":
                ev.append((_unix(cond["lastTransitionTime"]), f"{name} Ready"))
        for ln in c.kubectl("-n", ns, "logs", name, "--timestamps", check=False).stdout.splitlines()[:12]:
            stamp, _, text = ln.partition(" ")
            ev.append((_unix(stamp), f"{name}: {text[:160]}"))
    for r in range(WORLD):
        trainer = _pod(c, ns, f"job-name=train-{r}")
        for ln in c.kubectl("-n", ns, "logs", trainer, "-c", "train", "--timestamps", check=False).stdout.splitlines():
            stamp, _, text = ln.partition(" ")
            if not text.startswith("{") and _unix(stamp) > t_kill:
                ev.append((_unix(stamp), f"rank {r}: {text[:160]}"))
        after = [x["t"] for x in lines[r] if "step" in x and x["t"] > t_kill]
        if after:
            ev.append((min(after), f"rank {r} first step after the kill"))
    return "; ".join(f"{t - t_kill:+.1f} {what}" for t, what in sorted(ev) if t > t_kill - 2)


RUNS = {"loader+constructor": ("loader", "constructor"), "planner": ("planner",),
        "loader-primary+shadow": ("loader-primary", "loader-shadow"), "operator+trainer": ("operator", "trainer")}


@pytest.mark.parametrize("run", list(RUNS))
def test_kills_during_training_lose_nothing(k8s_node: Cluster, k8s_node_namespace: str, bucket, tmp_path, run):  # noqa: F811
    c, ns = k8s_node, k8s_node_namespace
    roles = RUNS[run]
    endpoint, creds = bucket
    cfg = install_chart(c, ns)
    try:
        c.kubectl("-n", ns, "create", "secret", "generic", "s3-creds", *[f"--from-literal={k}={v}" for k, v in creds.items()])
        journal_volume(c, ns)
        c.kubectl("-n", ns, "create", "configmap", "trainer", f"--from-file=e2e_trainer.py={TRAINER}")
        ckpt = c.workdir / "checkpoints" / ns
        ckpt.mkdir(parents=True)
        os.chown(ckpt, 10001, 10001)
        s = spec(endpoint, "remote")
        if "loader-shadow" in roles:  # every loader with a shadow; the planner fails over after 1 s of silence
            s["runtime"].update({"shadow_loaders": 1, "failover_after_s": 1.0})
        mix = {"apiVersion": "mixplane.io/v1alpha1", "kind": "DataMixture",
               "metadata": {"name": "demo", "namespace": ns, "annotations": {"mixplane.io/tokens-per-second": "30000"}},
               "spec": s}
        c.apply_until_accepted(mix, 30)

        def rolled_out() -> bool:
            work = kget(c, "deployments,statefulsets", "-n", ns, "-l", "mixplane.io/instance=demo")["items"]
            return bool(work) and all((o.get("status") or {}).get("readyReplicas", 0) == o["spec"]["replicas"] for o in work)

        wait_for("the mixture's components Ready", rolled_out, 300, 2.0)
        components = sorted(p["metadata"]["uid"] for p in kget(c, "pods", "-n", ns, "-l", COMPONENTS)["items"])
        image = f"mixplane-trainer:{c.image.split(':')[1]}"
        for rank in range(WORLD):
            c.kubectl("apply", "-f", "-", input=json.dumps(trainer_job(ns, rank, image, STEPS, STEP_S, str(ckpt))))

        def reached(step: int) -> bool:
            lines = _lines(ckpt)
            return all(any(x.get("step", -1) >= step for x in lines[r]) for r in range(WORLD))

        kills: list[tuple[str, str, float]] = []  # (role, how, time)
        at = 6
        pair = _loader_pair(c, ns) if "loader-primary" in roles else None
        for role in roles:
            wait_for(f"the trainers at step {at}", lambda at=at: reached(at), 300, 1.0)
            if role == "constructor":  # the container killed; the kubelet restarts it in the same pod
                cid = _container(c, ns, "demo-constructor-0")
                kills.append((role, f"docker kill {cid[:12]} (demo-constructor-0)", time.time()))
                c.node.docker("kill", cid)
            elif role == "loader-primary":
                assert pair is not None
                (pod,) = _pods_of(c, ns, pair[0])
                kills.append((role, f"kubectl delete pod {pod['metadata']['name']}", time.time()))
                c.kubectl("-n", ns, "delete", "pod", pod["metadata"]["name"], "--wait=false")
            elif role == "loader-shadow":  # once the primary's new pod is Ready, the shadow serving in its place dies
                assert pair is not None
                wait_for("the primary loader's new pod Ready", lambda: [p for p in _pods_of(c, ns, pair[0]) if _ready(p)], 120, 1.0)
                (pod,) = _pods_of(c, ns, pair[1])
                cid = _container(c, ns, pod["metadata"]["name"])
                kills.append((role, f"docker kill {cid[:12]} ({pod['metadata']['name']})", time.time()))
                c.node.docker("kill", cid)
            elif role == "operator":
                pod_name = _pod(c, ns, OPERATOR)
                kills.append((role, f"kubectl delete pod {pod_name}", time.time()))
                c.kubectl("-n", ns, "delete", "pod", pod_name, "--wait=false")
                # its new pod serves the pod webhook again before the trainer kill needs it
                wait_for("the operator's new pod Ready", lambda old=pod_name: [
                    p for p in kget(c, "pods", "-n", ns, "-l", OPERATOR)["items"] if p["metadata"]["name"] != old and _ready(p)], 180, 1.0)
            elif role == "trainer":  # the Job starts another pod, which resumes from the checkpoint
                pod_name = _pod(c, ns, f"job-name=train-{TRAINER_KILLED}")
                kills.append((role, f"kubectl delete pod {pod_name}", time.time()))
                c.kubectl("-n", ns, "delete", "pod", pod_name, "--wait=false")
            else:  # the pod deleted; its Deployment starts another (the planner's journal is on the PVC)
                pod_name = _pod(c, ns, f"mixplane.io/role={role}")
                kills.append((role, f"kubectl delete pod {pod_name}", time.time()))
                c.kubectl("-n", ns, "delete", "pod", pod_name, "--wait=false")
            at += 14

        def done() -> bool:
            jobs = [kget(c, "job", f"train-{r}", "-n", ns) for r in range(WORLD)]
            if any(x["type"] == "Failed" and x["status"] == "True" for j in jobs for x in (j.get("status") or {}).get("conditions") or []):
                logs = "".join(c.kubectl("-n", ns, "logs", "-l", f"job-name=train-{r}", "-c", "train", "--tail=25", check=False).stdout
                               for r in range(WORLD))
                raise AssertionError(f"a trainer Job failed after {[(role, how) for role, how, _ in kills]}\n{logs}")
            return all((j.get("status") or {}).get("succeeded") for j in jobs)

        wait_for("the trainers' end", done, 600, 2.0)
        lines = _lines(ckpt)
        want = reference(endpoint, creds, "remote", tmp_path, STEPS)
        seen: dict[tuple[int, int], list[str]] = {}
        replayed: list[tuple[tuple[int, int], str]] = []
        resumed: dict[int, list[int]] = {}
        late: list[dict] = []
        for r in range(WORLD):
            keep, dropped, resumed[r], gone = kept(lines[r])
            late += gone
            for x in keep:
                seen.setdefault((x["step"], r), []).append(x["digest"])
            replayed += [((x["step"], r), x["digest"]) for x in dropped]
        lost = [k for k in want if k not in seen]
        dup = [k for k, v in seen.items() if len(v) > 1]
        mismatched = [k for k, v in [*seen.items(), *((k, [d]) for k, d in replayed)] if k in want and v[0] != want[k]]
        stalls: dict[str, float] = {}
        times = [t for _, _, t in kills]
        for i, (role, _how, t) in enumerate(kills):
            until = times[i + 1] if i + 1 < len(times) else t + 120
            gaps = []
            for r in range(WORLD):
                ts = [x["t"] for x in lines[r] if "step" in x]
                gaps += [b - a for a, b in zip(ts, ts[1:]) if t < b <= until]  # the gaps that end before the next kill
            stalls[role] = max(gaps) - STEP_S if gaps else 0.0
        print(f"\nchaos: {[(role, how) for role, how, _ in kills]}; steps {STEPS} x ranks {WORLD}: lost {len(lost)}, "
              f"duplicated {len(dup)}, mismatched {len(mismatched)}"
              + (f" (steps trained again after a restored checkpoint: {len(replayed)}, each equal; resumed at "
                 f"{ {r: v for r, v in resumed.items() if v} })" if replayed or any(resumed.values()) else "")
              + f"; longest stall by role (s, beyond a step's {STEP_S} s): " + ", ".join(f"{k} {v:.1f}" for k, v in stalls.items()))
        if "planner" in roles:  # where the planner's stall goes (its pod's restart, Ready, the trainers' reconnects)
            t_kill = next(t for role, _, t in kills if role == "planner")
            print(f"planner kill, seconds after it: {_timeline(c, ns, 'planner', t_kill, lines)}; every pod's log kept in "
                  f"{c.keep_logs(ns, 'a passing planner kill: the logs of where its stall went')}")
        assert not lost and not dup and not mismatched, (lost[:10], dup[:10], mismatched[:10])
        assert not late, f"a deleted trainer pod went on beside the one its Job started again: {late[:5]}"
        # a trainer pod restarted only where one was killed, and that one resumed from a checkpoint
        assert resumed == {r: resumed[r] if "trainer" in roles and r == TRAINER_KILLED else [] for r in range(WORLD)}, resumed
        if "trainer" in roles:
            assert len(resumed[TRAINER_KILLED]) == 1 and resumed[TRAINER_KILLED][0] > 0, resumed
        if "constructor" in roles:  # the kill was real: the kubelet restarted the container in its pod
            (st,) = kget(c, "pod", "demo-constructor-0", "-n", ns)["status"]["containerStatuses"]
            assert st["restartCount"] >= 1, st
        if "loader-shadow" in roles:
            assert pair is not None
            (pod,) = _pods_of(c, ns, pair[1])
            assert pod["status"]["containerStatuses"][0]["restartCount"] >= 1, pod["status"]["containerStatuses"]
            # each kill moved the partitions: to the shadow, then back to the primary's new pod
            log = c.kubectl("-n", ns, "logs", _pod(c, ns, "mixplane.io/role=planner"), check=False).stdout
            promotions = [x.split("WARNING ", 1)[-1] for x in log.splitlines() if "promoting shadow" in x]
            print("planner: " + "; ".join(promotions))
            assert len({x.split("promoting shadow ", 1)[1].split()[0] for x in promotions}) == 2, promotions
        if "operator" in roles:  # the new operator took the running mixture over without restarting any component
            assert sorted(p["metadata"]["uid"] for p in kget(c, "pods", "-n", ns, "-l", COMPONENTS)["items"]) == components
    finally:
        c.kubectl("-n", ns, "delete", "datamixture", "demo", "--wait=true", "--timeout=120s", check=False, timeout=150)
        c.kubectl("delete", "pv", f"journal-{ns}"[:63], "--wait=false", check=False)
        cfg.uninstall("mixplane", timeout=120)

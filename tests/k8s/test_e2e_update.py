"""A live weight change through the Kubernetes API on the real node: `kubectl patch` of a running DataMixture's
weights while two trainer pods train; the operator sends the new mixture to the planner, the status names the step
it takes effect at, and the trainers' per-step digests equal an embedded run given the same mixture at the same
step (`mixplane update --mixture --step`): the old weights before that step, the new ones from it, sample for
sample. Setup as in test_e2e.py."""

from __future__ import annotations

import json

import pytest

from tests.k8s.cluster import Cluster
from tests.k8s.helpers import wait_for
from tests.k8s.test_e2e import (TRAINER, WORLD, bucket, install_chart, journal_volume, kget, reference,  # noqa: F401
                                small_cpu_requests, spec, trainer_job)

STEPS = 56
STEP_S = 0.4
pytestmark = pytest.mark.timeout(1200)


def _lines(c: Cluster, ns: str) -> list[dict]:
    """The trainers' per-step lines, from their pods' logs."""
    out = []
    for rank in range(WORLD):
        for pod in kget(c, "pods", "-n", ns, "-l", f"job-name=train-{rank}")["items"]:
            log = c.kubectl("-n", ns, "logs", pod["metadata"]["name"], "-c", "train", check=False).stdout
            out += [json.loads(x) for x in log.splitlines() if x.startswith("{") and '"digest"' in x]
    return out


def test_kubectl_patch_of_weights_takes_effect_at_the_stated_step(k8s_node: Cluster, k8s_node_namespace: str, bucket,  # noqa: F811
                                                                   tmp_path):
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
        c.apply_until_accepted(mix, 30)
        wait_for("the mixture Ready", lambda: any(x["type"] == "Ready" and x["status"] == "True" for x in
                                                  (kget(c, "datamixture", "demo", "-n", ns).get("status") or {}).get("conditions") or []),
                 300, 2.0)
        image = f"mixplane-trainer:{c.image.split(':')[1]}"
        for rank in range(WORLD):
            c.kubectl("apply", "-f", "-", input=json.dumps(trainer_job(ns, rank, image, STEPS, STEP_S)))
        wait_for("the trainers at step 6", lambda: all(any(x["rank"] == r and x["step"] >= 6 for x in _lines(c, ns))
                                                       for r in range(WORLD)), 300, 1.0)
        new = {"a": 0.2, "b": 0.8}
        c.kubectl("-n", ns, "patch", "datamixture", "demo", "--type", "merge", "-p",
                  json.dumps({"spec": {"mixture": {"weights": new}}}))

        def effective() -> int | None:
            st = kget(c, "datamixture", "demo", "-n", ns).get("status") or {}
            ups = [u for u in st.get("updates") or [] if u.get("weights") == new]
            return ups[-1]["effectiveStep"] if ups else None

        step = wait_for("the status's effective step of the new weights", effective, 120, 1.0)
        assert 6 < step < STEPS, step

        def done() -> bool:
            states = [x["state"].get("terminated") for r in range(WORLD)
                      for p in kget(c, "pods", "-n", ns, "-l", f"job-name=train-{r}")["items"]
                      for x in (p.get("status") or {}).get("containerStatuses") or []]
            if any(t and t["exitCode"] for t in states):
                raise AssertionError(f"a trainer failed: {states}")
            return len(states) == WORLD and all(states)

        wait_for("the trainers' end", done, 600, 2.0)
        got = {(x["step"], x["rank"]): x["digest"] for x in _lines(c, ns)}
        section = {**spec(endpoint, "remote")["mixture"], "weights": new}
        want = reference(endpoint, creds, "remote", tmp_path, STEPS, update=(section, step))
        assert sorted(got) == sorted(want)
        diff = sorted(k for k in got if got[k] != want[k])
        assert not diff, f"digests differ at (step, rank) {diff[:10]} (new weights from step {step})"
        print(f"\nweights {new} patched at trainer step ~6: effective at step {step} (status.updates); "
              f"{len(got)} digests equal to the embedded run updated at the same step")
    finally:
        c.kubectl("-n", ns, "delete", "datamixture", "demo", "--wait=true", "--timeout=120s", check=False, timeout=150)
        c.kubectl("delete", "pv", f"journal-{ns}"[:63], "--wait=false", check=False)
        cfg.uninstall("mixplane", timeout=120)

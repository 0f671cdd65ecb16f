"""A DataMixture status past the API server's object size, against a real kube-apiserver and etcd: the patch as it is
is refused (etcd's request limit, 1.5 MiB by default), the operator's status write (handlers._write_status) leaves
out the informational fields, says so in the StatusTooLarge condition and does not fail."""

from __future__ import annotations

import json

import kubernetes
import pytest

from mixplane.operator.handlers import API_VERSION, _write_status
from mixplane.operator.kube import Kube, KubeError
from mixplane.operator.reconcile import OBJECT_BUDGET_BYTES, SIZE_CONDITION, condition, object_bytes
from tests.k8s.cluster import Cluster
from tests.k8s.helpers import apply, status_of


def _mixture(name: str, ns: str) -> dict:
    return {"apiVersion": API_VERSION, "kind": "DataMixture", "metadata": {"name": name, "namespace": ns},
            "spec": {"sources": [{"name": "web", "uri": "/data/web", "kind": "tokens", "columns": ["tokens"]}],
                     "mixture": {"weights": {"web": 1.0}}, "batch": {"sequences": 8, "seq_len": 256},
                     "topology": {"modules": {"backbone": {"dp": 2}}}}}


def _status(slots: int) -> dict:
    """A status whose sidecar records (one per trainer pod slot) take it past 1.5 MiB."""
    return {"phase": "Running", "observedGeneration": 1, "step": 7,
            "conditions": [condition("Ready", True, "ComponentsReady", "ready", 1)],
            "sidecars": [{"slot": k, "pods": [f"loader-web-{k}-{j}" for j in range(4)],
                          "partitions": ",".join(f"web:{4 * k + j}" for j in range(4)), "cpu": 1.0} for k in range(slots)]}


@pytest.mark.timeout(60)
def test_a_status_past_the_object_size_is_a_condition_not_a_failed_write(crd: Cluster, k8s_namespace: str):
    ns, name = k8s_namespace, "big"
    apply(crd, _mixture(name, ns))
    k = Kube(kubernetes.config.new_client_from_config(str(crd.kubeconfig)))
    body = k.get(API_VERSION, "DataMixture", ns, name)
    new = _status(10_500)
    assert 1_600_000 < len(json.dumps(new, separators=(",", ":"))) < 2_000_000  # over etcd's limit, under gRPC's 2 MiB
    # as it is, the API server refuses it (etcd: request is too large): the reconcile would fail on every pass
    with pytest.raises(KubeError) as e:
        k.patch_status(API_VERSION, "DataMixture", ns, name, new)
    assert "request is too large" in str(e.value), str(e.value)
    assert not (status_of(crd, ns, name) or {}).get("sidecars")
    # the operator's write: sidecars left out, the rest written, the condition says what and why
    after = _write_status(k, body, {}, new)
    got = status_of(crd, ns, name)
    assert got["phase"] == "Running" and got["step"] == 7 and "sidecars" not in got and "sidecars" not in after
    cond = next(c for c in got["conditions"] if c["type"] == SIZE_CONDITION)
    assert cond["status"] == "True" and cond["reason"] == "Trimmed" and "left out: sidecars" in cond["message"], cond
    assert any(c["type"] == "Ready" for c in got["conditions"])
    stored = k.get(API_VERSION, "DataMixture", ns, name)
    assert object_bytes(stored, stored["status"]) <= OBJECT_BUDGET_BYTES
    # a status that fits again is written whole and the condition turns False
    small = {**_status(3), "step": 8}
    _write_status(k, stored, dict(stored["status"]), small)
    got = status_of(crd, ns, name)
    assert got["step"] == 8 and len(got["sidecars"]) == 3
    cond = next(c for c in got["conditions"] if c["type"] == SIZE_CONDITION)
    assert cond["status"] == "False" and cond["reason"] == "WithinLimit"

"""Fixtures of the k8s tier: one real control plane per test session (see tests/k8s/cluster.py)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest

from mixplane.operator.crd import CRD_NAME
from tests.k8s.cluster import Cluster
from tests.k8s.helpers import CRD

_ns_counter = itertools.count()


@pytest.fixture(scope="session")
def k8s_cluster(tmp_path_factory) -> Iterator[Cluster]:
    """etcd + kube-apiserver + kube-controller-manager on 127.0.0.1 (binaries built by scripts/k8s/build.sh if missing)."""
    c = Cluster.start(tmp_path_factory.mktemp("k8s"))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def k8s_node(tmp_path_factory) -> Iterator[Cluster]:
    """A cluster with a real node (tests/k8s/node.py): dockerd, kubelet, scheduler, kube-proxy, cluster DNS, the
    images built by scripts/k8s/images.sh; a cluster of its own, so the control-plane-only tests keep theirs."""
    c = Cluster.start(tmp_path_factory.mktemp("k8snode"), node=True, timeout=180.0)
    try:
        yield c
    finally:
        c.stop()
        assert not c.restore_problems, c.restore_problems


@pytest.fixture()
def k8s_namespace(k8s_cluster: Cluster, request) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards (without waiting for its finalizers)."""
    base = "".join(ch if ch.isalnum() else "-" for ch in request.node.name.lower())[:40].strip("-")
    name = f"t{next(_ns_counter)}-{base}".rstrip("-")
    k8s_cluster.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        k8s_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture()
def k8s_node_namespace(k8s_node: Cluster, request) -> Iterator[str]:
    """A fresh namespace on the node's cluster (its default ServiceAccount there), deleted afterwards."""
    base = "".join(ch if ch.isalnum() else "-" for ch in request.node.name.lower())[:40].strip("-")
    name = f"n{next(_ns_counter)}-{base}".rstrip("-")
    k8s_node.kubectl("create", "namespace", name)
    deadline = time.monotonic() + 60
    while k8s_node.kubectl("get", "sa", "default", "-n", name, check=False).returncode and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        yield name
    finally:
        k8s_node.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="session")
def crd(k8s_cluster: Cluster) -> Cluster:
    """The cluster with the DataMixture CRD from crds/ installed and established."""
    k8s_cluster.kubectl("apply", "-f", str(CRD))
    # polled rather than `kubectl wait --for=condition=Established`: kubectl 1.20's wait fails at once with
    # ".status.conditions accessor error" when it reads the CRD before the API server wrote any condition
    deadline = time.monotonic() + 60
    path = '{.status.conditions[?(@.type=="Established")].status}'
    while True:
        r = k8s_cluster.kubectl("get", f"crd/{CRD_NAME}", "-o", f"jsonpath={path}", check=False)
        if r.returncode == 0 and r.stdout.strip() == "True":
            return k8s_cluster
        if time.monotonic() > deadline:
            raise RuntimeError(f"crd/{CRD_NAME} not Established within 60 s: {r.stdout.strip()!r} {r.stderr.strip()!r}")
        time.sleep(0.2)

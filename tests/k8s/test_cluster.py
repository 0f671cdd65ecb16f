"""The test control plane itself: token auth, RBAC, service-account tokens, controllers, garbage collection."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request

import pytest

from tests.k8s.cluster import ADVERTISE_ADDRESS, Cluster
from tests.k8s.helpers import wait_for


def test_token_auth_and_rbac(k8s_cluster: Cluster, k8s_namespace: str):
    ctx = ssl.create_default_context(cafile=str(k8s_cluster.ca_file))
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(k8s_cluster.server + "/api/v1/namespaces", context=ctx, timeout=10)
    assert e.value.code in (401, 403)
    # a service account gets a token from the controller manager, and RBAC gives it nothing by default
    k8s_cluster.kubectl("-n", k8s_namespace, "create", "serviceaccount", "nobody")
    secret: dict = {}

    def token_ready() -> bool:
        sa = json.loads(k8s_cluster.kubectl("-n", k8s_namespace, "get", "sa", "nobody", "-o", "json").stdout)
        if not sa.get("secrets"):
            return False
        secret.update(json.loads(k8s_cluster.kubectl("-n", k8s_namespace, "get", "secret", sa["secrets"][0]["name"], "-o", "json").stdout))
        return bool(secret.get("data", {}).get("token"))

    wait_for("service-account token", token_ready, 60, 0.3)
    import base64

    token = base64.b64decode(secret["data"]["token"]).decode()
    req = urllib.request.Request(f"{k8s_cluster.server}/api/v1/namespaces/{k8s_namespace}/secrets",
                                 headers={"Authorization": f"Bearer {token}"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, context=ctx, timeout=10)
    assert e.value.code == 403
    r = k8s_cluster.kubectl("auth", "can-i", "list", "secrets", "-n", k8s_namespace,
                            f"--as=system:serviceaccount:{k8s_namespace}:nobody", check=False)
    assert r.stdout.strip() == "no"


def test_advertised_outside_loopback(k8s_cluster: Cluster):
    ep = k8s_cluster.api("/api/v1/namespaces/default/endpoints/kubernetes")
    assert ep["subsets"][0]["addresses"][0]["ip"] == ADVERTISE_ADDRESS


def test_controllers_create_and_garbage_collect(k8s_cluster: Cluster, k8s_namespace: str):
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
           "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
                    "template": {"metadata": {"labels": {"app": "web"}},
                                 "spec": {"containers": [{"name": "c", "image": "busybox:1.36"}]}}}}
    k8s_cluster.kubectl("-n", k8s_namespace, "apply", "-f", "-", input=json.dumps(dep))

    def pods() -> list[dict]:
        return json.loads(k8s_cluster.kubectl("-n", k8s_namespace, "get", "pods", "-l", "app=web", "-o", "json").stdout)["items"]

    wait_for("deployment -> replicaset -> 2 pods", lambda: len(pods()) == 2, 60, 0.3)
    assert all(p["status"]["phase"] == "Pending" for p in pods()), "no kubelet: pods stay Pending"
    k8s_cluster.kubectl("-n", k8s_namespace, "delete", "deployment", "web", "--wait=false")
    wait_for("garbage collection of the replicaset pods", lambda: not pods(), 60, 0.3)
    rs = json.loads(k8s_cluster.kubectl("-n", k8s_namespace, "get", "rs", "-o", "json").stdout)["items"]
    assert rs == []

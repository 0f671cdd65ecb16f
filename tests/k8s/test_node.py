"""The real node of the k8s tier (the `k8s_node` fixture, tests/k8s/node.py): Ready, runs pods of images built
here, serves ClusterIPs and cluster DNS names to pods, and holds the network discipline -- pods reach only the
cluster's own ranges, nothing the cluster runs ever went to the link-local range (the metadata service) or to
any address outside loopback / bridge / service range (conntrack's log of new connections, and the REJECT
rules' counters)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.k8s import node as nodemod
from tests.k8s.cluster import Cluster
from tests.k8s.pods import pod_manifest, run_pod

pytestmark = pytest.mark.timeout(900)

PROBE = r"""
import json, socket
out = {"uid": __import__("os").getuid()}
for name in ("kubernetes.default.svc", "kubernetes.default.svc.cluster.local", "kubernetes.default", "example.com"):
    try:
        out[name] = socket.gethostbyname(name)
    except OSError as e:
        out[name] = "error: " + type(e).__name__
s = socket.create_connection(("kubernetes.default.svc", 443), timeout=5)
out["clusterip"] = s.getpeername()[0]
s.close()
# a pod's way out: the metadata service, this host's gateway, a documentation address (none may be reached)
# and a ClusterIP no Service has (what a Service is until kube-proxy programmed it): refused, never routed out
for name, addr in (("metadata", ("169.254.169.254", 80)), ("gateway", (GATEWAY, 80)), ("outside", ("203.0.113.1", 443)),
                   ("unprogrammed-clusterip", (UNUSED_CLUSTER_IP, 7000))):
    try:
        socket.create_connection(addr, timeout=5).close()
        out[name] = "connected"
    except OSError as e:
        out[name] = type(e).__name__
print(json.dumps(out))
"""


UNUSED_CLUSTER_IP = "10.111.255.254"  # in the service range (allocation is random over 2^20 addresses: a test's few miss it)


def _gateway() -> str:
    r = subprocess.run(["ip", "-4", "route", "show", "default"], capture_output=True, text=True)
    parts = r.stdout.split()
    return parts[parts.index("via") + 1] if "via" in parts else "192.0.2.1"


def test_node_is_ready_with_the_images_built_here(k8s_node: Cluster):
    (node,) = json.loads(k8s_node.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    assert node["metadata"]["name"] == nodemod.NODE_NAME
    assert {a["type"]: a["address"] for a in node["status"]["addresses"]}["InternalIP"] == nodemod.BRIDGE_IP
    assert node["status"]["nodeInfo"]["kubeletVersion"] == "v1.20.2"
    images = {n for i in node["status"].get("images") or [] for n in i["names"]}
    assert {nodemod.PAUSE_IMAGE, k8s_node.image} <= images, images


def test_network_discipline(k8s_node: Cluster, k8s_node_namespace: str):
    """A pod resolves cluster names (and only those), reaches a ClusterIP; its tries to leave the cluster are
    refused at once by the REJECT rules; conntrack logged no connection of the cluster to any other address,
    and no process of the cluster (kubelet's AWS credential provider included) tried the link-local range."""
    before = nodemod.reject_counts()
    assert before["link-local"] == 0, f"something in the cluster tried 169.254.0.0/16: {before}"
    code, log, _ = run_pod(k8s_node, k8s_node_namespace, pod_manifest(
        "probe", k8s_node.image, ["python", "-c", PROBE.replace("GATEWAY", repr(_gateway()))
                                  .replace("UNUSED_CLUSTER_IP", repr(UNUSED_CLUSTER_IP))]))
    assert code == 0, log
    out = json.loads(log.strip().splitlines()[-1])
    assert out["uid"] == 10001
    assert out["kubernetes.default.svc"] == out["kubernetes.default.svc.cluster.local"] == out["kubernetes.default"] == "10.96.0.1"
    assert out["example.com"].startswith("error"), "the cluster DNS forwards nothing"
    assert out["clusterip"] == "10.96.0.1"
    assert out["metadata"] == out["gateway"] == out["outside"] == "ConnectionRefusedError", out
    # an untranslated ClusterIP: refused at once (it used to take the default route out and hang in SYN retries)
    assert out["unprogrammed-clusterip"] == "ConnectionRefusedError", out
    after = nodemod.reject_counts()
    assert after["link-local"] == 1, after  # the probe's one SYN, nothing else
    assert after["other"] >= before["other"] + 2, after
    assert after["service-untranslated"] >= before["service-untranslated"] + 1, after

    events = nodemod.conntrack_events(k8s_node.workdir / "logs" / "conntrack.log")
    assert any(e["src"].startswith("172.17.") and e["dst"] == "10.96.0.1" for e in events), "conntrack saw the pods"
    assert any(e["dst"] == nodemod.BRIDGE_IP for e in events), "conntrack saw kubelet -> API server"
    stray = [e["line"] for e in events if nodemod.outside(e["dst"]) or nodemod.untranslated(e)]
    assert not stray, "connections of the cluster outside its ranges:\n" + "\n".join(stray[:20])
    print(f"conntrack: {len(events)} new connections of the cluster, 0 outside loopback/{nodemod.POD_CIDR}/"
          f"{nodemod.SERVICE_CIDR}; rejected attempts: {after}")

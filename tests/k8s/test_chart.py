"""The Helm chart with the real Helm engine (helm-python-sdk binds Helm v4's Go SDK): lint, render, install.

Install goes into the test API server; the webhook configurations only select namespaces labelled for this
test, so the operator-less install cannot block other tests' pods and mixtures.
"""

from __future__ import annotations

import base64
import json
import subprocess
import time
from pathlib import Path

import helm_python as helm
import pytest
import yaml

from mixplane.operator.crd import CRD_NAME, crd_yaml
from mixplane.operator.dashboard import dashboard_json
from tests.k8s.cluster import Cluster

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "mixplane"
KUBE = "v1.20.2"
VARIANTS = {"namespaced": {}, "cluster-wide": {"rbac": {"clusterWide": True}, "metrics": {"serviceMonitor": {"enabled": True}}}}


def render(values: dict, namespace: str = "mixplane-system") -> list[dict]:
    out = helm.Chart.load(str(CHART)).render(values, name="mixplane", namespace=namespace, is_install=True)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith(".yaml"):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_lint_strict_clean(variant):
    report = helm.lint(str(CHART), VARIANTS[variant], strict=True, namespace="mixplane-system", kube_version=KUBE)
    assert report["errors"] == [] and report["messages"] == [], report


def test_lint_reports_a_broken_chart(tmp_path):
    broken = tmp_path / "mixplane"
    subprocess.run(["cp", "-r", str(CHART), str(broken)], check=True)
    (broken / "templates" / "deployment.yaml").write_text("apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: {{ .Values.nope.x }}\n")
    report = helm.lint(str(broken), strict=True, kube_version=KUBE)
    assert report["errors"], "the lint really runs templates"


def test_values_schema_refuses_typos_and_bad_values():
    report = helm.lint(str(CHART), {"webhok": {"port": 9443}, "operator": {"replicas": 2, "logLevel": "LOUD"}},
                       strict=True, kube_version=KUBE)
    text = " ".join(report["errors"])
    assert "additional properties 'webhok' not allowed" in text
    assert "/operator/replicas" in text and "/operator/logLevel" in text


def test_operator_network_policy_admits_only_the_webhook_port():
    (np_,) = by_kind(render({}), "NetworkPolicy")
    assert np_["spec"]["policyTypes"] == ["Ingress"]
    assert np_["spec"]["ingress"] == [{"ports": [{"port": 9443, "protocol": "TCP"}]}]
    (dep,) = by_kind(render({}), "Deployment")
    assert np_["spec"]["podSelector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_crd_and_dashboard_ship_in_the_chart():
    assert (CHART / "crds" / f"{CRD_NAME}.yaml").read_text() == crd_yaml()
    cm = by_kind(render({}), "ConfigMap")
    (dash,) = [c for c in cm if c["metadata"]["name"].endswith("-dashboard")]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dash["data"]["mixplane.json"]) == json.loads(dashboard_json())


def test_operator_pod_meets_restricted_pod_security():
    (dep,) = by_kind(render({}), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["securityContext"]["runAsUser"] != 0
    for c in pod["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
        assert c["resources"]["requests"] and c["resources"]["limits"]
        assert not any(p.get("hostPort") for p in c.get("ports", []))
    assert not any(k in pod for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert all("hostPath" not in v for v in pod["volumes"])


def test_rbac_is_least_privilege_and_namespaced_by_default():
    ns = render({})
    roles = by_kind(ns, "Role")
    cluster_roles = by_kind(ns, "ClusterRole")
    assert len(roles) == 1 and roles[0]["metadata"]["namespace"] == "mixplane-system"
    # the only cluster-scoped rights of a namespaced install: reading CRDs and namespaces (kopf needs both)
    assert [r["resources"] for cr in cluster_roles for r in cr["rules"]] == [["customresourcedefinitions"], ["namespaces"]]
    assert all(set(r["verbs"]) <= {"get", "list", "watch"} for cr in cluster_roles for r in cr["rules"])
    wide = render(VARIANTS["cluster-wide"])
    assert not by_kind(wide, "Role") and len(by_kind(wide, "ClusterRole")) == 2
    (dep,) = by_kind(wide, "Deployment")
    assert not any(a.startswith("--namespace") for a in dep["spec"]["template"]["spec"]["containers"][0]["args"])
    for docs in (ns, wide):
        for role in by_kind(docs, "Role") + by_kind(docs, "ClusterRole"):
            for rule in role["rules"]:
                assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule.get("apiGroups", [])
                if "pods" in rule["resources"]:
                    assert set(rule["verbs"]) <= {"get", "list", "watch"}, "the operator never creates pods directly"
    assert by_kind(wide, "ServiceMonitor") and not by_kind(ns, "ServiceMonitor")


def test_webhook_certificate_is_signed_for_the_service(tmp_path):
    docs = render({})
    (secret,) = [d for d in by_kind(docs, "Secret") if d["type"] == "kubernetes.io/tls"]
    (svc,) = [d for d in by_kind(docs, "Service") if d["metadata"]["name"].endswith("-webhook")]
    (vwc,) = by_kind(docs, "ValidatingWebhookConfiguration")
    (mwc,) = by_kind(docs, "MutatingWebhookConfiguration")
    for name in ("tls.crt", "ca.crt"):
        (tmp_path / name).write_bytes(base64.b64decode(secret["data"][name]))
    assert base64.b64decode(vwc["webhooks"][0]["clientConfig"]["caBundle"]) == (tmp_path / "ca.crt").read_bytes()
    assert mwc["webhooks"][0]["clientConfig"]["caBundle"] == vwc["webhooks"][0]["clientConfig"]["caBundle"]
    host = f"{svc['metadata']['name']}.mixplane-system.svc"
    r = subprocess.run(["openssl", "verify", "-CAfile", str(tmp_path / "ca.crt"), "-verify_hostname", host,
                        str(tmp_path / "tls.crt")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert mwc["webhooks"][0]["objectSelector"]["matchExpressions"][0]["key"] == "mixplane.io/mixture"


@pytest.fixture()
def isolated_values(k8s_namespace: str, k8s_cluster: Cluster) -> dict:
    """Webhooks select only this test's namespace (no operator pod answers them here)."""
    k8s_cluster.kubectl("label", "namespace", k8s_namespace, "mixplane-chart-test=yes")
    return {"webhook": {"namespaceSelector": {"matchLabels": {"mixplane-chart-test": "yes"}}}}


def test_every_rendered_manifest_passes_server_side_dry_run(k8s_cluster: Cluster, k8s_namespace: str, isolated_values: dict):
    k8s_cluster.kubectl("apply", "-f", str(CHART / "crds" / f"{CRD_NAME}.yaml"))
    for variant, values in VARIANTS.items():
        docs = [d for d in render({**values, **isolated_values}, namespace=k8s_namespace) if d["kind"] != "ServiceMonitor"]
        r = k8s_cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump_all(docs), check=False)
        assert r.returncode == 0, f"{variant}: {r.stderr}"
        assert r.stdout.count("(server dry run)") == len(docs), r.stdout


def test_helm_install_into_the_api_server(k8s_cluster: Cluster, k8s_namespace: str, isolated_values: dict):
    cfg = helm.Config(kubeconfig_path=str(k8s_cluster.kubeconfig), namespace=k8s_namespace)
    try:
        rel = cfg.install(str(CHART), "mixplane", isolated_values, namespace=k8s_namespace, timeout=120)
        assert rel["status"] == "deployed" and rel["revision"] == 1, {k: v for k, v in rel.items() if k != "manifest"}
        dep = json.loads(k8s_cluster.kubectl("-n", k8s_namespace, "get", "deployment", "mixplane", "-o", "json").stdout)
        assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "mixplane"
        assert k8s_cluster.kubectl("-n", k8s_namespace, "get", "role", "mixplane").returncode == 0
        assert k8s_cluster.kubectl("get", "crd", CRD_NAME).returncode == 0
        r = k8s_cluster.kubectl("auth", "can-i", "create", "deployments", "-n", k8s_namespace,
                                f"--as=system:serviceaccount:{k8s_namespace}:mixplane", check=False)
        assert r.stdout.strip() == "yes"
        r = k8s_cluster.kubectl("auth", "can-i", "create", "deployments", "-n", "default",
                                f"--as=system:serviceaccount:{k8s_namespace}:mixplane", check=False)
        assert r.stdout.strip() == "no", "namespaced by default"
        assert [x["name"] for x in cfg.list()] == ["mixplane"]
    finally:
        cfg.uninstall("mixplane", timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and k8s_cluster.kubectl(
                "get", "validatingwebhookconfiguration", f"mixplane-{k8s_namespace}", check=False).returncode == 0:
            time.sleep(0.5)

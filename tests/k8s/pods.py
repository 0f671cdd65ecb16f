"""Pods on the real node (the `k8s_node` fixture): run one to its end, read its log, wait for phases."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from tests.k8s.cluster import Cluster

RESTRICTED = {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "allowPrivilegeEscalation": False,
              "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def pod_manifest(name: str, image: str, command: list[str], *, env: Mapping[str, str] | None = None,
                 security: Mapping[str, Any] | None = None, volumes: list[dict[str, Any]] | None = None,
                 mounts: list[dict[str, Any]] | None = None, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A one-container pod that runs `command` once (restartPolicy Never), /tmp an emptyDir."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": dict(labels or {})},
            "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False, "enableServiceLinks": False,
                     "terminationGracePeriodSeconds": 5,
                     "containers": [{"name": "main", "image": image, "imagePullPolicy": "Never", "command": command,
                                     "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
                                     "securityContext": dict(security if security is not None else RESTRICTED),
                                     "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *(mounts or [])]}],
                     "volumes": [{"name": "tmp", "emptyDir": {}}, *(volumes or [])]}}


def pod(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    return json.loads(cluster.kubectl("get", "pod", name, "-n", ns, "-o", "json").stdout)


def wait_phase(cluster: Cluster, ns: str, name: str, phases: tuple[str, ...], timeout: float = 180.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    obj: dict[str, Any] = {}
    while time.monotonic() < deadline:
        obj = pod(cluster, ns, name)
        if obj.get("status", {}).get("phase") in phases:
            return obj
        time.sleep(0.5)
    events = cluster.kubectl("get", "events", "-n", ns, "--field-selector", f"involvedObject.name={name}", check=False).stdout
    raise AssertionError(f"pod {ns}/{name} not {phases} within {timeout:.0f}s: {json.dumps(obj.get('status'))[:2000]}\n{events}")


def run_pod(cluster: Cluster, ns: str, manifest: Mapping[str, Any], timeout: float = 180.0) -> tuple[int, str, dict[str, Any]]:
    """Create the pod, wait for its end; (exit code, log, pod)."""
    name = manifest["metadata"]["name"]
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(manifest))
    obj = wait_phase(cluster, ns, name, ("Succeeded", "Failed"), timeout)
    log = cluster.kubectl("logs", "-n", ns, name, check=False).stdout
    (st,) = obj["status"]["containerStatuses"]
    return int(st["state"]["terminated"]["exitCode"]), log, obj

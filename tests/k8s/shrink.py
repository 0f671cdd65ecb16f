"""A test-only mutating webhook that scales pods' CPU requests down, so that what a mixture sizes for real nodes fits
the test node's 2 cores (the operator asks 1 core each for the planner and every constructor). Memory requests,
limits and everything else are left alone; only pods in namespaces labelled `mixplane-shrink-cpu=yes` are touched.
It listens on the docker bridge (the API server reaches it there) with a certificate from the cluster's CA, as a
process of its own (helm-python-sdk's calls hold the interpreter lock for as long as an install runs: a server
thread of the test process could not answer the API server meanwhile).

    python -m tests.k8s.shrink CERT KEY HOST PORT FACTOR
"""

from __future__ import annotations

import base64
import json
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.k8s import node as nodemod
from tests.k8s.cluster import REPO, Cluster, free_port

LABEL = "mixplane-shrink-cpu"


def _millicores(q: str) -> float:
    return float(q[:-1]) if q.endswith("m") else float(q) * 1000


def patch_for(pod: dict, factor: float) -> list[dict]:
    """JSONPatch ops: every container's (and init container's) CPU request times `factor`, at least 10m."""
    ops = []
    for kind in ("initContainers", "containers"):
        for i, c in enumerate(pod["spec"].get(kind) or []):
            cpu = ((c.get("resources") or {}).get("requests") or {}).get("cpu")
            if cpu is not None:
                ops.append({"op": "replace", "path": f"/spec/{kind}/{i}/resources/requests/cpu",
                            "value": f"{max(10, int(_millicores(str(cpu)) * factor))}m"})
    return ops


def serve(crt: str, key: str, host: str, port: int, factor: float) -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            req = review["request"]
            ops = patch_for(req["object"], factor)
            resp = {"uid": req["uid"], "allowed": True}
            if ops:
                resp.update(patchType="JSONPatch", patch=base64.b64encode(json.dumps(ops).encode()).decode())
            body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": resp}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(crt, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    server.serve_forever()


@contextmanager
def shrink_cpu(cluster: Cluster, factor: float = 0.1) -> Iterator[None]:
    port = free_port()
    crt, key = cluster.issue_cert("shrink-webhook", [f"IP:{nodemod.BRIDGE_IP}"])
    proc = subprocess.Popen([sys.executable, "-m", "tests.k8s.shrink", str(crt), str(key), nodemod.BRIDGE_IP, str(port),
                             str(factor)], env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection((nodemod.BRIDGE_IP, port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.1)
    name = f"shrink-cpu-{port}"
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration", "metadata": {"name": name},
        "webhooks": [{"name": "shrink-cpu.test.mixplane.io", "admissionReviewVersions": ["v1"], "sideEffects": "None",
                      "failurePolicy": "Fail", "timeoutSeconds": 5, "reinvocationPolicy": "IfNeeded",
                      "clientConfig": {"url": f"https://{nodemod.BRIDGE_IP}:{port}/",
                                       "caBundle": base64.b64encode(cluster.ca_file.read_bytes()).decode()},
                      "namespaceSelector": {"matchLabels": {LABEL: "yes"}},
                      "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}]}]}))
    try:
        yield
    finally:
        cluster.kubectl("delete", "mutatingwebhookconfiguration", name, check=False)
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))

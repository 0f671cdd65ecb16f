"""The operator's Kubernetes API access, through the official client's DynamicClient.

A thin shell: server-side apply (idempotent, owned fields only), get / list / delete, and the status
subresource. Every call that changes something passes `mutating()`, where a fault-injection point can stop
the process between two API calls (MIXPLANE_OPERATOR_KILL_AFTER_CALLS=N: SIGKILL itself before its N-th
mutating call; MIXPLANE_OPERATOR_KILL_AT=LABEL: at a named cut point; the operator-chaos tests use them to cut a
reconcile at every point in turn). Both are unset in production.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
from collections.abc import Mapping
from typing import Any

from mixplane import settings
from mixplane.errors import MixplaneError

FIELD_MANAGER = "mixplane-operator"
KILL_AFTER_ENV = "MIXPLANE_OPERATOR_KILL_AFTER_CALLS"
KILL_AT_ENV = "MIXPLANE_OPERATOR_KILL_AT"


class KubeError(MixplaneError, RuntimeError):
    """An API call failed; `status` is the HTTP status (0 when the server was not reached)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class FaultPoint:
    """Counts mutating calls; with a limit, the process SIGKILLs itself at the call that reaches it. With `at`
    (MIXPLANE_OPERATOR_KILL_AT), it SIGKILLs itself at the first cut point whose label starts with it (e.g. `update`:
    before sending the live update, `after-update`: right after the planner acknowledged it)."""

    def __init__(self, limit: int | None, at: str | None = None):
        self.limit = limit
        self.at = at or None
        self.calls = 0
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> "FaultPoint":
        at = settings.get(KILL_AT_ENV)
        return cls(settings.get(KILL_AFTER_ENV), (at.strip() or None) if at else None)

    def hit(self, what: str, *, mutating: bool = True) -> None:
        with self._lock:
            self.calls += mutating
            if (self.limit is not None and mutating and self.calls >= self.limit) or (self.at and what.startswith(self.at)):
                # the chaos tests read this line to know where the cut fell
                print(f"mixplane operator fault point: SIGKILL before mutating call {self.calls} ({what})", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)


class Kube:
    """The calls the operator makes. `api_client` defaults to in-cluster config, else $KUBECONFIG."""

    def __init__(self, api_client: Any = None):
        import kubernetes
        from kubernetes.dynamic import DynamicClient

        if api_client is None:
            try:
                kubernetes.config.load_incluster_config()
            except kubernetes.config.ConfigException:
                kubernetes.config.load_kube_config()
            api_client = kubernetes.client.ApiClient()
        self.api = api_client
        # the discovery cache goes to a private file (the operator's root filesystem is read-only; /tmp is a volume)
        cache = os.path.join(tempfile.gettempdir(), f"mixplane-operator-{os.getuid()}-discovery.json")
        self.dyn = DynamicClient(api_client, cache_file=cache)
        self.fault = FaultPoint.from_env()
        self._resources: dict[tuple[str, str], Any] = {}

    def _res(self, api_version: str, kind: str) -> Any:
        key = (api_version, kind)
        if key not in self._resources:
            self._resources[key] = self.dyn.resources.get(api_version=api_version, kind=kind)
        return self._resources[key]

    @staticmethod
    def _wrap(e: Exception, what: str) -> KubeError:
        status = int(getattr(e, "status", 0) or 0)
        body = getattr(e, "body", None) or getattr(e, "summary", lambda: "")()
        return KubeError(status, f"{what}: {status} {str(body)[:400]}")

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply: create or converge the fields this operator owns."""
        from kubernetes.dynamic.exceptions import DynamicApiError

        md = obj["metadata"]
        what = f"apply {obj['kind']} {md['namespace']}/{md['name']}"
        self.fault.hit(what)
        try:
            out = self._res(obj["apiVersion"], obj["kind"]).server_side_apply(
                body=dict(obj), name=md["name"], namespace=md["namespace"], field_manager=FIELD_MANAGER,
                force_conflicts=True)
        except DynamicApiError as e:
            raise self._wrap(e, what) from None
        return dict(out.to_dict())

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        from kubernetes.dynamic.exceptions import DynamicApiError, NotFoundError

        try:
            return dict(self._res(api_version, kind).get(name=name, namespace=namespace).to_dict())
        except NotFoundError:
            return None
        except DynamicApiError as e:
            raise self._wrap(e, f"get {kind} {namespace}/{name}") from None

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        from kubernetes.dynamic.exceptions import DynamicApiError

        try:
            out = self._res(api_version, kind).get(namespace=namespace, label_selector=selector).to_dict()
        except DynamicApiError as e:
            raise self._wrap(e, f"list {kind} {namespace} {selector}") from None
        return list(out.get("items") or [])

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        from kubernetes.dynamic.exceptions import DynamicApiError, NotFoundError

        what = f"delete {kind} {namespace}/{name}"
        self.fault.hit(what)
        try:
            self._res(api_version, kind).delete(name=name, namespace=namespace, body={"propagationPolicy": "Background"})
        except NotFoundError:
            pass
        except DynamicApiError as e:
            raise self._wrap(e, what) from None

    def patch(self, api_version: str, kind: str, namespace: str, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """A JSON merge patch of an object (None values remove fields): what server-side apply cannot take away,
        e.g. keys of a Secret rendered as stringData."""
        from kubernetes.dynamic.exceptions import DynamicApiError

        what = f"patch {kind} {namespace}/{name}"
        self.fault.hit(what)
        try:
            out = self._res(api_version, kind).patch(body=dict(body), name=name, namespace=namespace,
                                                     content_type="application/merge-patch+json")
        except DynamicApiError as e:
            raise self._wrap(e, what) from None
        return dict(out.to_dict())

    def patch_status(self, api_version: str, kind: str, namespace: str, name: str, status: Mapping[str, Any]) -> dict[str, Any]:
        """A JSON merge patch of the status subresource (None values remove fields)."""
        from kubernetes.dynamic.exceptions import DynamicApiError

        what = f"status of {kind} {namespace}/{name}"
        self.fault.hit(what)
        try:
            out = self._res(api_version, kind).status.patch(body={"status": dict(status)}, name=name, namespace=namespace,
                                                             content_type="application/merge-patch+json")
        except DynamicApiError as e:
            raise self._wrap(e, what) from None
        return dict(out.to_dict())

    def discover(self, path: str) -> dict[str, Any] | None:
        """A discovery document (`/apis/<group>`), or None when the server does not serve it."""
        from kubernetes.dynamic.exceptions import DynamicApiError

        try:
            out = self.dyn.request("GET", path)
        except DynamicApiError as e:
            if getattr(e, "status", 0) in (403, 404):
                return None
            raise self._wrap(e, f"GET {path}") from None
        return dict(out.to_dict()) if hasattr(out, "to_dict") else dict(out)


_KUBE: Kube | None = None
_KUBE_LOCK = threading.Lock()


def kube() -> Kube:
    """The process's API access (created on first use)."""
    global _KUBE
    with _KUBE_LOCK:
        if _KUBE is None:
            _KUBE = Kube()
        return _KUBE

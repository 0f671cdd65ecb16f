"""`mixplane operator`: run the DataMixture operator (kopf) against the cluster in $KUBECONFIG or in-cluster."""

from __future__ import annotations

import asyncio
import logging
import threading

from mixplane import settings
from typing import Any


def run_operator(namespace: str | None = None, *, stop_flag: threading.Event | None = None,
                 ready_flag: threading.Event | None = None, liveness: str | None = None) -> int:
    """Block until stopped; one namespace, or every namespace when none is given."""
    import kopf

    import mixplane.operator.handlers  # noqa: F401 - registers the handlers

    from mixplane.operator.admission import start_from_env
    from mixplane.operator.kube import kube

    logging.getLogger("kopf").setLevel(logging.INFO)
    if liveness is None and settings.get("MIXPLANE_HEALTH_PORT") is not None:  # the chart's livenessProbe: GET /healthz
        host = settings.get("MIXPLANE_HEALTH_HOST")
        liveness = f"http://{host}:{settings.get('MIXPLANE_HEALTH_PORT')}/healthz"
    webhooks = start_from_env(lambda name, ns: kube().get("mixplane.io/v1alpha1", "DataMixture", ns, name))
    kwargs: dict[str, Any] = {"standalone": True, "stop_flag": stop_flag, "ready_flag": ready_flag,
                              "liveness_endpoint": liveness}
    if namespace:
        kwargs["namespaces"] = [namespace]
    else:
        kwargs["clusterwide"] = True
    try:
        asyncio.run(kopf.operator(**kwargs))
    finally:
        if webhooks is not None:
            webhooks.shutdown()
    return 0

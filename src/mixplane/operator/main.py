"""`mixplane operator`: run the DataMixture operator (kopf) against the cluster in $KUBECONFIG or in-cluster."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any


def run_operator(namespace: str | None = None, *, stop_flag: threading.Event | None = None,
                 ready_flag: threading.Event | None = None, liveness: str | None = None) -> int:
    """Block until stopped; one namespace, or every namespace when none is given."""
    import kopf

    import mixplane.operator.handlers  # noqa: F401 - registers the handlers

    from mixplane.operator.admission import start_from_env
    from mixplane.operator.kube import kube

    logging.getLogger("kopf").setLevel(logging.INFO)
    if liveness is None and os.environ.get("MIXPLANE_HEALTH_PORT"):  # the chart's livenessProbe: GET /healthz
        host = os.environ.get("MIXPLANE_HEALTH_HOST", "0.0.0.0")
        liveness = f"http://{host}:{int(os.environ['MIXPLANE_HEALTH_PORT'])}/healthz"
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

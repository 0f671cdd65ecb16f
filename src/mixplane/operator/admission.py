"""The operator's admission endpoint: H6's pure webhook functions (mixplane.operator.webhooks) over HTTPS.

Started by `mixplane operator` when MIXPLANE_WEBHOOK_PORT is set (the Helm chart sets it, with the
certificate in MIXPLANE_WEBHOOK_CERT_DIR/tls.crt + tls.key and the paths its webhook configurations call):
    MIXPLANE_WEBHOOK_VALIDATE_PATH (default /validate-datamixture): DataMixture CREATE/UPDATE
    MIXPLANE_WEBHOOK_MUTATE_PATH   (default /mutate-pod): pods labelled mixplane.io/mixture
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Mapping
from typing import Any, Callable

from mixplane import settings

log = logging.getLogger("mixplane.operator.admission")
MAX_BODY = 8 << 20


def resolver(get_mixture: Callable[[str, str], Any]) -> Callable[[str, str, Mapping[str, Any]], Any]:
    """(mixture, namespace, pod) -> what a labelled trainer pod gets, or None when there is no such mixture.

    Sidecar placement: the loader containers of the pod's slot (mixplane.operator.webhooks.trainer_index), from
    the same pure layout the operator renders its remote loader Deployments with (profile kept in the status)."""
    from mixplane.operator.builders import ClusterOptions, pod_rank_keys, pod_rank_ranges
    from mixplane.operator.handlers import options_for
    from mixplane.operator.reconcile import fallback_profile, profile_from_status, sidecar_injection, spec_of
    from mixplane.operator.webhooks import Injection, pod_key, trainer_index

    def resolve(name: str, namespace: str, pod: Mapping[str, Any]) -> Any:
        obj = get_mixture(name, namespace)
        if not obj:
            return None
        opts = options_for(obj) if obj.get("metadata", {}).get("namespace") else ClusterOptions(name=name, namespace=namespace, image="")
        sidecars: list[dict[str, Any]] = []
        volumes: list[dict[str, Any]] = []
        ranks: tuple[int, int] | None = None
        spec = spec_of(obj)
        slot = trainer_index(pod)
        key = pod_key(pod_rank_keys(spec), slot)
        if spec.kubernetes.placement == "sidecar":
            prof = profile_from_status(obj) or fallback_profile(spec)
            sidecars, volumes = sidecar_injection(obj, opts, prof, slot)
            blocks = pod_rank_ranges(spec)
            if sidecars and slot is not None and 0 <= slot < len(blocks):
                ranks = (int(blocks[slot][0]), int(blocks[slot][1]))  # the loaders end when these ranks did
            log.info("pod of mixture %s/%s, trainer slot %s: %d loader sidecar(s)", namespace, name, slot, len(sidecars))
        return Injection(mixture=name, planner=opts.planner_endpoint, secret_name=opts.secret_name, key_name=key,
                         sidecars=tuple(sidecars), volumes=tuple(volumes), trainer_ranks=ranks)

    return resolve


def make_server(host: str, port: int, cert_dir: str | None, get_mixture: Callable[[str, str], Any], *,
                validate_path: str = "/validate-datamixture", mutate_path: str = "/mutate-pod") -> ThreadingHTTPServer:
    from mixplane.operator.webhooks import mutate_review, validate_review

    resolve = resolver(get_mixture)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            n = int(self.headers.get("Content-Length") or 0)
            if n <= 0 or n > MAX_BODY:
                self.send_error(413 if n > MAX_BODY else 400)
                return
            try:
                review = json.loads(self.rfile.read(n))
                if self.path.split("?")[0] == validate_path:
                    out = validate_review(review)
                elif self.path.split("?")[0] == mutate_path:
                    out = mutate_review(review, resolve)
                else:
                    self.send_error(404)
                    return
            except Exception as e:  # noqa: BLE001 - a bad review must never take the operator down
                log.warning("admission review failed: %s", e)
                self.send_error(400, str(e)[:200])
                return
            body = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug(fmt, *args)

    srv = ThreadingHTTPServer((host, port), Handler)
    if cert_dir:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(os.path.join(cert_dir, "tls.crt"), os.path.join(cert_dir, "tls.key"))
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    return srv


def start_from_env(get_mixture: Callable[[str, str], Any]) -> ThreadingHTTPServer | None:
    port = settings.get("MIXPLANE_WEBHOOK_PORT")
    if not port:
        return None
    srv = make_server(settings.get("MIXPLANE_WEBHOOK_HOST"), int(port), settings.get("MIXPLANE_WEBHOOK_CERT_DIR"),
                      get_mixture, validate_path=settings.get("MIXPLANE_WEBHOOK_VALIDATE_PATH"),
                      mutate_path=settings.get("MIXPLANE_WEBHOOK_MUTATE_PATH"))
    threading.Thread(target=srv.serve_forever, name="admission", daemon=True).start()
    log.info("admission webhooks on port %s", port)
    return srv

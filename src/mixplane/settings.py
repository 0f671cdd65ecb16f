"""Every environment variable mixplane reads, declared once: name, type, default, who reads it and why.

The spec (`spec.py`) is the configuration of a mixture; environment variables are for what a process needs
before or outside a spec: where a trainer finds its planner and keys, the operator's and webhook's own settings,
test hooks. Each is read through :func:`get` (typed, the default from here, a bad value an error naming the
variable) and documented from this table (`docs/configuration.md`, generated: `python -m mixplane.settings`).
A test keeps the table and the code together: a ``MIXPLANE_*`` name in the source that is not declared here
fails it. Pure: no I/O beyond reading ``os.environ``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mixplane.errors import MixplaneError


class SettingError(MixplaneError, ValueError):
    """An environment variable with a value of the wrong type; the text names it."""


@dataclass(frozen=True)
class EnvVar:
    name: str
    type: type  # str, int, float or bool
    default: Any
    reader: str  # who reads it: client, components, loader, operator, webhook, cli, tests
    meaning: str


ENV: tuple[EnvVar, ...] = (
    # -- the trainer client (mixplane.client.MixtureLoader): arguments win over these
    EnvVar("MIXPLANE_PLANNER", str, None, "client", "The planner's endpoint (tcp://host:port) when `MixtureLoader(planner=)` is not given; the pod webhook injects it into trainer pods."),
    EnvVar("MIXPLANE_MIXTURE", str, None, "client", "The DataMixture's name, injected into trainer pods by the webhook (logs and metrics labels)."),
    EnvVar("MIXPLANE_RANK", int, 0, "client", "The trainer's global rank when neither the argument nor torchrun's RANK is set."),
    EnvVar("MIXPLANE_CURVE_DIR", str, None, "client", "Directory of the trainer's CURVE key pair and the servers' public key (`mixplane run` prints it; the webhook mounts it into trainer pods)."),
    EnvVar("MIXPLANE_CURVE_NAME", str, "client", "client", "The key pair's name in MIXPLANE_CURVE_DIR (rank-bound keys: client-r<N>)."),
    EnvVar("MIXPLANE_TIMEOUT_S", float, None, "client", "Seconds a step may take to arrive before the client raises; default the mixture's runtime.step_timeout_s (120 until the planner said)."),
    EnvVar("MIXPLANE_HEARTBEAT_S", float, 2.0, "client", "ZMTP heartbeat interval of the client's sockets."),
    EnvVar("MIXPLANE_PREFETCH_S", float, None, "client", "Seconds of training the client keeps requested ahead; default the mixture's runtime.prefetch_s."),
    EnvVar("MIXPLANE_PREFETCH", int, None, "client", "A fixed number of steps requested ahead instead (with MIXPLANE_PREFETCH_S too: the lesser)."),
    EnvVar("MIXPLANE_LOSS_REPORT_S", float, 1.0, "client", "At most one per-source loss report per this many seconds."),
    EnvVar("MIXPLANE_POD_DIR", str, None, "client", "A directory shared with the trainer pod's loader containers (sidecar placement; the pod webhook sets it): each rank holds a lock there while its process runs and marks a clean close, so the loaders end with the trainer (mixplane.podend)."),
    EnvVar("MIXPLANE_RESUME_ID", str, None, "client", "Identifies one launch of the job for resumes (default: torchrun's run id and restart count, else the rendezvous address)."),
    # -- torchrun's (and other launchers'), read by the client when its arguments are not given
    EnvVar("RANK", int, None, "client", "The trainer's global rank (torchrun); before MIXPLANE_RANK."),
    EnvVar("WORLD_SIZE", int, None, "client", "The trainer's world size (torchrun); default the planner's topology."),
    EnvVar("LOCAL_RANK", int, None, "client", "The trainer's rank on its node (torchrun), kept as `MixtureLoader.local_rank` for the trainer's device choice."),
    # -- component processes (planner, loader, constructor), started by the runtime or as pods
    EnvVar("MIXPLANE_METRICS_HOST", str, None, "components", "Address the components' Prometheus endpoints bind (default: each component's own, loopback in local runs; pods: 0.0.0.0, scraped through pod annotations)."),
    EnvVar("MIXPLANE_PROFILE_DIR", str, None, "components", "When set, each component writes cProfile statistics there (<component>-<pid>.prof) on exit."),
    EnvVar("MIXPLANE_INDEX_CACHE", str, None, "loader", "Directory of the loaders' page-index cache and kept listings (set and empty: no cache; unset: the user's cache directory)."),
    EnvVar("MIXPLANE_INDEX_THREADS", int, None, "loader", "Threads that read footers and indexes while a source is indexed (default: by filesystem)."),
    EnvVar("MIXPLANE_GCS_ANONYMOUS", bool, False, "loader", "Read gs:// sources without credentials (public buckets, emulators)."),
    # -- the operator and its webhook
    EnvVar("MIXPLANE_IMAGE", str, "mixplane:latest", "operator", "Image of the pods the operator renders when the DataMixture names none (spec.kubernetes.image)."),
    EnvVar("MIXPLANE_IMAGE_PULL_POLICY", str, "IfNotPresent", "operator", "imagePullPolicy of those pods."),
    EnvVar("MIXPLANE_SCALE_INTERVAL_S", float, 30.0, "operator", "Seconds between the scaler's looks at a running mixture."),
    EnvVar("MIXPLANE_RECONCILE_INTERVAL_S", float, None, "operator", "Seconds between level-triggered passes (default: the lesser of 5 and MIXPLANE_SCALE_INTERVAL_S)."),
    EnvVar("MIXPLANE_PROFILE_POLL_S", float, 5.0, "operator", "Seconds between looks at running profiling Jobs."),
    EnvVar("MIXPLANE_OPERATOR_PLANNER", str, None, "operator", "Where the operator reaches planners, overriding the Service name (a template with {name} and {namespace}; tests: a local port)."),
    EnvVar("MIXPLANE_OPERATOR_PLANNER_TIMEOUT_S", float, 3.0, "operator", "Seconds the operator waits for a planner's answer."),
    EnvVar("MIXPLANE_HEALTH_PORT", int, None, "operator", "Port of the operator's /healthz (the chart's liveness probe)."),
    EnvVar("MIXPLANE_HEALTH_HOST", str, "0.0.0.0", "operator", "Address /healthz binds."),
    EnvVar("MIXPLANE_WEBHOOK_PORT", int, None, "webhook", "When set, `mixplane operator` also serves the admission webhooks on this port (HTTPS)."),
    EnvVar("MIXPLANE_WEBHOOK_HOST", str, "0.0.0.0", "webhook", "Address the webhooks bind."),
    EnvVar("MIXPLANE_WEBHOOK_CERT_DIR", str, None, "webhook", "Directory of the webhooks' tls.crt and tls.key."),
    EnvVar("MIXPLANE_WEBHOOK_VALIDATE_PATH", str, "/validate-datamixture", "webhook", "Path of the DataMixture validating webhook."),
    EnvVar("MIXPLANE_WEBHOOK_MUTATE_PATH", str, "/mutate-pod", "webhook", "Path of the trainer pods' mutating webhook."),
    # -- test hooks (the operator-chaos tests)
    EnvVar("MIXPLANE_OPERATOR_KILL_AFTER_CALLS", int, None, "tests", "The operator SIGKILLs itself before its N-th mutating API call (operator chaos tests)."),
    EnvVar("MIXPLANE_OPERATOR_KILL_AT", str, None, "tests", "The operator SIGKILLs itself at this named cut point (update, after-update: operator chaos tests)."),
)

BY_NAME: Mapping[str, EnvVar] = {e.name: e for e in ENV}


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The typed value of environment variable `name` (declared in ENV), or its default when unset or empty."""
    var = BY_NAME.get(name)
    if var is None:
        raise KeyError(f"{name} is not a declared mixplane environment variable (mixplane.settings.ENV)")
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw == "":
        return var.default
    if var.type is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise SettingError(f"{name}={raw!r}: expected 1/0, true/false, yes/no or on/off")
    try:
        return var.type(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r}: expected {'an integer' if var.type is int else 'a number' if var.type is float else 'text'}") from None


def markdown() -> str:
    lines = ["# Environment variables", "",
             "Generated from `src/mixplane/settings.py` (`python -m mixplane.settings`). Do not edit by hand. The spec "
             "(docs/spec-reference.md) configures a mixture; these configure a process.", ""]
    for reader in dict.fromkeys(e.reader for e in ENV):
        lines += [f"## {reader}", "", "| variable | type | default | meaning |", "|---|---|---|---|"]
        for e in ENV:
            if e.reader == reader:
                d = "—" if e.default is None else f"`{e.default}`"
                lines.append(f"| `{e.name}` | {e.type.__name__} | {d} | {e.meaning} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown())

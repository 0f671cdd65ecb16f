"""Talking to a running mixture from outside its data path: control requests and the ready-file protocol.

* control requests (status, mixture updates, resume) to a planner, with CURVE when the run is secured:
  the CLI (`mixplane status|update`), the embedded runtime and tests use them, as the `admin` role;
* ready files: a component atomically writes its endpoints to `--ready-file` once it serves, and
  whoever started it (the runtime) reads them;
* `default_run_dir`: where a mixture's endpoints, logs, keys and journal live unless the spec says.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from mixplane import settings, wire
from mixplane.protocol import acknowledgment, update_refused
from mixplane.spec import DataMixtureSpec
from mixplane.wire import Kind

ADMIN_ROLE = "admin"
KEYS_SUBDIR = "keys"
ENDPOINTS_FILE = "endpoints.json"


def default_run_dir(spec: DataMixtureSpec) -> Path:
    return Path(spec.runtime.run_dir or os.path.join(".mixplane", spec.name)).resolve()


# ------------------------------------------------------------------------------------------ ready files
def write_ready(path: str | None, info: dict[str, Any]) -> None:
    """Atomically announce a component's endpoints to whoever started it."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({**info, "pid": os.getpid()}, f)
    os.replace(tmp, path)


def read_ready(path: str | os.PathLike) -> dict[str, Any] | None:
    """A component's announcement, or None while it is not ready (the file appears whole: see write_ready)."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None


# ------------------------------------------------------------------------------------------ control client
@dataclass(frozen=True)
class ControlCurve:
    """CURVE settings of a control client: the run's key directory and the key pair to present."""

    key_dir: str
    role: str = ADMIN_ROLE

    @property
    def enabled(self) -> bool:  # the shape wire.Security reads (like the spec's runtime.curve)
        return True

    def key_name(self) -> str:
        """The role's key pair; `server` for key directories made before roles existed (no `admin` pair)."""
        if (Path(self.key_dir) / f"{self.role}{wire.SECRET_SUFFIX}").exists():
            return self.role
        return "server"


def control_curve(key_dir: str | os.PathLike | None = None, *, run_dir: str | os.PathLike | None = None,
                  spec: DataMixtureSpec | None = None) -> ControlCurve | None:
    """Which keys a control request uses: an explicit key dir, else $MIXPLANE_CURVE_DIR, else the run
    dir's `keys/`, else the spec's `runtime.curve` (when enabled); None: no CURVE (an open run)."""
    if key_dir:
        return ControlCurve(os.fspath(key_dir))
    if settings.get("MIXPLANE_CURVE_DIR"):
        return ControlCurve(settings.get("MIXPLANE_CURVE_DIR"))
    if run_dir is not None and (Path(run_dir) / KEYS_SUBDIR / f"server{wire.PUBLIC_SUFFIX}").exists():
        return ControlCurve(str(Path(run_dir) / KEYS_SUBDIR))
    if spec is not None and spec.runtime.curve.enabled and spec.runtime.curve.key_dir:
        return ControlCurve(spec.runtime.curve.key_dir)
    return None


def planner_endpoint_of(run_dir: str | os.PathLike) -> str:
    """The planner endpoint a running embedded runtime wrote to `<run_dir>/endpoints.json`."""
    p = Path(run_dir) / ENDPOINTS_FILE
    try:
        ep = json.loads(p.read_text()).get("planner")
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"{p}: no running mixture here ({e})") from None
    if not isinstance(ep, str):
        raise ValueError(f"{p}: no planner endpoint")
    return ep


FROM_ENV: Any = "from-env"


def request(endpoint: str, kind: Kind, meta: dict[str, Any], timeout_s: float = 5.0, *,
            curve: Any = FROM_ENV) -> dict[str, Any]:
    """One request/reply with the planner (status, mixture updates, resume); raises on timeout or error.

    curve: a ControlCurve (key dir + role), or the spec's runtime.curve (connects with the `server`
    pair, as components do), None for an open planner; by default the admin key of $MIXPLANE_CURVE_DIR
    when set (an embedded runtime sets it for its own process while it runs), else none."""
    if curve is FROM_ENV:
        curve = control_curve()
    ctx: zmq.Context = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        if isinstance(curve, ControlCurve):
            wire.Security(ctx, curve, name=curve.key_name()).client(s)
        else:
            wire.Security(ctx, curve).client(s)
        s.connect(endpoint)
        wire.send(s, kind, meta)
        if not s.poll(int(timeout_s * 1000)):
            hint = "" if curve is not None else " (a secured run needs its keys: --curve-dir / MIXPLANE_CURVE_DIR / --run-dir)"
            raise TimeoutError(f"no answer from the planner at {endpoint} within {timeout_s:g}s{hint}")
        _, msg = wire.recv(s)
        if msg.kind == Kind.ERROR:
            raise RuntimeError(str(msg.meta.get("error")))
        return msg.meta
    finally:
        s.close(0)


def status(endpoint: str, timeout_s: float = 5.0, *, curve: Any = None) -> dict[str, Any]:
    return request(endpoint, Kind.STATUS, {}, timeout_s, curve=curve)


def update_mixture(endpoint: str, meta: dict[str, Any], timeout_s: float = 5.0, *, curve: Any = None) -> dict[str, Any]:
    """Send an UPDATE_MIXTURE (mixing.mixture_update_meta, or the weights form) and return the planner's ACK:
    ``{"generation", "effective_step", "duplicate", "planned_through", "update_id", "phase" (new updates)}``.
    Raises TimeoutError (no answer) or RuntimeError with the planner's reason: ``mixture update rejected: ...``
    (the content or the step is wrong: sending it again fails again) or ``mixture update refused: the planner
    is recovering ...; retry`` (see update_retryable)."""
    return request(endpoint, Kind.UPDATE_MIXTURE, meta, timeout_s, curve=curve)


def reshard(endpoint: str, meta: dict[str, Any], timeout_s: float = 5.0, *, curve: Any = None) -> dict[str, Any]:
    """Send a RESHARD (`{"topology": ..., "reshard_id": ...}`: from the first step the planner has not planned; or
    with a trainer's `cursor`) and return the planner's ACK: ``{"step", "generation", "world_size", "constructors",
    "session", "reshard_id", "duplicate", "spec"}``. Raises TimeoutError (no answer) or RuntimeError with the
    planner's reason: ``reshard rejected: ...`` (sending it again fails again) or ``reshard refused: ...; retry``."""
    return request(endpoint, Kind.RESHARD, meta, timeout_s, curve=curve)


def reshard_acknowledged(status: dict[str, Any] | None, reshard_id: str) -> dict[str, Any] | None:
    """The planner's record of reshard `reshard_id` in a STATUS reply (`reshards`), or None."""
    for r in (status or {}).get("reshards") or []:
        if isinstance(r, dict) and r.get("reshard_id") == reshard_id:
            return dict(r)
    return None


def update_retryable(error: BaseException | str) -> bool:
    """Whether sending the same update again may succeed: no answer (the planner is down or restarting) or a
    planner still recovering its session. False for a rejected update (a field or the step is wrong)."""
    if isinstance(error, TimeoutError):
        return True
    return not update_refused(str(error))


def update_acknowledged(status: dict[str, Any], update_id: str) -> dict[str, Any] | None:
    """The planner's acknowledgment of `update_id` in its STATUS reply (``{"update_id", "generation",
    "effective_step"}``), or None when it is not among the updates listed (the last 32): the level-triggered
    check of a sender that may have died between sending an update and reading its ACK."""
    return acknowledgment(status, "updates", "update_id", update_id)


def resume(endpoint: str, cursor: dict[str, Any], timeout_s: float = 5.0, *, curve: Any = None) -> dict[str, Any]:
    return request(endpoint, Kind.RESUME, {"cursor": cursor}, timeout_s, curve=curve)


# -- partition handoff (failover, scaling, rebalancing; planner.partitions) ------------------------
def handoff(endpoint: str, partition: str, to_host: str, timeout_s: float = 5.0, *, curve: Any = None) -> dict[str, Any]:
    """Move partition "source:replica" to the loader host (process) named `to_host` at the next step boundary.

    Returns ``{"partition", "from", "to", "epoch", "after_step"}`` once the planner has started the handoff (the
    new host then resends what was planned but not delivered; :func:`partitions` shows when it serves). Raises
    RuntimeError with the planner's reason (unknown partition or host, host not alive, already there).
    Needs the admin key (``curve=ControlCurve(key_dir, "admin")``) unless the run is open."""
    return request(endpoint, Kind.HANDOFF, {"partition": partition, "to": to_host}, timeout_s, curve=curve)


def repartition(endpoint: str, source: str, partitions: int, timeout_s: float = 5.0, *, step: int | None = None,
                hosts: list[str] | None = None, curve: Any = None, repartition_id: str | None = None) -> dict[str, Any]:
    """Read `source` with `partitions` partitions from step `step` (default: the first step not planned yet) on
    (mixplane.repartition). `hosts`: the loader hosts (processes) of the new partitions, one per partition
    (default: partition k < the old count stays on its host, the others go to the live hosts serving least).

    Returns ``{"source", "from", "partitions", "step"}`` once the planner has accepted it; it applies it when every
    step before `step` is complete at every constructor (STATUS ``repartitions`` says when). Raises RuntimeError
    with the planner's reason naming the field (unknown source, partitions out of range, a live source, a step
    already planned, an unknown host). Needs the admin key unless the run is open. `repartition_id`: an id the
    planner applies once: a repeat is answered with the first acceptance and ``duplicate: true`` (STATUS
    ``repartitions`` lists it by ``repartition_id``)."""
    meta: dict[str, Any] = {"source": source, "partitions": int(partitions)}
    if repartition_id is not None:
        meta["repartition_id"] = str(repartition_id)
    if step is not None:
        meta["step"] = int(step)
    if hosts:
        meta["hosts"] = list(hosts)
    return request(endpoint, Kind.REPARTITION, meta, timeout_s, curve=curve)


def partitions(endpoint: str, timeout_s: float = 5.0, *, curve: Any = None) -> dict[str, Any]:
    """The planner's partition table: ``{"partitions": {"a:0": {"host", "epoch", "shadows"}}, "hosts": {name:
    {"partitions", "shadows", "alive", "silent_s", "launched_as_shadow", "shadow_of"}}, "handoffs": [recent moves]}``."""
    st = status(endpoint, timeout_s, curve=curve)
    return {k: st.get(k, {} if k != "handoffs" else []) for k in ("partitions", "hosts", "handoffs")}

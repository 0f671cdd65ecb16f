"""Live mixture updates as the operator keeps them: pure, no I/O.

The DataMixture's `spec.mixture` (weights, temperature, phases, anneal, lr_scale) reaches a running planner as
one UPDATE_MIXTURE carrying the whole section (`mixing.mixture_update_meta`); the planner adopts it from the
first step it has not planned and acknowledges it. What the operator must remember across its own restarts
lives in `status.mixtureUpdate`, never in memory:

    generation / digest   the metadata.generation and the digest of the mixture section being applied
    updateId              "<uid>/<generation>": the planner applies an id once and acknowledges a repeat with
                          the same step (`duplicate`), so an operator killed after sending and before writing the
                          acknowledgment sends it again harmlessly
    state                 Acknowledged | Pending (not sent yet, or the planner was unreachable) | Refused (the
                          planner answered an error: retried with backoff, the reason in a condition)
    effectiveStep         the first step planned with it (when acknowledged)
    attempts / retryAt    backoff: 1, 2, 4 ... 60 s between tries (wall-clock seconds since the epoch)

A patch that arrives while an earlier one is still pending supersedes it: only the mixture the object holds now
is sent. The planner's STATUS lists the update ids it applied, so an acknowledgment is also *observed*.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 60.0)
HISTORY = 20


def mixture_digest(spec: Any) -> str:
    """A digest of the spec's mixture section (what a live update carries)."""
    doc = spec.mixture.model_dump(mode="json")
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def update_id(body: Mapping[str, Any]) -> str:
    md = body.get("metadata") or {}
    return f"{md.get('uid', '')}/{int(md.get('generation') or 0)}"


def backoff_s(attempts: int) -> float:
    return BACKOFF_S[min(max(attempts - 1, 0), len(BACKOFF_S) - 1)]


@dataclass(frozen=True)
class UpdatePlan:
    """What to keep in status.mixtureUpdate and whether to send the update now."""

    state: dict[str, Any]
    send: bool
    acknowledged_now: bool = False  # observed in the planner's STATUS in this pass


def applied_by_planner(planner_status: Mapping[str, Any] | None, uid: str) -> dict[str, Any] | None:
    """The planner's record of update `uid` (STATUS `updates`), or None."""
    for u in (planner_status or {}).get("updates") or []:
        if isinstance(u, Mapping) and u.get("update_id") == uid:
            return dict(u)
    return None


def plan_update(body: Mapping[str, Any], spec: Any, planner_status: Mapping[str, Any] | None, now: float) -> UpdatePlan:
    """The update state for the object as it is now, and whether to send UPDATE_MIXTURE in this pass.

    A mixture without a recorded update state (just created, or written by an operator that kept none) is taken
    as the one its planner was started with."""
    prev = dict((body.get("status") or {}).get("mixtureUpdate") or {})
    gen = int((body.get("metadata") or {}).get("generation") or 0)
    digest = mixture_digest(spec)
    if not prev:
        return UpdatePlan({"generation": gen, "digest": digest, "updateId": update_id(body), "state": "Acknowledged",
                           "effectiveStep": 0, "attempts": 0, "reason": "the mixture the planner started with",
                           "initial": True}, False)
    if prev.get("digest") != digest:
        prev = {"generation": gen, "digest": digest, "updateId": update_id(body), "state": "Pending", "attempts": 0,
                "retryAt": now, "reason": "new mixture"}
    if prev.get("state") == "Acknowledged":
        return UpdatePlan(prev, False)
    seen = applied_by_planner(planner_status, str(prev.get("updateId")))
    if seen is not None:
        return UpdatePlan(acknowledged(prev, seen), False, acknowledged_now=True)
    due = now >= float(prev.get("retryAt") or 0.0)
    return UpdatePlan(prev, due)


def acknowledged(state: Mapping[str, Any], ack: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in state.items() if k not in ("retryAt",)}
    out.update(state="Acknowledged", effectiveStep=int(ack.get("effective_step", 0)),
               reason="acknowledged by the planner")
    if ack.get("generation") is not None:
        out["plannerGeneration"] = int(ack["generation"])
    return out


def after_send(state: Mapping[str, Any], *, ack: Mapping[str, Any] | None = None, error: str | None = None,
               refused: bool = False, now: float = 0.0) -> dict[str, Any]:
    """The state after one UPDATE_MIXTURE: acknowledged, or (error) retried with backoff."""
    if ack is not None:
        return acknowledged(state, ack)
    attempts = int(state.get("attempts") or 0) + 1
    return {**state, "state": "Refused" if refused else "Pending", "attempts": attempts,
            "retryAt": round(now + backoff_s(attempts), 3),
            "reason": (f"refused by the planner: {error}" if refused else f"planner not reachable: {error}")[:900]}


def history(prev: list[Mapping[str, Any]], state: Mapping[str, Any], spec: Any) -> list[dict[str, Any]]:
    """status.updates with the acknowledged update `state` added once (keyed by generation)."""
    entry = {"generation": int(state["generation"]), "effectiveStep": int(state.get("effectiveStep") or 0),
             "weights": {k: float(v) for k, v in spec.mixture.weights.items()}}
    kept = [dict(u) for u in prev if int(u.get("generation", -1)) != entry["generation"]]
    return (kept + [entry])[-HISTORY:]


def condition_of(state: Mapping[str, Any]) -> tuple[bool, str, str]:
    """(ok, reason, message) of the MixtureApplied condition."""
    s = state.get("state")
    if s == "Acknowledged":
        return True, "Acknowledged", f"generation {state.get('generation')} in force from step {state.get('effectiveStep', 0)}"
    reason = "UpdateRefused" if s == "Refused" else "UpdatePending"
    return False, reason, f"generation {state.get('generation')}: {state.get('reason', '')} (attempt {state.get('attempts', 0)})"

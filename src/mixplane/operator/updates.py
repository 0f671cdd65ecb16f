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
from typing import Any

from mixplane.operator import requests
from mixplane.operator.requests import RequestPlan
from mixplane.protocol import update_refused


def mixture_digest(spec: Any) -> str:
    """A digest of the spec's mixture section (what a live update carries)."""
    doc = spec.mixture.model_dump(mode="json")
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def update_id(body: Mapping[str, Any]) -> str:
    md = body.get("metadata") or {}
    return f"{md.get('uid', '')}/{int(md.get('generation') or 0)}"


def applied_by_planner(planner_status: Mapping[str, Any] | None, uid: str) -> dict[str, Any] | None:
    """The planner's record of update `uid` (STATUS `updates`), or None."""
    return requests.listed(planner_status, "updates", "update_id", uid)


def plan_update(body: Mapping[str, Any], spec: Any, planner_status: Mapping[str, Any] | None, now: float) -> RequestPlan:
    """The update state for the object as it is now, and whether to send UPDATE_MIXTURE in this pass.

    A mixture without a recorded update state (just created, or written by an operator that kept none) is taken
    as the one its planner was started with."""
    prev = dict((body.get("status") or {}).get("mixtureUpdate") or {})
    gen = int((body.get("metadata") or {}).get("generation") or 0)
    digest = mixture_digest(spec)
    if not prev:
        return RequestPlan({"generation": gen, "digest": digest, "updateId": update_id(body), "state": "Acknowledged",
                            "effectiveStep": 0, "attempts": 0, "reason": "the mixture the planner started with",
                            "initial": True}, False)
    if prev.get("digest") != digest:
        prev = requests.pending({"generation": gen, "digest": digest, "updateId": update_id(body)}, now, "new mixture")
    return requests.advance(prev, applied_by_planner(planner_status, str(prev.get("updateId"))), now, acknowledged)


def acknowledged(state: Mapping[str, Any], ack: Mapping[str, Any]) -> dict[str, Any]:
    extra = {} if ack.get("generation") is None else {"plannerGeneration": int(ack["generation"])}
    return requests.acknowledged(state, int(ack.get("effective_step", 0)), extra)


def after_send(state: Mapping[str, Any], *, ack: Mapping[str, Any] | None = None, error: str | None = None,
               refused: bool = False, now: float = 0.0) -> dict[str, Any]:
    """The state after one UPDATE_MIXTURE: acknowledged, or (error) retried with backoff."""
    return requests.after_send(state, acknowledged, ack=ack, error=error, refused=refused, now=now)


# UPDATE_MIXTURE as the shell sends it: an answer "mixture update rejected" refuses it, "refused: ... recovering" is "not now"
SENDER = requests.Sender("update", "updateId", "mixture update", acknowledged, update_refused, "after-update")


def history(prev: list[Mapping[str, Any]], state: Mapping[str, Any], spec: Any) -> list[dict[str, Any]]:
    """status.updates with the acknowledged update `state` added once (keyed by generation)."""
    return requests.recorded(prev, {"generation": int(state["generation"]),
                                    "effectiveStep": int(state.get("effectiveStep") or 0),
                                    "weights": {k: float(v) for k, v in spec.mixture.weights.items()}})


def condition_of(state: Mapping[str, Any]) -> tuple[bool, str, str]:
    """(ok, reason, message) of the MixtureApplied condition."""
    return requests.condition(state, f"generation {state.get('generation')} in force from step "
                                     f"{state.get('effectiveStep', 0)}", "Update")

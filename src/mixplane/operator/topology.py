"""Topology changes of a running mixture as the operator keeps them: pure, no I/O.

A patch of the DataMixture's `spec.topology` (DP, TP, PP, CP, ranks per node) reshards the running data plane:
the operator sends the planner one RESHARD carrying the new topology and an id, without a trainer cursor; the
planner adopts it at the first step it has not planned (its own cursor there: nothing planned is planned again),
journals it, stops the old constructors and acknowledges with that step. Then, and only then, the children are
rendered for the new world: the spec ConfigMap, the constructor StatefulSet (resized; its pod template carries a
hash of the topology, so its pods are replaced by ones that read the new spec), the trainer pods' keys. Until the
acknowledgment the children stay those of the world being served (`served_body`), with the new world's trainer
keys issued beside the old ones.

What must outlive the operator lives in `status.topology`, never in memory:

    generation / digest   metadata.generation and mixplane.topology.topology_digest of the topology asked for
    (RESHARD is sent only once the planner's STATUS lists the new world's trainer keys in its key dir -- the kubelet
    refreshes the projected Secret in the running planner pod late -- so the new world's trainers are admitted)
    served                the topology (spec.topology) the planner serves once this is acknowledged; while a change
                          is pending: the one it serves now (what the children are rendered with)
    reshardId             "<uid>/topology-<generation>": the planner applies an id once and answers a repeat with the
                          same step (`duplicate`), so an operator killed between the send and the status write resends
                          it harmlessly; STATUS lists the ids it applied (the acknowledgment is also *observed*)
    state                 Acknowledged | Pending (not sent yet, or no answer) | Refused (the planner said no: retried
                          with backoff, the reason in the TopologyApplied condition)
    effectiveStep         the first step planned for the new world (when acknowledged)
    worldSize             ranks of the world asked for
    attempts / retryAt    backoff: 1, 2, 4 ... 60 s between tries
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from mixplane.operator import requests
from mixplane.operator.requests import RequestPlan


def digest_of(spec: Any) -> str:
    from mixplane.topology import topology_digest

    return topology_digest(spec)


def reshard_id(body: Mapping[str, Any]) -> str:
    md = body.get("metadata") or {}
    return f"{md.get('uid', '')}/topology-{int(md.get('generation') or 0)}"


def topology_of(spec: Any) -> dict[str, Any]:
    return dict(spec.topology.model_dump(mode="json"))


def reshard_meta(spec: Any, state: Mapping[str, Any]) -> dict[str, Any]:
    """The RESHARD request for `state` (no cursor: the planner takes the first step it has not planned)."""
    return {"topology": topology_of(spec), "reshard_id": str(state["reshardId"])}


def acknowledged_by_planner(planner_status: Mapping[str, Any] | None, rid: str) -> dict[str, Any] | None:
    return requests.listed(planner_status, "reshards", "reshard_id", rid)


def plan_topology(body: Mapping[str, Any], spec: Any, planner_status: Mapping[str, Any] | None, now: float,
                  trainer_keys: tuple[str, ...] = ()) -> RequestPlan:
    """The topology state for the object as it is now, and whether to send RESHARD in this pass.

    A mixture without a recorded state (just created, or written by an operator that kept none) is taken as served
    with the topology it has -- unless the planner answers STATUS with another topology digest: then the change is
    pending (an operator of an earlier version let the patch through without resharding)."""
    prev = dict((body.get("status") or {}).get("topology") or {})
    gen = int((body.get("metadata") or {}).get("generation") or 0)
    digest = digest_of(spec)
    serving = (planner_status or {}).get("topology_digest")
    if not prev:
        if serving is None or serving == digest:
            # (no empty text nor null in the status: a merge patch turns "" into null, which the schema refuses)
            return RequestPlan({"generation": gen, "digest": digest, "served": topology_of(spec),
                                 "state": "Acknowledged", "effectiveStep": 0, "worldSize": int(spec.world_size),
                                 "attempts": 0, "reason": "the topology the planner started with", "initial": True}, False)
        prev = {"digest": "", "served": None}  # served: unknown; rendered with the spec's own (see served_topology)
    if prev.get("digest") != digest:
        served = prev.get("served") if prev.get("state") == "Acknowledged" else prev.get("was", prev.get("served"))
        prev = requests.pending({"generation": gen, "digest": digest, "served": topology_of(spec),
                                 **({"was": served} if served else {}), "reshardId": reshard_id(body),
                                 "worldSize": int(spec.world_size)}, now, "new topology")
    missing = keys_missing(planner_status, trainer_keys)
    # the new world's trainers would be refused: wait until the kubelet refreshed the planner's key dir
    hold = (f"waiting for the planner's key dir to hold the new world's trainer keys ({', '.join(missing[:4])}"
            f"{' ...' if len(missing) > 4 else ''})") if missing else None
    return requests.advance(prev, acknowledged_by_planner(planner_status, str(prev.get("reshardId"))), now,
                            acknowledged, hold=hold)


def keys_missing(planner_status: Mapping[str, Any] | None, trainer_keys: tuple[str, ...]) -> list[str]:
    """The new world's trainer keys the planner's key dir does not hold yet (STATUS `trainer_keys`; a planner that
    does not say: none are waited for)."""
    held = (planner_status or {}).get("trainer_keys")
    if not isinstance(held, list):
        return []
    have = set(held)
    return [k for k in trainer_keys if k not in have]


def acknowledged(state: Mapping[str, Any], ack: Mapping[str, Any]) -> dict[str, Any]:
    extra = {k: int(ack[a]) for k, a in (("worldSize", "world_size"), ("plannerGeneration", "generation"))
             if ack.get(a) is not None}
    return requests.acknowledged(state, int(ack.get("step", 0)), extra, drop=("was",))


def after_send(state: Mapping[str, Any], *, ack: Mapping[str, Any] | None = None, error: str | None = None,
               refused: bool = False, now: float = 0.0) -> dict[str, Any]:
    """The state after one RESHARD: acknowledged, or (error) retried with backoff."""
    return requests.after_send(state, acknowledged, ack=ack, error=error, refused=refused, now=now)


def refused(error: str) -> bool:
    """Whether the planner's ERROR answer to a RESHARD refuses it ("reshard rejected: ..."), not "not now" ("...; retry")."""
    return "retry" not in error


SENDER = requests.Sender("reshard", "reshardId", "topology change", acknowledged, refused, "after-reshard")


def status_value(body: Mapping[str, Any], state: Mapping[str, Any]) -> dict[str, Any]:
    """status.topology as a merge patch value: `state`, with null for what the stored one has and `state` does not
    (a merge patch keeps fields it does not name: an acknowledged change must not keep `was` or `initial`)."""
    stored = (body.get("status") or {}).get("topology") or {}
    return {**{k: None for k in stored if k not in state}, **state}


def served_topology(state: Mapping[str, Any]) -> dict[str, Any] | None:
    """The topology the planner serves now: the acknowledged one, or while a change is pending the one before it
    (None: unknown, the spec's own)."""
    if state.get("state") == "Acknowledged":
        return state.get("served")
    return state.get("was")


def served_body(body: Mapping[str, Any], state: Mapping[str, Any]) -> Mapping[str, Any]:
    """`body` with the topology the planner serves now: what the children are rendered with (a ConfigMap or a
    constructor StatefulSet of the new world before the planner switched would hand constructors another world)."""
    served = served_topology(state)
    if served is None or (body.get("spec") or {}).get("topology") == served:
        return body
    out = dict(body)
    out["spec"] = {**copy.deepcopy(dict(body.get("spec") or {})), "topology": copy.deepcopy(served)}
    return out


def history(prev: list[Mapping[str, Any]], state: Mapping[str, Any]) -> list[dict[str, Any]]:
    """status.topologyChanges with the acknowledged change `state` added once (keyed by generation)."""
    return requests.recorded(prev, {"generation": int(state["generation"]),
                                    "effectiveStep": int(state.get("effectiveStep") or 0),
                                    "worldSize": int(state.get("worldSize") or 0),
                                    "reshardId": str(state.get("reshardId") or "-")})


def condition_of(state: Mapping[str, Any]) -> tuple[bool, str, str]:
    """(ok, reason, message) of the TopologyApplied condition."""
    return requests.condition(state, f"world of {state.get('worldSize')} ranks served from step "
                                     f"{state.get('effectiveStep', 0)} (generation {state.get('generation')})", "Reshard")

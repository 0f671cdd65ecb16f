"""Re-partitions of a running source as the operator keeps them: pure, no I/O.

The scaler wants a source re-partitioned when its allocation needs more partitions than it has (one partition does
what its worker threads can, the auto-partitioner's rule: `MixtureScaler.wanted_repartitions`, kept in
status.scaler.state.repartitions), or under `mixplane.io/repartition: follow` fewer once demand fell.
The operator turns the first such wish into one REPARTITION (`{source, partitions, hosts, repartition_id}`, no step:
the planner takes the first step it has not planned; hosts: partition k below the old count stays on its host, the
others go to the live loader hosts of the layout serving least) and keeps it in `status.repartition` under the one rule for
requests (operator/requests.py): sent when due, retried with backoff, held with a reason, acknowledged once. Its
`hosts` are loader hosts of the layout (`choose_hosts`), and no loader Deployment is deleted while a REPARTITION is
sent or accepted and not applied yet: the planner applies it later, and a host it gives a new partition must not be
on its way out.

    source / from / partitions   what is asked: `source` from `from` to `partitions` partitions
    repartitionId                "<uid>/repartition-<source>-<from>-<to>": the planner applies an id once and answers
                                 a repeat with its first acceptance (`duplicate`), so an operator killed between the
                                 send and the status write repeats it harmlessly
    state                        Pending (not sent, sent and not applied yet: `acceptedStep`, or no answer) | Refused
                                 (the planner said no: retried, the reason in the PartitionsApplied condition) |
                                 Acknowledged (applied: the planner reads the source with the new partitions)
    effectiveStep                the first step read with the new partitions

Acknowledged means *applied*, not accepted: the planner accepts a request at once and applies it at its step, once
every earlier step is complete everywhere; STATUS `repartitions` lists it by id with `applied`. A planner restarted
from its journal no longer lists it, and a repeat is refused ("already has M partitions"): its STATUS
`source_partitions` showing the count asked for is read as the acknowledgment too (level-triggered, never
remembered). Until then the loader layout stays packed for the counts the planner serves; from then on for the
new ones (reconcile.desired `served`), and the partitions move to the new pods with HANDOFF (controller.loader_moves).

A request is held while a handoff of the layout is in progress (draining hosts) or a topology change is pending.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from mixplane.operator import requests
from mixplane.operator.requests import RequestPlan

__all__ = ["served_partitions", "wanted_of", "repartition_id", "plan_repartition", "request_meta", "choose_hosts", "after_send",
           "acknowledged", "condition_of", "history", "status_value", "RETRYABLE", "refused", "SENDER"]

RETRYABLE = ("retry", "recovering", "pending")  # refusals that say "not now", not "never"


def repartition_id(body: Mapping[str, Any], source: str, frm: int, to: int) -> str:
    return f"{(body.get('metadata') or {}).get('uid', '')}/repartition-{source}-{int(frm)}-{int(to)}"


def served_partitions(body: Mapping[str, Any], planner_status: Mapping[str, Any] | None) -> dict[str, int] | None:
    """Partitions per source the planner reads now: its STATUS `source_partitions`; without an answer, what the status
    last said (`partitions`, when written beside `startPartitions`); None: the plan's split."""
    got = (planner_status or {}).get("source_partitions")
    if isinstance(got, Mapping) and got:
        return {str(n): int(m) for n, m in got.items()}
    kept = {str(s["name"]): int(s["partitions"]) for s in (body.get("status") or {}).get("sources") or []
            if isinstance(s, Mapping) and s.get("name") and isinstance(s.get("partitions"), int) and "startPartitions" in s}
    return kept or None


def wanted_of(scaler_state: Mapping[str, Any] | None, order: Sequence[str], served: Mapping[str, int]) -> list[tuple[str, int, int]]:
    """(source, from, to) of the re-partitions the scaler's state wants that the planner does not serve yet, in source
    order (status.scaler.state.repartitions: {source: {from, to, cores, interval}}): more partitions than served, or
    fewer when the wish was made from the count served now (a shrink, `mixplane.io/repartition: follow`)."""
    wish = ((scaler_state or {}).get("state") or {}).get("repartitions") or {}
    out = []
    for n in order:
        w = wish.get(n)
        if not isinstance(w, Mapping) or n not in served:
            continue
        to, frm, now = int(w.get("to") or 0), int(w.get("from") or 0), int(served[n])
        # more than served; or fewer (`mixplane.io/repartition: follow`), asked from the count served now
        if to > now or (1 <= to < now and frm == now):
            out.append((n, now, to))
    return out


def request_meta(state: Mapping[str, Any]) -> dict[str, Any]:
    """The REPARTITION request for `state` (no step: the first step not planned; `hosts` as the pass chose them)."""
    return {"source": str(state["source"]), "partitions": int(state["partitions"]),
            "repartition_id": str(state["repartitionId"]), **({"hosts": list(state["hosts"])} if state.get("hosts") else {})}


def choose_hosts(source: str, old: int, new: int, planner_status: Mapping[str, Any] | None,
                 layout_hosts: Collection[str]) -> list[str] | None:
    """The loader host of each of the `new` partitions: partition k below `old` stays where the planner's table has
    it when that host is in the loader layout, the others go to the live hosts *of the layout* serving least (never
    to a host outside it: its Deployment is on its way out, and one deleted in the same breath would take a partition
    with it). None: no live host of the layout (the request waits)."""
    table = planner_status or {}
    parts = table.get("partitions") or {}
    hosts = table.get("hosts") or {}
    live = sorted(h for h in set(layout_hosts) if isinstance(hosts.get(h), Mapping) and hosts[h].get("alive"))
    if not live:
        return None
    load = {h: 0 for h in live}
    for p, a in parts.items():
        h = a.get("host") if isinstance(a, Mapping) else None
        if h in load and not (str(p).startswith(f"{source}:") and int(str(p).rsplit(":", 1)[1]) < old):
            load[h] += 1  # what it keeps serving (the source's old partitions go)
    out = []
    for k in range(int(new)):
        cur = (parts.get(f"{source}:{k}") or {}).get("host") if k < old else None
        h = cur if cur in load else min(live, key=lambda x: (load[x], x))
        load[h] += 1
        out.append(h)
    return out


def acknowledged(state: Mapping[str, Any], ack: Mapping[str, Any]) -> dict[str, Any]:
    """`state` applied by the planner (`ack`: its STATUS entry, or {"step"} read from `source_partitions`)."""
    return requests.acknowledged(state, int(ack.get("step", state.get("acceptedStep") or 0)), drop=("acceptedStep",))


def accepted(state: Mapping[str, Any], ack: Mapping[str, Any]) -> dict[str, Any]:
    """The planner's ACK of a send: accepted for a step, applied once every earlier step is complete (still Pending)."""
    return {**state, "state": "Pending", "acceptedStep": int(ack.get("step", 0)),
            "reason": f"accepted by the planner for step {int(ack.get('step', 0))}"}


def after_send(state: Mapping[str, Any], *, ack: Mapping[str, Any] | None = None, error: str | None = None,
               refused: bool = False, now: float = 0.0) -> dict[str, Any]:
    """The state after one REPARTITION: accepted (applied later, observed in STATUS), or retried with backoff."""
    return requests.after_send(state, accepted, ack=ack, error=error, refused=refused, now=now)


def refused(error: str) -> bool:
    """Whether the planner's ERROR answer to a REPARTITION refuses it (a field, the count), not "not now" (recovering,
    another one pending: RETRYABLE)."""
    return not any(w in error for w in RETRYABLE)


# sent: accepted (applied at a later step, observed in STATUS) or retried with backoff
SENDER = requests.Sender("repartition", "repartitionId", "re-partition", accepted, refused, "after-repartition")


def plan_repartition(body: Mapping[str, Any], order: Sequence[str], planner_status: Mapping[str, Any] | None,
                     served: Mapping[str, int] | None, scaler_state: Mapping[str, Any] | None, now: float, *,
                     hold: str | None = None, enabled: bool = True,
                     layout_hosts: Collection[str] = ()) -> RequestPlan | None:
    """The re-partition kept in status.repartition for the object as it is now, and whether to send REPARTITION in
    this pass (with the hosts of `layout_hosts` it goes to: `choose_hosts`); None when there is none (nothing
    wanted, or sidecar placement: `enabled` False)."""
    plan = _plan(body, order, planner_status, served, scaler_state, now, hold=hold, enabled=enabled)
    if plan is None or not plan.send:
        return plan
    st = plan.state
    hosts = choose_hosts(str(st["source"]), int(st["from"]), int(st["partitions"]), planner_status, layout_hosts)
    if hosts is None:
        return RequestPlan({**st, "reason": "waiting for a live loader host of the layout"}, False)
    return RequestPlan({**st, "hosts": hosts}, True)


def _plan(body: Mapping[str, Any], order: Sequence[str], planner_status: Mapping[str, Any] | None,
          served: Mapping[str, int] | None, scaler_state: Mapping[str, Any] | None, now: float, *,
          hold: str | None, enabled: bool) -> RequestPlan | None:
    prev = dict((body.get("status") or {}).get("repartition") or {})
    served = dict(served or {})
    if prev.get("state") == "Acknowledged" or not prev:
        wanted = wanted_of(scaler_state, order, served) if enabled else []
        if not wanted:
            return RequestPlan(prev, False) if prev else None
        source, frm, to = wanted[0]
        prev = requests.pending({"source": source, "from": frm, "partitions": to,
                                 "repartitionId": repartition_id(body, source, frm, to)}, now,
                                f"the scaler wants {to} partitions")
    rid = str(prev.get("repartitionId"))
    seen = requests.listed(planner_status, "repartitions", "repartition_id", rid)
    source, to = str(prev.get("source")), int(prev.get("partitions") or 0)
    if seen is not None and seen.get("error"):  # accepted, and could not be applied at its step: asked again
        prev = requests.after_send({k: v for k, v in prev.items() if k != "acceptedStep"}, acknowledged,
                                   error=str(seen["error"]), refused=True, now=now)
        prev["repartitionId"] = f"{rid.split('#')[0]}#{int(prev['attempts'])}"
        return RequestPlan(prev, False)
    if seen is not None and not seen.get("applied"):
        return RequestPlan({**prev, "state": "Pending", "acceptedStep": int(seen.get("step", 0)),
                            "reason": f"accepted by the planner for step {int(seen.get('step', 0))}"}, False)
    if seen is None and planner_status is not None and source in served and served[source] == to:
        seen = {"step": prev.get("acceptedStep") or 0}  # applied, and the planner no longer lists it (restarted)
    if seen is None and prev.get("acceptedStep") is not None and planner_status is not None:
        # accepted, and the planner neither lists it nor serves the count: a restarted planner lost the request
        # before its step (only applied re-partitions are journaled): asked again now
        prev = {**{k: v for k, v in prev.items() if k != "acceptedStep"}, "retryAt": now,
                "reason": "the planner no longer lists the accepted request (restarted before its step): sent again"}
    if planner_status is None and seen is None:
        hold = "the planner does not answer STATUS"
    return requests.advance(prev, seen, now, acknowledged, hold=hold)


def status_value(body: Mapping[str, Any], state: Mapping[str, Any]) -> dict[str, Any]:
    """status.repartition as a merge patch value (null for what the stored one has and `state` does not)."""
    stored = (body.get("status") or {}).get("repartition") or {}
    return {**{k: None for k in stored if k not in state}, **state}


def history(prev: list[Mapping[str, Any]], state: Mapping[str, Any]) -> list[dict[str, Any]]:
    """status.repartitions with the applied re-partition `state` added once (keyed by its id)."""
    entry = {"source": str(state.get("source")), "from": int(state.get("from") or 0),
             "partitions": int(state.get("partitions") or 0), "effectiveStep": int(state.get("effectiveStep") or 0),
             "repartitionId": str(state.get("repartitionId"))}
    kept = [dict(u) for u in prev if u.get("repartitionId") != entry["repartitionId"]]
    return (kept + [entry])[-requests.HISTORY:]


def condition_of(state: Mapping[str, Any] | None) -> tuple[bool, str, str]:
    """(ok, reason, message) of the PartitionsApplied condition."""
    if not state:
        return True, "AsStarted", "every source is read with the partitions the planner started with"
    if state.get("state") == "Acknowledged":
        return True, "Acknowledged", (f"source {state.get('source')} read with {state.get('partitions')} partitions "
                                      f"from step {state.get('effectiveStep', 0)}")
    reason = "RepartitionRefused" if state.get("state") == "Refused" else "RepartitionPending"
    return False, reason, (f"source {state.get('source')} {state.get('from')} -> {state.get('partitions')} partitions: "
                           f"{state.get('reason', '')} (attempt {state.get('attempts', 0)})")

"""A request the operator sends the planner and keeps in the DataMixture's status until it is acknowledged: pure.

Live mixture updates (`updates`, UPDATE_MIXTURE) and topology changes (`topology`, RESHARD) follow one rule,
kept here once:

    state         Pending (not sent yet, or the planner did not answer) | Refused (the planner said no: retried,
                  its reason shown in a condition) | Acknowledged
    attempts /    a request is sent when `retryAt` (wall-clock seconds since the epoch) has come; after a failure
    retryAt       the next try waits 1, 2, 4 ... 60 s
    the id        the planner applies an id once and answers a repeat with the same step, so an operator killed
                  between the send and its status write resends it harmlessly; the planner's STATUS lists the ids
                  it applied, so an acknowledgment is also *observed* (level-triggered, never remembered)

A request's own fields (its id, generation, digest, what it asks for) are the caller's; `acknowledge` turns the
planner's answer into the acknowledged state (which step it took effect at, and what else the planner said).

How one kind of request is sent is a `Sender` (the planner request it is, the status field of its id, how its
answer is taken, which ERROR answers refuse it, the fault point after the planner's answer); the operator's shell
(`handlers.send_kept`) does the one send over it, so every request goes out, is classified and is logged the same
way:

    no STATUS answer in this pass   Pending, retried with backoff (not sent)
    ERROR answer                    Refused when `refused(message)` (a field, the step: the same request fails again),
                                    else Pending ("not now": a planner recovering its session, another one pending)
    no answer (timeout, socket)     Pending, retried with backoff
    ACK                             `acknowledge(state, ack)` (after the fault point `cut`)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mixplane.protocol import acknowledgment

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 60.0)
HISTORY = 20  # acknowledged requests kept in a status list (status.updates, status.topologyChanges)

Acknowledge = Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]]

__all__ = ["BACKOFF_S", "HISTORY", "RequestPlan", "Sender", "backoff_s", "listed", "pending", "advance", "acknowledged",
           "after_send", "condition", "recorded"]


def backoff_s(attempts: int) -> float:
    """Seconds before the next try after `attempts` failed ones."""
    return BACKOFF_S[min(max(attempts - 1, 0), len(BACKOFF_S) - 1)]


@dataclass(frozen=True)
class RequestPlan:
    """What to keep in the status, whether to send the request in this pass, and whether the planner's STATUS
    showed it acknowledged in this pass."""

    state: dict[str, Any]
    send: bool
    acknowledged_now: bool = False

    @property
    def pending(self) -> bool:
        return self.state.get("state") != "Acknowledged"


def listed(planner_status: Mapping[str, Any] | None, field: str, id_field: str, rid: str) -> dict[str, Any] | None:
    """The planner's record of request `rid` in its STATUS list `field`, or None."""
    return acknowledgment(planner_status or {}, field, id_field, rid)


def pending(fields: Mapping[str, Any], now: float, reason: str) -> dict[str, Any]:
    """A new request, due now."""
    return {**fields, "state": "Pending", "attempts": 0, "retryAt": now, "reason": reason}


def advance(state: Mapping[str, Any], seen: Mapping[str, Any] | None, now: float, acknowledge: Acknowledge, *,
            hold: str | None = None) -> RequestPlan:
    """One pass over a request kept in status: done, observed done now (`seen`: the planner's record of it), held
    (`hold`: why it may not be sent yet), or sent when due."""
    if state.get("state") == "Acknowledged":
        return RequestPlan(dict(state), False)
    if seen is not None:
        return RequestPlan(acknowledge(state, seen), False, acknowledged_now=True)
    if hold is not None:
        return RequestPlan({**state, "reason": hold}, False)
    return RequestPlan(dict(state), now >= float(state.get("retryAt") or 0.0))


def acknowledged(state: Mapping[str, Any], effective_step: int, extra: Mapping[str, Any] | None = None, *,
                 drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """`state` acknowledged by the planner from `effective_step` (`extra`: what else its answer said; `drop`: fields
    of the pending state that end with it)."""
    out = {k: v for k, v in state.items() if k not in ("retryAt", *drop)}
    out.update(state="Acknowledged", effectiveStep=int(effective_step), reason="acknowledged by the planner")
    out.update(extra or {})
    return out


def after_send(state: Mapping[str, Any], acknowledge: Acknowledge, *, ack: Mapping[str, Any] | None = None,
               error: str | None = None, refused: bool = False, now: float = 0.0) -> dict[str, Any]:
    """The state after one send: acknowledged (`ack`: the planner's answer), or retried with backoff."""
    if ack is not None:
        return acknowledge(state, ack)
    attempts = int(state.get("attempts") or 0) + 1
    return {**state, "state": "Refused" if refused else "Pending", "attempts": attempts,
            "retryAt": round(now + backoff_s(attempts), 3),
            "reason": (f"refused by the planner: {error}" if refused else f"planner not reachable: {error}")[:900]}


@dataclass(frozen=True)
class Sender:
    """How one kind of request kept in status is sent (the I/O is the shell's: handlers.send_kept)."""

    kind: str  # the planner request (handlers.planner_request): "update", "reshard", "repartition"
    id_field: str  # the status field holding the request's id (updateId, reshardId, repartitionId)
    what: str  # what the operator's log calls it
    acknowledge: Acknowledge  # the planner's ACK of a send -> the state after it
    refused: Callable[[str], bool]  # whether the planner's ERROR answer refuses it (else: "not now", retried as Pending)
    cut: str  # the fault point between the planner's ACK and the status saying so (a chaos test's cut)

    def request_id(self, state: Mapping[str, Any]) -> str:
        return str(state.get(self.id_field))

    def answered(self, state: Mapping[str, Any], ack: Mapping[str, Any]) -> dict[str, Any]:
        """The state after the planner took the request (`ack`: its answer)."""
        return after_send(state, self.acknowledge, ack=ack)

    def failed(self, state: Mapping[str, Any], error: str, *, answered: bool, now: float) -> dict[str, Any]:
        """The state after a send the planner answered with an ERROR (`answered`) or did not answer: Refused when
        the answer refuses it, else Pending; retried with backoff either way."""
        return after_send(state, self.acknowledge, error=error, refused=answered and self.refused(error), now=now)

    def unreachable(self, state: Mapping[str, Any], now: float) -> dict[str, Any]:
        """The state of a request due in a pass whose STATUS went unanswered: not sent, retried with backoff."""
        return self.failed(state, "no answer to STATUS", answered=False, now=now)


def condition(state: Mapping[str, Any], in_force: str, prefix: str) -> tuple[bool, str, str]:
    """(ok, reason, message) of the request's condition: `in_force` says what holds once acknowledged; `prefix`
    names the reasons otherwise (<prefix>Refused, <prefix>Pending)."""
    if state.get("state") == "Acknowledged":
        return True, "Acknowledged", in_force
    reason = f"{prefix}Refused" if state.get("state") == "Refused" else f"{prefix}Pending"
    return False, reason, f"generation {state.get('generation')}: {state.get('reason', '')} (attempt {state.get('attempts', 0)})"


def recorded(prev: list[Mapping[str, Any]], entry: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A status list of acknowledged requests with `entry` added once (keyed by its generation), the newest last."""
    kept = [dict(u) for u in prev if int(u.get("generation", -1)) != int(entry["generation"])]
    return (kept + [dict(entry)])[-HISTORY:]

"""The one rule for requests the operator keeps in status until the planner acknowledges them
(operator.requests): what live mixture updates and topology changes both follow."""

from __future__ import annotations

from mixplane.operator import requests
from mixplane.protocol import acknowledgment


def ack_fn(state, ack):
    return requests.acknowledged(state, int(ack["step"]), {"seen": ack["step"]}, drop=("was",))


def test_a_request_is_sent_when_due_and_resent_with_growing_backoff_until_acknowledged():
    st = requests.pending({"generation": 3, "rid": "u/3", "was": "old"}, now=100.0, reason="new")
    plan = requests.advance(st, None, 100.0, ack_fn)
    assert plan.send and plan.pending and not plan.acknowledged_now
    waits = []
    now = 100.0
    for _ in range(9):  # no answer: 1, 2, 4 ... capped at 60 s
        st = requests.after_send(st, ack_fn, error="timeout", now=now)
        waits.append(st["retryAt"] - now)
        assert st["state"] == "Pending" and "planner not reachable: timeout" in st["reason"]
        assert not requests.advance(st, None, now + waits[-1] - 0.01, ack_fn).send
        assert requests.advance(st, None, now + waits[-1], ack_fn).send
        now += waits[-1]
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 60.0, 60.0, 60.0]
    refused = requests.after_send(st, ack_fn, error="past step 9", refused=True, now=now)
    assert refused["state"] == "Refused" and refused["attempts"] == 10
    assert requests.condition(refused, "in force", "Update") == (False, "UpdateRefused",
                                                                 "generation 3: refused by the planner: past step 9 (attempt 10)")
    done = requests.after_send(refused, ack_fn, ack={"step": 41})
    assert done["state"] == "Acknowledged" and done["effectiveStep"] == 41 and done["seen"] == 41
    assert "retryAt" not in done and "was" not in done and done["rid"] == "u/3"
    assert requests.condition(done, "in force", "Update") == (True, "Acknowledged", "in force")
    again = requests.advance(done, {"step": 99}, now + 1000, ack_fn)  # acknowledged once: a later record changes nothing
    assert again.state == done and not again.send and not again.acknowledged_now


def test_an_acknowledgment_observed_in_the_planner_status_ends_the_request_without_a_send():
    st = requests.pending({"generation": 1, "rid": "x/1"}, now=5.0, reason="new")
    status = {"reshards": [{"reshard_id": "x/0", "step": 3}, {"reshard_id": "x/1", "step": 12}, "junk"]}
    seen = requests.listed(status, "reshards", "reshard_id", "x/1")
    assert seen == acknowledgment(status, "reshards", "reshard_id", "x/1") == {"reshard_id": "x/1", "step": 12}
    assert requests.listed(None, "reshards", "reshard_id", "x/1") is None
    assert requests.listed(status, "reshards", "reshard_id", "x/2") is None
    plan = requests.advance(st, seen, 5.0, ack_fn)
    assert plan.acknowledged_now and not plan.send and plan.state["effectiveStep"] == 12


def test_a_held_request_is_not_sent_and_says_why():
    st = requests.pending({"generation": 2}, now=0.0, reason="new")
    plan = requests.advance(st, None, 50.0, ack_fn, hold="waiting for keys")
    assert not plan.send and plan.pending and plan.state["reason"] == "waiting for keys"


def test_the_history_keeps_each_generation_once_and_the_newest_last():
    hist: list = []
    for g in [1, 2, 2, 3] + list(range(4, 4 + requests.HISTORY)):
        hist = requests.recorded(hist, {"generation": g, "effectiveStep": g * 10})
    assert [h["generation"] for h in hist] == list(range(4, 4 + requests.HISTORY))
    assert requests.recorded([{"generation": 1, "effectiveStep": 1}], {"generation": 1, "effectiveStep": 7}) == [
        {"generation": 1, "effectiveStep": 7}]


def test_every_kind_of_request_is_sent_under_one_rule_and_keeps_its_own_refusals():
    """requests.Sender: the live update, the topology change and the re-partition are sent by one shell
    (handlers.send_kept); what an answer makes of their state is the sender's. The ERROR texts are the planner's
    (planner/server.py, planner/repartitioning.py)."""
    from mixplane.operator import repartitions, topology, updates

    cases = [(updates.SENDER, {"updateId": "u/2", "generation": 2},
              "mixture update rejected: mixture.weights: unknown source x",
              "mixture update refused: the planner is recovering its session (re-planning); retry"),
             (topology.SENDER, {"reshardId": "u/topology-3", "generation": 3},
              "reshard rejected: the global batch must stay the same",
              "reshard refused: the planner is recovering its session; retry"),
             (repartitions.SENDER, {"repartitionId": "u/repartition-code-1-2", "source": "code", "from": 1, "partitions": 2},
              "repartition rejected: partitions: source 'code' already has 2 partitions",
              "repartition rejected: the planner is recovering its session; retry")]
    assert [s.kind for s, *_ in cases] == ["update", "reshard", "repartition"]
    for sender, fields, no, not_now in cases:
        st = requests.pending(fields, now=10.0, reason="new")
        assert sender.request_id(st) == next(iter(fields.values()))
        refused = sender.failed(st, no, answered=True, now=10.0)
        assert refused["state"] == "Refused" and refused["attempts"] == 1 and refused["retryAt"] == 11.0, sender.kind
        assert refused["reason"] == f"refused by the planner: {no}"
        later = sender.failed(st, not_now, answered=True, now=10.0)
        assert later["state"] == "Pending" and later["reason"].startswith("planner not reachable"), sender.kind
        # no answer at all, and a pass whose STATUS went unanswered: Pending, never Refused (whatever the text says)
        assert sender.failed(st, no, answered=False, now=10.0)["state"] == "Pending"
        down = sender.unreachable(refused, now=20.0)
        assert down["state"] == "Pending" and down["attempts"] == 2 and down["retryAt"] == 22.0
        assert down["reason"] == "planner not reachable: no answer to STATUS"
    up = updates.SENDER.answered(requests.pending({"updateId": "u/2", "generation": 2}, 0.0, "new"),
                                 {"effective_step": 40, "generation": 5})
    assert up["state"] == "Acknowledged" and up["effectiveStep"] == 40 and up["plannerGeneration"] == 5
    topo = topology.SENDER.answered(requests.pending({"reshardId": "t", "generation": 3, "was": {"dp": 2}}, 0.0, "new"),
                                    {"step": 17, "world_size": 4})
    assert topo["state"] == "Acknowledged" and topo["effectiveStep"] == 17 and topo["worldSize"] == 4 and "was" not in topo
    # a re-partition the planner accepted is still Pending: acknowledged only once STATUS shows it applied
    rp = repartitions.SENDER.answered(requests.pending({"repartitionId": "r", "source": "code"}, 0.0, "new"), {"step": 12})
    assert rp["state"] == "Pending" and rp["acceptedStep"] == 12
    assert {s.cut for s, *_ in cases} == {"after-update", "after-reshard", "after-repartition"}

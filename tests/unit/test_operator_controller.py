"""The level-triggered pass as pure functions: decisions live in the status, nothing in memory.

An operator restarted at any point continues from the status and what it observes: a scaled layout stays, no
loader Deployment goes before the planner's table shows it serves nothing, a live update is sent with one id
until it is acknowledged, and a scaler restored from the status decides what one never restarted decides.
"""

from __future__ import annotations

import copy
import json
import random

import pytest

from mixplane.operator.builders import ClusterOptions
from mixplane.operator.controller import (MESSAGE_CHARS, Observed, decide, degraded_of, desired_hosts,
                                          loader_refused_message, status_patch)
from mixplane.operator.annotations import ANN_TPS
from mixplane.operator.reconcile import costs_of, desired, segments_of, spec_of
from mixplane.operator.scaling import MixtureScaler, Observation
from mixplane.operator.updates import after_send, applied_by_planner, mixture_digest, plan_update
from tests.unit.operator_testdata import FakeKeys

MIB = 1 << 20
OPTS = ClusterOptions(name="demo", namespace="ml", image="mixplane:test")
KEYS = FakeKeys({r: ("p" * 40, "s" * 40) for r in ("server", "component", "client", "admin")})
PROFILE = {"version": 1, "sources": {"web": {"cpu_s_per_token": 1.5e-6, "memory_per_partition": 40 * MIB},
                                     "code": {"cpu_s_per_token": 6e-5, "memory_per_partition": 40 * MIB}}}
PHASE = 32


def body(status=None, generation=1, weights=None, temperature=1.0):
    return {
        "apiVersion": "mixplane.io/v1alpha1", "kind": "DataMixture",
        "metadata": {"name": "demo", "namespace": "ml", "uid": "u-1", "generation": generation,
                     "annotations": {ANN_TPS: "30000", "mixplane.io/scale-on": "declared"}},
        "spec": {
            "sources": [{"name": "web", "uri": "s3://b/web", "tokenizer": "/t.json"},
                        {"name": "code", "uri": "s3://b/code", "tokenizer": "/t.json"}],
            "mixture": {"weights": weights or {"web": 0.9, "code": 0.1}, "seed": 11, "temperature": temperature,
                        "phases": [{"start_step": PHASE, "weights": {"web": 0.2, "code": 0.8}}]},
            "batch": {"sequences": 4, "seq_len": 128},
            "topology": {"modules": {"backbone": {"dp": 2}}},
            "strategy": {"name": "vanilla"},
        },
        "status": status or {},
    }


def observed(b, *, loaders=None, planner=None, now=1000.0, interval=30.0):
    return Observed(b, OPTS, PROFILE, KEYS, loaders or {}, planner, (True, ""), now, interval)


def loader_deps(d):
    return {o["metadata"]["name"]: o for o in d.objects if o["kind"] == "Deployment"
            and o["metadata"]["labels"].get("mixplane.io/role") == "loader"}


def host(dep):
    return dep["metadata"]["annotations"]["mixplane.io/host"]


def table(served: dict[str, str], alive=()):
    """A planner STATUS with its partition table: partition -> host, hosts alive."""
    hosts = {h: {"alive": True} for h in set(served.values()) | set(alive)}
    return {"planned_through": 10, "sources": ["web", "code"], "tokens_planned": 1000,
            "partitions": {p: {"host": h} for p, h in served.items()}, "hosts": hosts}


def scaled_shares():
    return {"web": 0.2, "code": 0.8}


def test_a_scaled_layout_kept_in_the_status_survives_a_restart_and_nothing_is_deleted_blind():
    first = decide(observed(body()))
    base = loader_deps(first.desired)
    assert len(base) == 1  # web and code share one pod before the phase
    st = {**first.intent, **first.status, "layout": {**first.intent["layout"], "shares": scaled_shares()}}
    # a restarted operator: the same object (decisions in its status), the old shared pod still running, no planner
    again = decide(observed(body(st), loaders=base, planner=None))
    scaled = loader_deps(again.desired)
    assert set(scaled) != set(base) and len(scaled) == 3  # the scaled layout, not the schedule's
    assert again.delete == [] and again.handoffs == []
    assert again.draining == [host(next(iter(base.values())))]
    # the status without the scaled shares (what a memo-keeping operator wrote) renders the schedule's layout
    legacy = {k: v for k, v in st.items() if k != "layout"}
    plain = decide(observed(body(legacy), loaders={**base, **scaled}, planner=None))
    assert set(loader_deps(plain.desired)) == set(base)
    assert plain.delete == []  # the scaled Deployments stay: nobody said their partitions moved


def test_old_loaders_go_only_once_the_planner_table_shows_they_serve_nothing():
    first = decide(observed(body()))
    (old_dep,) = loader_deps(first.desired)
    old = host(loader_deps(first.desired)[old_dep])
    st = {**first.intent, **first.status, "layout": {**first.intent["layout"], "shares": scaled_shares()}}
    b = body(st)
    d = decide(observed(b, loaders=loader_deps(first.desired))).desired
    want = desired_hosts(d)
    new_hosts = set(want.values())
    loaders = {**loader_deps(first.desired), **loader_deps(d)}
    # the old host serves everything, the new ones are up: hand over, delete nothing
    a = decide(observed(b, loaders=loaders, planner=table({p: old for p in want}, alive=new_hosts)))
    assert sorted(a.handoffs) == sorted(want.items()) and a.delete == [] and a.draining == [old]
    # a new host not alive yet: no handoff to it
    dead = sorted(new_hosts)[0]
    t = table({p: old for p in want}, alive=new_hosts)
    t["hosts"][dead]["alive"] = False
    a = decide(observed(b, loaders=loaders, planner=t))
    assert all(to != dead for _, to in a.handoffs) and a.delete == []
    # one partition moved, another still on the old host: the old one stays
    moved = dict.fromkeys(want, old)
    first_p = sorted(want)[0]
    moved[first_p] = want[first_p]
    a = decide(observed(b, loaders=loaders, planner=table(moved, alive=new_hosts)))
    assert a.delete == [] and (first_p, want[first_p]) not in a.handoffs
    # everything moved: the old Deployment goes, nothing is draining
    a = decide(observed(b, loaders=loaders, planner=table(dict(want), alive=new_hosts)))
    assert a.delete == [old_dep] and a.handoffs == [] and a.draining == []


def test_children_are_applied_when_they_change_and_not_on_every_tick():
    first = decide(observed(body()))
    assert first.apply  # nothing applied yet
    st = {**first.intent, **first.status}
    again = decide(observed(body(st), loaders=loader_deps(first.desired), now=1001.0))
    assert again.apply == [] and again.children_hash == first.children_hash
    # a child that disappeared is applied again
    assert decide(observed(body(st), loaders={}, now=1001.0)).apply
    # and a resync after RESYNC_S even when nothing changed
    assert decide(observed(body(st), loaders=loader_deps(first.desired), now=1000.0 + 301)).apply


def test_a_patch_becomes_one_pending_update_sent_until_acknowledged_exactly_once():
    first = decide(observed(body()))
    assert first.update.state["state"] == "Acknowledged" and not first.update.send  # the mixture it started with
    st = {**first.intent, **first.status}
    patched = body(st, generation=2, weights={"web": 0.1, "code": 0.9}, temperature=2.0)
    spec = spec_of(patched)
    p = plan_update(patched, spec, None, 2000.0)
    assert p.send and p.state["state"] == "Pending" and p.state["updateId"] == "u-1/2"
    assert p.state["digest"] == mixture_digest(spec) != st["mixtureUpdate"]["digest"]
    # unreachable: backoff doubles; refused: the reason is kept and it is retried too
    s1 = after_send(p.state, error="timeout", now=2000.0)
    assert s1["state"] == "Pending" and s1["retryAt"] == 2001.0 and s1["attempts"] == 1
    s2 = after_send(s1, error="mixture.weights: unknown source x", refused=True, now=2001.0)
    assert s2["state"] == "Refused" and s2["retryAt"] == 2003.0 and "unknown source" in s2["reason"]
    again = body({**st, "mixtureUpdate": s2}, generation=2, weights={"web": 0.1, "code": 0.9}, temperature=2.0)
    assert not plan_update(again, spec, None, 2002.0).send  # not before retryAt
    assert plan_update(again, spec, None, 2003.0).send
    # the planner's STATUS lists the id (the ack was lost with a killed operator): acknowledged without sending
    planner = {"updates": [{"update_id": "u-1/1x", "effective_step": 3}, {"update_id": "u-1/2", "effective_step": 17, "generation": 4}]}
    assert applied_by_planner(planner, "u-1/2")["effective_step"] == 17
    seen = plan_update(again, spec, planner, 2002.0)
    assert not seen.send and seen.acknowledged_now and seen.state["effectiveStep"] == 17
    # the whole pass records it once in status.updates, and a later pass adds nothing
    acts = decide(observed(again, planner={**table({}), **planner}))
    assert [u["generation"] for u in acts.status["updates"]] == [2] and acts.status["updates"][0]["effectiveStep"] == 17
    done = {**again["status"], **acts.intent, **acts.status, "mixtureUpdate": acts.update.state}
    later = decide(observed(body(done, generation=2, weights={"web": 0.1, "code": 0.9}, temperature=2.0),
                            planner={**table({}), **planner}))
    assert "updates" not in status_patch(done, later.status) and not later.update.send
    # a newer patch while one is pending supersedes it
    newer = body({**st, "mixtureUpdate": s2}, generation=3, weights={"web": 0.5, "code": 0.5})
    q = plan_update(newer, spec_of(newer), None, 2002.0)
    assert q.send and q.state["updateId"] == "u-1/3" and q.state["attempts"] == 0


def test_the_scaler_restored_from_the_status_decides_what_one_never_restarted_decides():
    rng = random.Random(5)
    b = body()
    spec = spec_of(b)
    costs = costs_of(PROFILE, spec)
    segs = segments_of(spec, PROFILE)
    parts = {"web": 1, "code": 2}

    def fresh():
        return MixtureScaler(costs, parts, segs, segs[0][1], 30000.0)

    ref, restarted = fresh(), fresh()
    for i in range(60):
        obs = Observation(step=i * 2, tokens_per_s=30000.0 * rng.uniform(0.5, 1.5),
                          waiting=frozenset(rng.sample(["web", "code"], rng.randint(0, 1))),
                          delivered_tokens_per_s={"web": rng.uniform(1e3, 3e4), "code": rng.uniform(1e2, 1e4)})
        a = ref.observe(obs)
        state = copy.deepcopy(restarted.state_dict())
        restarted = fresh()  # a new operator process every interval
        restarted.load_state_dict(state)
        b_ = restarted.observe(obs)
        assert a == b_, i
        assert ref.state_dict() == restarted.state_dict()
    assert ref.decisions  # the sequence did make the policy act
    with pytest.raises(ValueError, match="not the mixture's"):
        fresh().load_state_dict({"alloc": {"other": 1.0}})


def test_the_scaler_runs_only_when_its_interval_is_due_and_its_state_rides_in_the_intent():
    first = decide(observed(body()))
    st = {**first.intent, **first.status}
    planner = table({})
    a = decide(observed(body(st), planner=planner, now=5000.0))
    assert a.intent["scaler"]["observedAt"] == 5000.0 and a.intent["scaler"]["state"]["interval"] == 1
    st2 = {**st, **a.intent}
    b = decide(observed(body(st2), planner=planner, now=5010.0))  # within the interval: state unchanged
    assert b.intent["scaler"] == a.intent["scaler"]
    c = decide(observed(body(st2), planner=planner, now=5031.0))
    assert c.intent["scaler"]["state"]["interval"] == 2
    # the planner unreachable: the kept state stays as it was
    assert decide(observed(body(st2), planner=None, now=6000.0)).intent["scaler"] == a.intent["scaler"]


def test_desired_hosts_follow_the_shares():
    b = body()
    d = desired(b, OPTS, PROFILE, KEYS, step=0, shares=scaled_shares())
    assert sorted(desired_hosts(d)) == ["code:0", "code:1", "web:0"]


def test_shadow_loaders_are_rendered_like_their_primaries_and_a_promoted_shadow_is_not_handed_back():
    b = body()
    b["spec"]["runtime"] = {"shadow_loaders": 1}
    first = decide(observed(b))
    deps = loader_deps(first.desired)
    shadows = {n: d for n, d in deps.items() if "mixplane.io/shadow-of" in d["metadata"]["annotations"]}
    primaries = {n: d for n, d in deps.items() if n not in shadows}
    assert len(shadows) == len(primaries) == 1
    (sd,), (pd,) = shadows.values(), primaries.values()
    assert sd["metadata"]["annotations"]["mixplane.io/shadow-of"] == host(pd)
    assert sd["metadata"]["annotations"]["mixplane.io/partitions"] == pd["metadata"]["annotations"]["mixplane.io/partitions"]
    # sized and scaled like the primary, started as a shadow, kept off the primary's node where possible
    c_s, c_p = sd["spec"]["template"]["spec"]["containers"][0], pd["spec"]["template"]["spec"]["containers"][0]
    assert c_s["resources"] == c_p["resources"] and sd["spec"]["replicas"] == pd["spec"]["replicas"]
    assert "--shadow" in c_s["args"] and "--shadow" not in c_p["args"]
    # it names its primary's host: the planner has it stand by for whatever that host is handed later
    assert c_s["args"][c_s["args"].index("--shadow-of") + 1] == host(pd) and "--shadow-of" not in c_p["args"]
    for d in (sd, pd):
        term = d["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
        assert term["podAffinityTerm"]["labelSelector"]["matchLabels"]["mixplane.io/loader-group"] == \
            pd["spec"]["template"]["metadata"]["labels"]["mixplane.io/loader-group"]
    # the layout wants the primary; a partition its shadow serves after a failover stays there, nothing is deleted
    want = desired_hosts(first.desired)
    assert set(want.values()) == {host(pd)}
    st = {**first.intent, **first.status}
    promoted = table(dict.fromkeys(want, host(sd)), alive=[host(pd)])
    a = decide(observed(body(st) | {"spec": b["spec"]}, loaders=deps, planner=promoted))
    assert a.handoffs == [] and a.delete == [] and a.draining == []


def topo_body(status, generation, dp):
    b = body(status, generation=generation)
    b["spec"]["topology"] = {"modules": {"backbone": {"dp": dp}}}
    return b


def kids(acts):
    return {(o["kind"], o["metadata"]["name"]): o for o in acts.desired.objects}


def test_a_topology_patch_is_one_reshard_and_the_new_world_is_rendered_only_once_the_planner_took_it():
    from mixplane.operator.topology import after_send as topo_after_send, plan_topology, reshard_meta, served_body
    from mixplane.topology import topology_digest

    first = decide(observed(body()))
    t0 = first.topology.state
    assert t0["state"] == "Acknowledged" and t0["initial"] and not first.topology.send and t0["worldSize"] == 2
    before = kids(first)
    st = {**first.intent, **first.status}
    # kubectl patch spec.topology dp 2 -> 1: one RESHARD with an id, no cursor; children still of the served world
    patched = topo_body(st, 2, 1)
    acts = decide(observed(patched, planner=table({}), now=2000.0))
    t = acts.topology.state
    assert acts.topology.send and t["state"] == "Pending" and t["reshardId"] == "u-1/topology-2" and t["worldSize"] == 1
    # written first, as a merge patch: what the stored state has and this one not is nulled (initial, effectiveStep)
    assert acts.intent["topology"] == {**t, "initial": None, "effectiveStep": None}
    assert t["was"]["modules"]["backbone"]["dp"] == 2
    assert reshard_meta(spec_of(patched), t) == {"topology": spec_of(patched).topology.model_dump(mode="json"),
                                                 "reshard_id": "u-1/topology-2"}
    now = kids(acts)
    assert now[("StatefulSet", "demo-constructor")]["spec"]["replicas"] == 2
    assert json.loads(now[("ConfigMap", "demo-spec")]["data"]["spec.json"])["topology"]["modules"]["backbone"]["dp"] == 2
    # the new world's trainer keys are issued beside the old one's before the planner switches
    assert {"client-r0-1.key_secret", "client-r0-0.key_secret"} <= set(now[("Secret", "demo-keys")]["stringData"])
    assert set(now[("Secret", "demo-trainer-keys")]["stringData"]) == {"client-r0-1.key", "client-r0-0.key"}
    assert acts.status["phase"] == "Updating"
    cond = {c["type"]: c for c in acts.status["conditions"]}["TopologyApplied"]
    assert cond["status"] == "False" and cond["reason"] == "ReshardPending"
    # the planner's key dir does not hold the new world's trainer key yet (the kubelet refreshes the projected Secret
    # late): no RESHARD until it does, or the new world's trainers would be refused
    wait = decide(observed(patched, planner={**table({}), "trainer_keys": ["client-r0-1"]}, now=2000.0))
    assert not wait.topology.send and "client-r0-0" in wait.topology.state["reason"] and wait.topology.pending
    assert decide(observed(patched, planner={**table({}), "trainer_keys": ["client-r0-0", "client-r0-1"]}, now=2000.0)).topology.send
    # no answer: retried with backoff; a refusal is kept with its reason
    s1 = topo_after_send(t, error="timeout", now=2000.0)
    assert s1["state"] == "Pending" and s1["retryAt"] == 2001.0
    s2 = topo_after_send(s1, error="reshard rejected: the global batch must stay the same", refused=True, now=2001.0)
    assert s2["state"] == "Refused" and s2["retryAt"] == 2003.0 and s2["was"] == t["was"]
    assert not plan_topology(topo_body({**st, "topology": s2}, 2, 1), spec_of(patched), None, 2002.0).send
    # the planner's STATUS lists the id (an operator killed after the send): acknowledged without sending again
    planner = {**table({}), "reshards": [{"reshard_id": "u-1/topology-2", "step": 23, "generation": 3, "world_size": 1}],
               "topology_digest": topology_digest(spec_of(patched))}
    pending = topo_body({**st, "topology": s2}, 2, 1)
    done = decide(observed(pending, planner=planner, now=2002.0))
    assert done.topology.acknowledged_now and not done.topology.send
    assert done.topology.state["effectiveStep"] == 23 and "was" not in done.topology.state
    assert [c["effectiveStep"] for c in done.status["topologyChanges"]] == [23]
    after = kids(done)
    # the new world: constructors resized and replaced (their template hashes the topology), keys of the new world
    # only; the planner and the loaders keep their pod templates (nothing restarts them)
    assert after[("StatefulSet", "demo-constructor")]["spec"]["replicas"] == 1
    tmpl = lambda k, name: k[name]["spec"]["template"]  # noqa: E731
    assert tmpl(after, ("StatefulSet", "demo-constructor")) != tmpl(before, ("StatefulSet", "demo-constructor"))
    assert tmpl(after, ("Deployment", "demo-planner")) == tmpl(before, ("Deployment", "demo-planner"))
    for (kind, name), o in before.items():
        if kind == "Deployment" and o["metadata"]["labels"].get("mixplane.io/role") == "loader":
            assert tmpl(after, (kind, name)) == o["spec"]["template"], name
    assert set(after[("Secret", "demo-trainer-keys")]["stringData"]) == {"client-r0-0.key"}
    # what server-side apply of stringData leaves in the Secrets is removed by name: the old world's pod keys only
    from mixplane.operator.keys import stale_trainer_keys

    data = {"server.key": "x", "client.key": "x", "client-r0-1.key": "x", "client-r0-1.key_secret": "x", "client-r0-0.key": "x"}
    assert stale_trainer_keys(data, ("client-r0-0",)) == ["client-r0-1.key", "client-r0-1.key_secret"]
    assert stale_trainer_keys(data, ("client-r0-0", "client-r0-1")) == [] and stale_trainer_keys(None, ()) == []
    assert done.status["phase"] != "Updating"
    # recorded once: a later pass adds nothing and sends nothing
    kept = {**pending["status"], **done.intent, **done.status}
    later = decide(observed(topo_body(kept, 2, 1), planner=planner, now=2003.0))
    assert not later.topology.send and "topologyChanges" not in status_patch(kept, later.status)
    assert served_body(topo_body(kept, 2, 1), later.topology.state)["spec"]["topology"]["modules"]["backbone"]["dp"] == 1
    # a newer patch while one is pending supersedes it and keeps the world served before both
    newer = plan_topology(topo_body({**st, "topology": s2}, 3, 4), spec_of(topo_body({}, 3, 4)), None, 2002.0)
    assert newer.send and newer.state["reshardId"] == "u-1/topology-3" and newer.state["was"] == t["was"]


# ---- re-partitions (issue 20 item 4) ------------------------------------------------------------------------------
def calm_body(status=None):
    b = body(status)
    b["spec"]["mixture"]["phases"] = []  # code needs one partition at its peak share 0.1
    return b


def rp_planner(served, parts, listed=(), **extra):
    st = table(served)
    return {**st, "source_partitions": dict(parts), "repartitions": list(listed), **extra}


def test_a_wanted_repartition_is_sent_once_acknowledged_when_applied_and_the_layout_follows_the_served_counts():
    from mixplane.operator import repartitions as rp

    first = decide(observed(calm_body()))
    st = {**first.intent, **first.status}
    assert {s["name"]: (s["partitions"], s["startPartitions"]) for s in st["sources"]} == {"web": (1, 1), "code": (1, 1)}
    assert first.repartition is None and st["conditions"][-1]["type"] == "PartitionsApplied"
    # the scaler (status.scaler, not due in this pass) wants code read by 2 partitions
    st["scaler"] = {"observedAt": 1000.0, "last": {}, "state": {"repartitions": {
        "code": {"from": 1, "to": 2, "cores": 1.44, "interval": 3}}}}
    st["layout"] = {**st["layout"], "shares": scaled_shares()}
    deps = loader_deps(decide(observed(calm_body(st))).desired)
    served = {p: host(d) for d in deps.values() for p in d["metadata"]["annotations"]["mixplane.io/partitions"].split(",")}
    one = {"web": 1, "code": 1}
    a = decide(observed(calm_body(st), loaders=deps, planner=rp_planner(served, one)))
    rid = "u-1/repartition-code-1-2"
    assert a.repartition.send and a.repartition.state["repartitionId"] == rid and a.repartition.state["state"] == "Pending"
    # to hosts of the layout: code:0 stays on its host, code:1 goes to the layout's host serving least
    assert rp.request_meta(a.repartition.state) == {"source": "code", "partitions": 2, "repartition_id": rid,
                                                   "hosts": [served["code:0"], served["code:0"]]}
    assert served["code:0"] != served["web:0"]
    assert {x["type"]: x["status"] for x in a.status["conditions"]}["PartitionsApplied"] == "False"
    # the pods stay packed for the served count: code:0 alone in a pod sized past one process
    assert sorted(",".join(sorted(served)).split(",")) == ["code:0", "web:0"]
    # accepted for step 11, not applied yet: kept, not sent again
    acc = rp.after_send(a.repartition.state, ack={"source": "code", "from": 1, "partitions": 2, "step": 11})
    assert acc["state"] == "Pending" and acc["acceptedStep"] == 11
    st2 = {**st, "repartition": acc}
    entry = {"source": "code", "from": 1, "partitions": 2, "step": 11, "applied": False, "repartition_id": rid}
    b = decide(observed(calm_body(st2), loaders=deps, planner=rp_planner(served, one, [entry])))
    assert not b.repartition.send and b.repartition.state["state"] == "Pending"
    # a planner that lost it (restarted before its step: not listed, the count not served): sent again, same id
    c = decide(observed(calm_body(st2), loaders=deps, planner=rp_planner(served, one)))
    assert c.repartition.send and c.repartition.state["repartitionId"] == rid
    # applied: acknowledged now, recorded once; the layout is packed for 2 partitions of code, whose launch lists
    # name none of them (the planner's table hands them out), and the spec the planner reads keeps 1
    two = {"web": 1, "code": 2}
    done = decide(observed(calm_body(st2), loaders=deps, planner=rp_planner(served, two, [{**entry, "applied": True}])))
    assert done.repartition.acknowledged_now and done.repartition.state["state"] == "Acknowledged"
    assert done.status["repartitions"] == [{"source": "code", "from": 1, "partitions": 2, "effectiveStep": 11,
                                            "repartitionId": rid}]
    assert {s["name"]: (s["partitions"], s["startPartitions"]) for s in done.status["sources"]} == {"web": (1, 1), "code": (2, 1)}
    new = loader_deps(done.desired)
    placed = sorted(p for d in new.values() for p in d["metadata"]["annotations"]["mixplane.io/partitions"].split(","))
    assert placed == ["code:0", "code:1", "web:0"]
    for d in new.values():
        args = d["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--host-name" in args and not any(x.startswith("code") for x in args), args
    spec_json = next(o for o in done.desired.objects if o["kind"] == "ConfigMap")["data"]["spec.json"]
    assert [s["replicas"] for s in json.loads(spec_json)["sources"]] == [1, 1]
    # the partitions move to the new pods by HANDOFF once those are alive; the old pods stay until they serve nothing
    assert done.handoffs == [] and done.delete == []
    now_served = {**served, "code:1": served["code:0"]}  # where the planner put the new partition
    alive = rp_planner(now_served, two, [{**entry, "applied": True}])
    alive["hosts"].update({host(d): {"alive": True} for d in new.values()})
    moving = decide(observed(calm_body(st2), loaders={**deps, **new}, planner=alive))
    want = desired_hosts(done.desired)
    assert moving.handoffs == [(p, h) for p, h in sorted(want.items()) if now_served[p] != h] == [("code:1", want["code:1"])]
    assert moving.delete == []
    # the next pass (the status written): nothing sent, not recorded again
    st3 = {**st2, **{k: v for k, v in done.status.items() if k in ("repartition", "repartitions", "sources")}}
    again = decide(observed(calm_body(st3), loaders={**deps, **new}, planner=rp_planner(served, two)))
    assert not again.repartition.send and "repartitions" not in again.status
    # a restarted planner serves the count and no longer lists the request: read as applied
    lost = decide(observed(calm_body(st2), loaders=deps, planner=rp_planner(served, two)))
    assert lost.repartition.acknowledged_now and lost.repartition.state["effectiveStep"] == 11
    # without a STATUS the layout stays packed for the counts the status last showed
    blind = decide(observed(calm_body(st3), loaders={**deps, **new}, planner=None))
    assert set(loader_deps(blind.desired)) == set(new)


def test_after_a_repartition_the_new_pods_shadow_deployments_name_the_host_they_stand_by_for():
    """shadow_loaders 1, code 1 -> 2 applied: the pods of the new layout are rendered with their shadow Deployments,
    whose launch lists name no code partition (the planner's table hands them out) -- each shadow's command line
    names its primary's host (`--shadow-of`, as its annotation does), so the planner offers it what that host
    serves: the new partitions keep their shadows instead of rendering empty shadow hosts."""
    b = calm_body()
    b["spec"]["runtime"] = {"shadow_loaders": 1}
    first = decide(observed(b))
    st = {**first.intent, **first.status, "layout": {**first.intent["layout"], "shares": scaled_shares()}}
    deps = loader_deps(decide(observed(calm_body(st) | {"spec": b["spec"]})).desired)
    served = {p: host(d) for d in deps.values() if "mixplane.io/shadow-of" not in d["metadata"]["annotations"]
              for p in d["metadata"]["annotations"]["mixplane.io/partitions"].split(",")}
    rid = "u-1/repartition-code-1-2"
    entry = {"source": "code", "from": 1, "partitions": 2, "step": 11, "applied": True, "repartition_id": rid}
    st["repartition"] = {"state": "Pending", "repartitionId": rid, "source": "code", "from": 1, "to": 2,
                         "acceptedStep": 11}
    done = decide(observed(calm_body(st) | {"spec": b["spec"]}, loaders=deps,
                           planner=rp_planner(served, {"web": 1, "code": 2}, [entry])))
    new = loader_deps(done.desired)
    shadows = {n: d for n, d in new.items() if "mixplane.io/shadow-of" in d["metadata"]["annotations"]}
    primaries = {host(d): d for n, d in new.items() if n not in shadows}
    placed = sorted(p for d in primaries.values() for p in d["metadata"]["annotations"]["mixplane.io/partitions"].split(","))
    assert placed == ["code:0", "code:1", "web:0"] and len(shadows) == len(primaries) >= 2
    for d in shadows.values():
        of = d["metadata"]["annotations"]["mixplane.io/shadow-of"]
        args = d["spec"]["template"]["spec"]["containers"][0]["args"]
        assert of in primaries and args[args.index("--shadow-of") + 1] == of and "--shadow" in args, args
        assert not any(x.startswith("code") for x in args), args  # the table, not the launch list, names them
    code_only = [h for h, d in primaries.items()
                 if d["metadata"]["annotations"]["mixplane.io/partitions"].startswith("code")]
    assert code_only and all(any(d["metadata"]["annotations"]["mixplane.io/shadow-of"] == h for d in shadows.values())
                             for h in code_only)


def test_a_repartition_is_held_while_partitions_move_and_a_refusal_is_retried_with_backoff():
    from mixplane.operator import repartitions as rp

    first = decide(observed(calm_body()))
    st = {**first.intent, **first.status,
          "scaler": {"observedAt": 1000.0, "last": {}, "state": {"repartitions": {
              "code": {"from": 1, "to": 3, "cores": 2.1, "interval": 4}}}}}
    deps = loader_deps(first.desired)
    (old,) = [host(d) for d in deps.values()]
    st["layout"] = {**st["layout"], "shares": scaled_shares()}
    # the scaled layout wants other hosts: the old one drains, the re-partition waits for it
    moving = decide(observed(calm_body(st), loaders=deps, planner=rp_planner({"web:0": old, "code:0": old}, {"web": 1, "code": 1})))
    assert moving.draining == [old]
    assert not moving.repartition.send and "draining" in moving.repartition.state["reason"]
    # a host outside the layout (draining, or serving nothing and about to go) is never given a new partition, and
    # nothing is deleted while a re-partition is pending (the planner applies it later)
    layout = set(desired_hosts(moving.desired).values())
    t = rp_planner({"web:0": old, "code:0": old}, {"web": 1, "code": 1})
    t["hosts"].update({h: {"alive": True} for h in layout})
    assert set(rp.choose_hosts("code", 1, 3, t, layout)) <= layout
    assert rp.choose_hosts("code", 1, 3, t, set()) is None
    gone = {**t, "partitions": {"web:0": {"host": sorted(layout)[0]}, "code:0": {"host": sorted(layout)[-1]}}}
    pend = decide(observed(calm_body({**st, "repartition": moving.repartition.state}),
                           loaders={**deps, **loader_deps(moving.desired)}, planner=gone))
    assert pend.repartition.pending and pend.delete == [] and pend.draining == []
    accepted = rp.after_send(pend.repartition.state, ack={"step": 40})
    listed = {**gone, "repartitions": [{"source": "code", "from": 1, "partitions": 3, "step": 40, "applied": False,
                                        "repartition_id": accepted["repartitionId"]}]}
    held = decide(observed(calm_body({**st, "repartition": accepted}), loaders={**deps, **loader_deps(moving.desired)},
                           planner=listed))
    assert not held.repartition.send and held.delete == []  # accepted, not applied yet
    refused = rp.after_send(pend.repartition.state, error="repartition rejected: hosts: ...", refused=True, now=1000.0)
    later = decide(observed(calm_body({**st, "repartition": refused}), loaders={**deps, **loader_deps(moving.desired)},
                            planner=gone))
    assert not later.repartition.send and later.delete == list(deps)  # refused, retried later: it holds nothing
    calm = {**st, "scaler": {**st["scaler"], "state": {}}}  # nothing wanted, nothing pending: the old one goes
    done = decide(observed(calm_body(calm), loaders={**deps, **loader_deps(moving.desired)}, planner=gone))
    assert done.repartition is None and done.delete == list(deps)
    # refused by the planner with a field: Refused, retried after the backoff; "not now" stays Pending
    s = rp.after_send(moving.repartition.state, error="repartition rejected: partitions: must be ...", refused=True, now=1000.0)
    assert s["state"] == "Refused" and s["retryAt"] == 1001.0 and s["attempts"] == 1
    assert rp.condition_of(s)[:2] == (False, "RepartitionRefused")
    # accepted, then not applied at its step (the planner's entry has an error): asked again under a new id
    entry = {"source": "code", "from": 1, "partitions": 3, "step": 12, "applied": False, "error": "hosts: ...",
             "repartition_id": "u-1/repartition-code-1-3"}
    st["repartition"] = rp.after_send(moving.repartition.state, ack={"step": 12})
    b = decide(observed(calm_body(st), loaders=deps, planner=rp_planner({"web:0": old, "code:0": old},
                                                                         {"web": 1, "code": 1}, [entry])))
    assert b.repartition.state["state"] == "Refused" and b.repartition.state["repartitionId"] == "u-1/repartition-code-1-3#1"
    # sidecar placement is never re-partitioned
    side = calm_body({k: v for k, v in st.items() if k != "repartition"})
    side["spec"]["kubernetes"] = {"placement": "sidecar"}
    assert rp.plan_repartition(side, ["web", "code"], None, {"web": 1, "code": 1}, st["scaler"], 1000.0, enabled=False) is None


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_the_runtime_scaler_counts_a_partitions_worker_threads_as_the_auto_partitioner_does(workers):
    """`sources[].workers: N`: a partition transforms on N threads and does `bounds.capacity(N)` cores of work
    (autopartition.partitions_needed, the admission rule). A patch of code 0.1 -> 0.8 asks 0.8 x 30000 x 6e-5 = 1.44
    cores (x 1.05 headroom = 1.51): one single-threaded partition cannot do it (re-partitioned to 2), one with 2
    threads (1.87 cores) or 4 (3.31) can (not re-partitioned); the pods are sized past one core instead."""
    def wb(status=None, generation=1, weights=None):
        b = calm_body(status)
        b["metadata"]["generation"] = generation
        b["spec"]["sources"][1]["workers"] = workers
        if weights:
            b["spec"]["mixture"]["weights"] = weights
        return b

    first = decide(observed(wb()))
    st = {**first.intent, **first.status}
    assert {s["name"]: s["partitions"] for s in st["sources"]} == {"web": 1, "code": 1}
    now, acts = 1000.0, first
    for i in range(6):  # scaler intervals (30 s each) after the patch, with a planner that serves one partition each
        now += 30.0
        deps = loader_deps(acts.desired)
        served = {p: host(d) for d in deps.values() for p in d["metadata"]["annotations"]["mixplane.io/partitions"].split(",")}
        acts = decide(observed(wb(st, 2, scaled_shares()), loaders=deps, planner=rp_planner(served, {"web": 1, "code": 1}),
                               now=now))
        st = {**st, **acts.intent, **acts.status}
    alloc = st["scaler"]["state"]["alloc"]["code"]
    assert alloc == pytest.approx(1.44)  # scaled up to the patched demand
    wanted = st["scaler"]["state"]["repartitions"]
    code_pods = [p for p in acts.desired.pods.pods if "code" in p.sources]
    if workers == 1:
        assert wanted == {"code": {"from": 1, "to": 2, "cores": pytest.approx(1.44), "interval": wanted["code"]["interval"]}}
        assert acts.repartition is not None and acts.repartition.state["repartitionId"] == "u-1/repartition-code-1-2"
    else:
        assert wanted == {} and acts.repartition is None
        assert st["conditions"][-1]["type"] == "PartitionsApplied" and st["conditions"][-1]["status"] == "True"
        # one pod of code sized for its threads: more than a core, within what they can do
        (pod,) = code_pods
        assert 1.0 < pod.cpu <= {2: 1.87, 4: 3.31}[workers] + 1e-9


@pytest.mark.parametrize("scale_costs", [None, "measured", "profiled"])
def test_profiled_costs_are_not_corrected_by_what_the_planner_measured(scale_costs):
    """`mixplane.io/scale-costs: profiled`: the scaler sizes by the profile's costs only (its inputs are the spec, the
    profile and the declared rate: two runs decide the same whatever their machines measured); by default a source
    the planner waited for corrects its cost by what it delivered."""
    b = calm_body()
    if scale_costs is not None:
        b["metadata"]["annotations"]["mixplane.io/scale-costs"] = scale_costs
    first = decide(observed(b))
    st = {**first.intent, **first.status}
    deps = loader_deps(first.desired)
    served = {p: host(d) for d in deps.values() for p in d["metadata"]["annotations"]["mixplane.io/partitions"].split(",")}
    now = 1000.0
    for _ in range(3):  # the planner waited for code, which delivered a third of what its cores should give
        now += 30.0
        planner = {**rp_planner(served, {"web": 1, "code": 1}), "waiting": ["code/0"],
                   "source_tokens_per_s": [27000.0, 1000.0]}
        acts = decide(observed(calm_body(st) if scale_costs is None else
                               {**calm_body(st), "metadata": b["metadata"]}, loaders=deps, planner=planner, now=now))
        st = {**st, **acts.intent, **acts.status}
    cost = st["scaler"]["state"]["costs"]["code"]
    if scale_costs == "profiled":
        assert cost == 6e-5 and st["scaler"]["state"]["costs"]["web"] == 1.5e-6
    else:
        assert cost > 6e-5 * 1.5
    bad = calm_body()
    bad["metadata"]["annotations"]["mixplane.io/scale-costs"] = "guessed"
    from mixplane.operator.reconcile import ReconcileError

    with pytest.raises(ReconcileError, match="metadata.annotations.mixplane.io/scale-costs: expected measured or profiled"):
        decide(observed(bad))


@pytest.mark.parametrize("mode", ["grow", "follow"])
def test_with_repartition_follow_a_source_is_re_partitioned_to_fewer_once_demand_fell(mode):
    """`mixplane.io/repartition: follow`: code was split in 2 for its phase (0.8 -> 1.44 cores); a live update drops the
    phase (code 0.1 from now on): once the scaler's allocation fell, the pass sends REPARTITION 2 -> 1 (the rule of
    the auto-partitioner over the rest of the schedule), and once applied the layout holds one code partition while
    the spec the planner reads keeps its start split. The default (`grow`) keeps the 2 partitions."""
    from mixplane.operator import repartitions as rp

    def mb(status=None, generation=1, calm=False):
        b = body(status, generation=generation)
        if mode == "follow":
            b["metadata"]["annotations"]["mixplane.io/repartition"] = "follow"
        if calm:
            b["spec"]["mixture"]["phases"] = []
        return b

    first = decide(observed(mb()))
    st = {**first.intent, **first.status}
    assert {s["name"]: s["partitions"] for s in st["sources"]} == {"web": 1, "code": 2}
    now, acts, sent = 1000.0, first, None
    for _ in range(12):
        now += 30.0
        deps = loader_deps(acts.desired)
        served = {p: host(d) for d in deps.values() for p in d["metadata"]["annotations"]["mixplane.io/partitions"].split(",")}
        acts = decide(observed(mb(st, 2, calm=True), loaders=deps, planner=rp_planner(served, {"web": 1, "code": 2}), now=now))
        st = {**st, **acts.intent, **acts.status}
        if acts.repartition is not None and acts.repartition.send:
            sent = acts.repartition.state
            break
    assert st["scaler"]["state"]["alloc"]["code"] == pytest.approx(0.1 * 30000 * 6e-5)
    if mode == "grow":
        assert sent is None and st["scaler"]["state"]["repartitions"] == {}
        return
    rid = "u-1/repartition-code-2-1"
    assert sent is not None and rp.request_meta(sent) == {"source": "code", "partitions": 1, "repartition_id": rid,
                                                          "hosts": [served["code:0"]]}
    # accepted, then applied by the planner: acknowledged, recorded; the layout holds code:0 only
    st["repartition"] = rp.after_send(sent, ack={"step": 40})
    entry = {"source": "code", "from": 2, "partitions": 1, "step": 40, "applied": True, "repartition_id": rid}
    done = decide(observed(mb(st, 2, calm=True), loaders=deps,
                           planner=rp_planner(served, {"web": 1, "code": 1}, [entry]), now=now + 1))
    assert done.repartition.acknowledged_now and done.status["repartitions"][-1]["partitions"] == 1
    assert {s["name"]: (s["partitions"], s["startPartitions"]) for s in done.status["sources"]} == {"web": (1, 1), "code": (1, 2)}
    placed = sorted(p for d in loader_deps(done.desired).values()
                    for p in d["metadata"]["annotations"]["mixplane.io/partitions"].split(","))
    assert placed == ["code:0", "web:0"]
    spec_json = next(o for o in done.desired.objects if o["kind"] == "ConfigMap")["data"]["spec.json"]
    assert [s["replicas"] for s in json.loads(spec_json)["sources"]] == [1, 2]


WHY = ("source 'web': the run's listing (2 files, digest 0123456789abcdef) is not kept here, and the store lists other "
       "files now (3 files, digest fedcba9876543210): positions would name other samples, so the loader does not serve")


def test_degraded_says_loader_refused_before_fallback_costs_and_names_both():
    assert degraded_of([], "", None) == (False, "AsPlanned", "")
    assert degraded_of([], "", table({})) == (False, "AsPlanned", "")
    assert degraded_of(["code"], "job failed", table({})) == \
        (True, "FallbackCosts", "job failed; sources not profiled, sized by kind: code")
    planner = {**table({}), "refused_loaders": {"web/0": WHY}}
    ok, reason, msg = degraded_of([], "", planner)
    assert (ok, reason) == (True, "LoaderRefused")
    assert "web/0" in msg and WHY in msg and "exit 4" in msg and "FallbackCosts" not in msg
    ok, reason, msg = degraded_of(["code"], "", planner)  # both hold: the refusal first, the costs mentioned
    assert (ok, reason) == (True, "LoaderRefused")
    assert "FallbackCosts: sources not profiled, sized by kind: code" in msg and WHY in msg
    # garbage in the STATUS (an older or odd planner): no refusal read from it
    assert degraded_of([], "", {**table({}), "refused_loaders": ["web/0"]}) == (False, "AsPlanned", "")


def test_loader_refused_message_is_bounded_names_many_and_quotes_two():
    refused = {f"src{i:02d}/{r}": f"reason of src{i:02d}/{r}: " + "x" * 3000 for i in range(12) for r in range(2)}
    msg = loader_refused_message(refused, "FallbackCosts: " + "y" * 900)
    assert len(msg) <= MESSAGE_CHARS
    assert "src00/0, src00/1, src01/0" in msg and "src03/1 and 16 more" in msg and "src04/0" not in msg
    assert "reason of src00/0: xxx" in msg and "reason of src00/1: xxx" in msg and "reason of src01/0" not in msg
    assert "(also FallbackCosts: yyy" in msg  # before the reasons: never cut off by them
    one = loader_refused_message({"web/0": "z" * 2000})
    assert len(one) <= MESSAGE_CHARS and one.count("z") <= 500 and one.endswith("...")


def test_a_refused_loader_makes_the_mixture_degraded_and_stays_while_the_planner_is_unreachable():
    planner = {**table({}), "refused_loaders": {"web/1": WHY}}
    a = decide(observed(body(), planner=planner))
    deg = next(c for c in a.status["conditions"] if c["type"] == "Degraded")
    assert (deg["status"], deg["reason"]) == ("True", "LoaderRefused") and "web/1" in deg["message"] and WHY in deg["message"]
    assert a.status["phase"] == "Degraded"
    st = {**a.intent, **a.status}
    blind = decide(observed(body(st), planner=None, now=1001.0))  # the planner's last word stays until it answers
    deg2 = next(c for c in blind.status["conditions"] if c["type"] == "Degraded")
    assert (deg2["reason"], deg2["message"], deg2["lastTransitionTime"]) == ("LoaderRefused", deg["message"],
                                                                             deg["lastTransitionTime"])
    served = decide(observed(body({**blind.intent, **blind.status}), planner=table({}), now=1002.0))
    assert next(c for c in served.status["conditions"] if c["type"] == "Degraded")["reason"] == "AsPlanned"

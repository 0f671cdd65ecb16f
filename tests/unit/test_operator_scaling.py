"""Mixture-driven scaling (seed 001 §5.2): follows the schedule within K intervals, reclaims idle pods."""

from __future__ import annotations

import pytest

from mixplane.operator.autopartition import (
    MIB,
    LoaderBudget,
    SourceCost,
    auto_partition,
)
from mixplane.operator.scaling import (
    MixtureScaler,
    Observation,
    ScalingConfig,
    projected_shares,
)

DEMO = [(0, {"code": 0.2, "man": 0.3, "docs": 0.5}), (100, {"code": 0.6, "man": 0.3, "docs": 0.1})]
COSTS = [SourceCost("code", 1.5e-6, 48 * MIB), SourceCost("man", 1.5e-6, 32 * MIB), SourceCost("docs", 1.4e-6, 32 * MIB)]
TPS = 2_000_000.0
EVERY = 10  # steps per timer interval


def demo_scaler(**cfg):
    plan = auto_partition(COSTS, DEMO, TPS, LoaderBudget(64, 1 << 40))
    return MixtureScaler(COSTS, plan.partitions, DEMO, DEMO[0][1], TPS, config=ScalingConfig(**cfg))


def test_projection_looks_ahead_for_the_largest_share():
    assert projected_shares(DEMO, 70, 20) == DEMO[0][1]
    assert projected_shares(DEMO, 80, 20) == {"code": 0.6, "man": 0.3, "docs": 0.5}
    assert projected_shares(DEMO, 100, 20) == DEMO[1][1]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_demo_phase_change_is_followed_within_k_intervals_and_supply_never_falls_short(k):
    sc = demo_scaler(lookahead_steps=20, window=3, consecutive=k)
    up_at = down_at = None
    for i in range(1, 25):
        step = i * EVERY
        for d in sc.observe(Observation(step=step, tokens_per_s=TPS)):
            if d.source == "code" and d.direction == "up":
                up_at = step
            if d.source == "docs" and d.direction == "down":
                down_at = step
        shares = DEMO[1][1] if step >= 100 else DEMO[0][1]
        supply = sc.supply_tokens_per_s()
        for name, share in shares.items():  # capacity arrives before the phase and leaves after it
            assert supply[name] >= share * TPS * (1 - 1e-9), (step, name)
    # the lookahead first sees the phase at step 80; K crossings later code has its cores
    assert up_at is not None and up_at <= 80 + (k - 1) * EVERY
    assert down_at is not None and 100 <= down_at <= 100 + (k - 1) * EVERY + EVERY
    alloc = sc.allocated_cores()
    assert alloc["code"] == pytest.approx(0.6 * TPS * 1.5e-6)
    assert alloc["docs"] == pytest.approx(0.1 * TPS * 1.4e-6)
    assert [d.source for d in sc.decisions].count("man") == 0  # a source whose weight holds is left alone


def test_no_decision_before_k_consecutive_crossings():
    sc = demo_scaler(lookahead_steps=0, window=1, consecutive=3)
    assert sc.observe(Observation(100, TPS)) == []
    assert sc.observe(Observation(110, TPS)) == []
    got = sc.observe(Observation(120, TPS))
    assert {(d.source, d.direction) for d in got} == {("code", "up"), ("docs", "down")}


def test_a_source_going_to_zero_has_its_pods_reclaimed():
    sched = [(0, {"a": 0.5, "b": 0.5}), (50, {"a": 1.0, "b": 0.0})]
    costs = [SourceCost("a", 1e-5, 10 * MIB), SourceCost("b", 1e-5, 10 * MIB)]
    plan = auto_partition(costs, sched, 300_000, LoaderBudget(64, 1 << 40))
    assert plan.partitions["b"] == 2
    sc = MixtureScaler(costs, plan.partitions, sched, sched[0][1], 300_000, config=ScalingConfig(lookahead_steps=0, window=1, consecutive=2))
    before = sc.plan.pods_of("b")
    assert sum(p.cpu for p in before) >= 0.5 * 300_000 * 1e-5
    for step in (50, 60):
        sc.observe(Observation(step, 300_000))
    after = sc.plan.pods_of("b")
    assert sc.allocated_cores()["b"] == 0.0
    assert all(p.idle for p in after) and len(after) <= len(before)  # run with 0 replicas
    assert sc.plan.source_cpu()["b"] == 0.0 and sc.plan.cpu < sum(p.cpu for p in sc.plan.pods)
    assert sorted(m for p in sc.plan.pods for m in p.members if m[0] == "b") == [("b", r) for r in range(plan.partitions["b"])]


def test_a_saturated_source_corrects_its_cost_and_scales_up():
    costs = [SourceCost("a", 1e-6, 10 * MIB)]
    sc = MixtureScaler(costs, {"a": 2}, [(0, {"a": 1.0})], {"a": 1.0}, 500_000, config=ScalingConfig(consecutive=2))
    cores = sum(p.cpu for p in sc.plan.pods)
    # the planner waited for `a`, which delivered only half of what the profile promised per core
    delivered = cores / 2e-6
    d = sc.observe(Observation(10, 500_000, frozenset({"a"}), {"a": delivered}))
    assert sc.costs["a"].cpu_s_per_token > 1e-6
    assert [x.direction for x in d] == ["up"]
    assert sum(p.cpu for p in sc.plan.pods) > cores


def test_a_patched_schedule_is_followed():
    sc = demo_scaler(lookahead_steps=0, window=1, consecutive=1)
    sc.set_schedule([(0, DEMO[0][1]), (30, {"code": 0.1, "man": 0.1, "docs": 0.8})])
    d = sc.observe(Observation(30, TPS))
    assert {(x.source, x.direction) for x in d} == {("docs", "up"), ("code", "down"), ("man", "down")}


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="consecutive"):
        ScalingConfig(consecutive=0)


def test_handoff_moves_go_to_live_target_hosts_and_old_hosts_drain():
    from mixplane.operator.scaling import handoff_moves

    table = {"partitions": {"a:0": {"host": "loaders-a-0+1"}, "a:1": {"host": "loaders-a-0+1"}, "b:0": {"host": "loader-b-0"}},
             "hosts": {"loaders-a-0+1": {"alive": True}, "loader-a-0": {"alive": True}, "loader-a-1": {"alive": False},
                       "loader-b-0": {"alive": True}}}
    want = {"a:0": "loader-a-0", "a:1": "loader-a-1", "b:0": "loader-b-0"}
    moves, draining = handoff_moves(want, table)
    assert moves == [("a:0", "loader-a-0")]  # loader-a-1 is not up yet: a:1 waits, b:0 is where it should be
    assert draining == {"loaders-a-0+1"}  # still serves a:1 (and a:0 until the move lands): its pod stays
    table["partitions"] = {"a:0": {"host": "loader-a-0"}, "a:1": {"host": "loader-a-1"}, "b:0": {"host": "loader-b-0"}}
    assert handoff_moves(want, table) == ([], set())


def test_a_source_needing_more_cores_than_its_partitions_can_use_is_wanted_repartitioned():
    """One partition is one single-threaded loader process (pod_cpu = 1 core): an allocation of 2.4 cores cannot be
    read by 1 partition, whatever the pods. The scaler wants ceil(2.4 x 1.05) = 3 partitions, keeps that wish in its
    state (status.scaler) until the planner acknowledges it, then packs the new partitions into pods of <= 1 core."""
    costs = [SourceCost("code", 1.5e-6, 48 * MIB), SourceCost("docs", 1.4e-6, 32 * MIB)]
    sched = [(0, {"code": 0.2, "docs": 0.8}), (50, {"code": 0.8, "docs": 0.2})]
    sc = MixtureScaler(costs, {"code": 1, "docs": 3}, sched, sched[0][1], TPS,
                       config=ScalingConfig(lookahead_steps=0, window=1, consecutive=1))
    assert sc.observe(Observation(step=10, tokens_per_s=TPS)) == [] and sc.wanted_repartitions() == []
    sc.observe(Observation(step=60, tokens_per_s=TPS))  # code: 0.8 x 2e6 x 1.5e-6 = 2.4 cores
    assert sc.allocated_cores()["code"] == pytest.approx(2.4)
    (w,) = sc.wanted_repartitions()
    assert (w.source, w.from_partitions, w.to_partitions, w.interval) == ("code", 1, 3, 2)
    assert max(p.cpu for p in sc.plan.pods if any(s == "code" for s, _ in p.members)) > 1.0  # one pod cannot use it
    # the wish survives an operator restart (status.scaler) and is not repeated with a new interval
    state = sc.state_dict()
    again = MixtureScaler(costs, {"code": 1, "docs": 3}, sched, sched[0][1], TPS,
                          config=ScalingConfig(lookahead_steps=0, window=1, consecutive=1))
    again.load_state_dict(state)
    assert again.wanted_repartitions() == [w]
    again.observe(Observation(step=70, tokens_per_s=TPS))
    assert again.wanted_repartitions() == [w]
    # acknowledged: 3 partitions, every pod of code within one core, nothing wanted any more (also after a restart)
    again.repartitioned("code", 3)
    assert again.wanted_repartitions() == [] and again.partitions["code"] == 3
    code_pods = [p for p in again.plan.pods if any(s == "code" for s, _ in p.members)]
    assert sorted(r for p in code_pods for s, r in p.members if s == "code") == [0, 1, 2]
    assert all(p.cpu <= 1.0 + 1e-9 for p in code_pods)
    third = MixtureScaler(costs, {"code": 1, "docs": 3}, sched, sched[0][1], TPS)
    third.load_state_dict(again.state_dict())
    assert third.partitions["code"] == 3 and third.wanted_repartitions() == []
    with pytest.raises(ValueError, match="no source 'web'"):
        again.repartitioned("web", 2)


def test_a_source_short_of_partitions_is_not_taken_for_a_costlier_one():
    """A source allocated more cores than its partitions can use (1 partition = 1 process = 1 core at most) delivers
    what its process can: that measurement says nothing about its cost. Taken as cost (allocated cores / delivered)
    it would raise the allocation, then the cost again, without end; the correction uses the cores the partitions
    can use, so the cost and the re-partition wanted stay."""
    costs = [SourceCost("code", 6e-5, 40 * MIB)]
    sc = MixtureScaler(costs, {"code": 1}, [(0, {"code": 0.8})], {"code": 0.8}, 30_000,
                       config=ScalingConfig(lookahead_steps=0, window=1, consecutive=1))
    assert sc.allocated_cores()["code"] == pytest.approx(1.44)
    sc.observe(Observation(step=1, tokens_per_s=30_000))
    (w,) = sc.wanted_repartitions()
    assert w.to_partitions == 2
    for step in range(2, 12):  # saturated: the one process delivers one core's worth, the planner waits for it
        sc.observe(Observation(step, 30_000, frozenset({"code"}), {"code": 1.0 / 6e-5}))
    assert sc.costs["code"].cpu_s_per_token == pytest.approx(6e-5)
    assert sc.allocated_cores()["code"] == pytest.approx(1.44) and sc.wanted_repartitions() == [w]


def test_the_scaler_re_partitions_where_the_auto_partitioner_would_have_partitioned():
    """One rule (autopartition.partitions_needed over bounds.capacity(workers)): for any demand and any worker count,
    the partitions the runtime scaler wants for an allocation are those the admission-time auto-partitioner plans for
    the same demand as a peak. A source with 4 worker threads a partition is not re-partitioned where 1 is."""
    from mixplane.operator.autopartition import PartitionBounds, partition_layout, partitions_needed
    from mixplane.operator.scaling import partitions_for

    bounds = PartitionBounds()
    cost = SourceCost("code", 1.5e-6, 48 * MIB)
    for workers in (1, 2, 3, 4, 6):
        for share in (0.05, 0.3, 0.31, 0.5, 0.8, 1.0, 2.0, 4.0):
            cores = share * TPS * cost.cpu_s_per_token
            layout = partition_layout([cost], {"code": share}, TPS, bounds, {"code": workers})
            assert partitions_for(cores, cost, bounds, workers) == layout["code"][0] == partitions_needed(cores, workers, bounds)
    assert [partitions_needed(2.4, w, bounds) for w in (1, 2, 3, 4, 5)] == [3, 2, 1, 1, 1]  # 2.52 / 1, 1.87, 2.64, 3.31
    # the scaler: code allocated 2.4 cores in one partition
    sched = [(0, {"code": 0.2, "docs": 0.8}), (50, {"code": 0.8, "docs": 0.2})]
    costs = [cost, SourceCost("docs", 1.4e-6, 32 * MIB)]
    wanted = {}
    for workers in (1, 2, 4):
        sc = MixtureScaler(costs, {"code": 1, "docs": 3}, sched, sched[0][1], TPS, workers={"code": workers},
                           config=ScalingConfig(lookahead_steps=0, window=1, consecutive=1))
        sc.observe(Observation(step=60, tokens_per_s=TPS))
        assert sc.allocated_cores()["code"] == pytest.approx(2.4)
        wanted[workers] = [(w.source, w.to_partitions) for w in sc.wanted_repartitions()]
        code_cpu = sum(p.cpu for p in sc.plan.pods if "code" in p.sources)
        assert code_cpu == pytest.approx(2.52, abs=0.02)  # the pods are sized for the demand either way
    assert wanted == {1: [("code", 3)], 2: [("code", 2)], 4: []}
    # a saturated source's cost is corrected by the work its partitions' threads can do (3.31 cores with 4), not by
    # one core a partition: 4 threads delivering 2 cores' worth of 2.52 allocated are a costlier source (2.52 / 2.0)
    for delivered_cores, costlier in ((2.0, True), (2.52, False)):
        sat = MixtureScaler(costs, {"code": 1, "docs": 3}, sched, sched[1][1], TPS, workers={"code": 4},
                            config=ScalingConfig(lookahead_steps=0, window=1, consecutive=1))
        code_cpu = sum(p.cpu for p in sat.plan.pods if "code" in p.sources)
        assert code_cpu == pytest.approx(2.52, abs=0.02)
        sat.observe(Observation(60, TPS, frozenset({"code"}), {"code": delivered_cores / 1.5e-6}))
        # (the EMA: half the old cost, half the measured one: the pods' cores / what they delivered)
        after = 1.5e-6 * (0.5 + 0.5 * code_cpu / delivered_cores) if costlier else 1.5e-6
        assert sat.costs["code"].cpu_s_per_token == pytest.approx(after, rel=0.01)


def test_partitions_shrink_only_when_asked_and_only_to_what_the_rest_of_the_schedule_needs():
    """ScalingConfig.shrink (`mixplane.io/repartition: follow`): when demand falls, a source is wanted re-partitioned to
    fewer partitions by the same rule (partitions_needed) over the larger of its allocation and the largest share the
    rest of the schedule gives it -- not while a later phase needs them again, and not before the allocation fell
    (K intervals). Without it (the default) partitions never shrink."""
    costs = [SourceCost("code", 6e-5, 40 * MIB), SourceCost("web", 1.5e-6, 40 * MIB)]
    busy, calm = {"code": 0.8, "web": 0.2}, {"code": 0.1, "web": 0.9}
    cfg = dict(lookahead_steps=0, window=1, consecutive=2)

    def run(shrink, schedule, steps):
        sc = MixtureScaler(costs, {"code": 2, "web": 1}, [(0, busy)], busy, 30_000,
                           config=ScalingConfig(**cfg, shrink=shrink))
        assert sc.allocated_cores()["code"] == pytest.approx(1.44)
        sc.observe(Observation(1, 30_000))
        assert sc.wanted_repartitions() == []  # 1.44 x 1.05 cores need the 2 partitions it has
        sc.set_schedule(schedule)  # a live update lowers code's weight
        seen = []
        for step in steps:
            sc.observe(Observation(step, 30_000))
            seen.append([(w.source, w.from_partitions, w.to_partitions) for w in sc.wanted_repartitions()])
        return sc, seen

    # calm from now on: the allocation falls after K = 2 intervals, then code is wanted in 1 partition
    sc, seen = run(True, [(0, calm)], [2, 3, 4])
    assert seen == [[], [("code", 2, 1)], [("code", 2, 1)]]
    assert sc.allocated_cores()["code"] == pytest.approx(0.18)
    sc.repartitioned("code", 1)  # applied: nothing wanted any more, the pods packed for one partition
    assert sc.wanted_repartitions() == [] and sc.partitions["code"] == 1
    assert sorted(r for p in sc.plan.pods for s, r in p.members if s == "code") == [0]
    sc.observe(Observation(5, 30_000))
    assert sc.wanted_repartitions() == []
    # the default: never fewer
    _, seen = run(False, [(0, calm)], [2, 3, 4, 5])
    assert seen == [[], [], [], []]
    # a later phase of the schedule gives code 0.8 again: its 2 partitions stay through the calm segment
    _, seen = run(True, [(0, calm), (40, busy)], [2, 3, 4, 20, 39])
    assert seen == [[]] * 5
    # ... and once past that phase, with calm after it, they go
    _, seen = run(True, [(0, calm), (10, busy), (20, calm)], [21, 22, 23])
    assert seen == [[], [("code", 2, 1)], [("code", 2, 1)]]
    # a share between: 0.5 x 30000 x 6e-5 = 0.9 cores x 1.05 still needs 1 partition; 0.6 (1.08 -> 1.13) needs 2
    for share, want in ((0.5, [("code", 2, 1)]), (0.6, [])):
        _, seen = run(True, [(0, {"code": share, "web": 1 - share})], [2, 3, 4])
        assert seen[-1] == want, (share, seen)

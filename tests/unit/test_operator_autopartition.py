"""Source auto-partitioning (seed 001 §5.1): partitions per source, pods, resources, within the bounds."""

from __future__ import annotations

import math

import pytest

from mixplane.operator.autopartition import (
    MIB,
    LoaderBudget,
    PartitionBounds,
    PartitionError,
    SourceCost,
    auto_partition,
    idle_fraction,
    spec_schedule,
    with_partitions,
)
from mixplane.spec import parse_spec

BIG = LoaderBudget(cpu=1000.0, memory=1 << 40)


def demand_cores(plan, step, schedule):
    shares = dict(schedule)[max(s for s, _ in schedule if s <= step)]
    return sum(shares.get(c.name, 0.0) * plan.tokens_per_s * c.cpu_s_per_token for c in plan.costs.values())


def assert_covers(plan, schedule, steps, max_idle=0.10):
    for step in steps:
        shares = dict(schedule)[max(s for s, _ in schedule if s <= step)]
        supply = plan.supply_tokens_per_s(step)
        for name, share in shares.items():
            assert supply[name] >= share * plan.tokens_per_s * (1 - 1e-9), (step, name)
        assert idle_fraction(plan.pods_at(step), demand_cores(plan, step, schedule)) <= max_idle, step


def test_expensive_sources_get_more_partitions_and_their_own_pods():
    text = SourceCost("text", 2e-6, 64 * MIB)
    image = SourceCost("image", 3e-4, 512 * MIB)
    schedule = [(0, {"text": 0.7, "image": 0.3}), (500, {"text": 0.4, "image": 0.6})]
    plan = auto_partition([text, image], schedule, 20_000, BIG)
    # image peak: 0.6 x 20k x 3e-4 = 3.6 cores -> x1.05 -> 4 partitions of <= 1 core; text: 0.028 cores -> 1
    assert plan.partitions == {"text": 1, "image": 4}
    for _, pods in plan.segments:
        for pod in pods.pods:
            assert pod.cpu <= 1.0 + 1e-9
            assert pod.cpu >= pod.demand_cpu
            assert pod.memory == pod.memory // MIB * MIB >= 256 * MIB
            assert len(pod.sources) == 1  # the image source is big: dedicated pods
        hosted = sorted(m for p in pods.pods for m in p.members)
        assert hosted == sorted([("text", 0)] + [("image", r) for r in range(4)])  # every partition exactly once
    assert plan.pods_at(499).cpu < plan.pods_at(500).cpu  # fewer cores while images are 30 %
    assert_covers(plan, schedule, [0, 250, 499, 500, 10_000])


def test_hundreds_of_small_sources_share_pods_within_w_actor():
    costs = [SourceCost(f"s{i:03d}", 1e-6, 8 * MIB) for i in range(300)]
    shares = {c.name: 1 / 300 for c in costs}
    bounds = PartitionBounds(max_per_pod=32)
    plan = auto_partition(costs, [(0, shares)], 50_000, BIG, bounds)
    pods = plan.pods_at(0).pods
    assert all(n == 1 for n in plan.partitions.values())
    assert all(len(p.members) <= 32 for p in pods)
    assert len(pods) == math.ceil(300 / 32)  # CPU is tiny: w_actor decides
    assert sorted(m for p in pods for m in p.members) == sorted((c.name, 0) for c in costs)
    names = [p.name for p in pods]
    assert len(set(names)) == len(names)


def test_w_src_and_data_parallel_bounds_are_errors_naming_the_source():
    image = SourceCost("image", 1e-3, 64 * MIB)
    with pytest.raises(PartitionError, match=r"source image: needs 21\.00 cores.* 8 partitions"):
        auto_partition([image], [(0, {"image": 1.0})], 20_000, BIG, PartitionBounds(max_per_source=8))
    few_pages = SourceCost("image", 1e-3, 64 * MIB, max_partitions=3)
    with pytest.raises(PartitionError, match="data-parallel bound 3"):
        auto_partition([few_pages], [(0, {"image": 1.0})], 20_000, BIG)


def test_tight_memory_mixes_sources_into_fewer_pods_or_says_what_is_missing():
    costs = [SourceCost("a", 4e-5, 100 * MIB), SourceCost("b", 4e-5, 100 * MIB), SourceCost("c", 4e-5, 100 * MIB)]
    schedule = [(0, {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3})]  # 0.27 cores each: big enough for own pods by default
    bounds = PartitionBounds(small_source_cpu=0.2)
    roomy = auto_partition(costs, schedule, 20_000, BIG, bounds)
    assert len(roomy.pods_at(0).pods) == 3
    need = roomy.pods_at(0).memory
    tight = auto_partition(costs, schedule, 20_000, LoaderBudget(cpu=100, memory=need - 1), bounds)
    assert tight.pods_at(0).memory <= need - 1
    assert len(tight.pods_at(0).pods) < 3
    assert_covers(tight, schedule, [0])
    with pytest.raises(PartitionError, match=r"MiB.*budget 300 MiB"):
        auto_partition(costs, schedule, 20_000, LoaderBudget(cpu=100, memory=300 * MIB), bounds)


def test_cpu_budget_too_small_is_an_error_naming_the_segment():
    costs = [SourceCost("a", 1e-4, 10 * MIB), SourceCost("b", 1e-4, 10 * MIB)]
    with pytest.raises(PartitionError, match=r"segment at step 40: loaders need .* cores, budget 2 cores"):
        auto_partition(costs, [(0, {"a": 0.1, "b": 0.4}), (40, {"a": 1.0, "b": 0.0})], 20_000, LoaderBudget(2, 1 << 40),
                       PartitionBounds(max_per_pod=1))


def test_bad_inputs_are_clear():
    with pytest.raises(PartitionError, match="cpu_s_per_token"):
        SourceCost("a", float("nan"), 1)
    with pytest.raises(PartitionError, match="unknown source"):
        auto_partition([SourceCost("a", 1e-6, 1)], [(0, {"zz": 1.0})], 1000, BIG)
    with pytest.raises(PartitionError, match="tokens_per_s"):
        auto_partition([SourceCost("a", 1e-6, 1)], [(0, {"a": 1.0})], 0, BIG)


def test_spec_schedule_follows_phases_and_replicas_are_written_back():
    spec = parse_spec({
        "name": "m", "sources": [{"name": "a", "uri": "/x", "kind": "tokens", "columns": ["t"]},
                                 {"name": "b", "uri": "/y", "kind": "tokens", "columns": ["t"]}],
        "mixture": {"weights": {"a": 1, "b": 3}, "phases": [{"start_step": 50, "weights": {"a": 3}}]},
        "batch": {"sequences": 4, "seq_len": 16},
    })
    sched = spec_schedule(spec)
    assert [s for s, _ in sched] == [0, 50]
    assert sched[0][1] == pytest.approx({"a": 0.25, "b": 0.75})
    assert sched[1][1] == pytest.approx({"a": 0.5, "b": 0.5})
    out = with_partitions(spec, {"a": 3})
    assert [s.replicas for s in out.sources] == [3, 1]

"""The auto-partitioner with multi-core loaders (sources[].workers, loader/workers.py): cores per partition as well
as partitions per source; `auto` sources get threads instead of extra partitions, their pods' CPU follows."""

from __future__ import annotations

import pytest

from mixplane.operator.autopartition import (
    MIB,
    LoaderBudget,
    PartitionBounds,
    PartitionError,
    SourceCost,
    auto_partition,
    partition_layout,
    with_partitions,
)
from mixplane.operator.reconcile import desired
from mixplane.spec import parse_spec
from tests.unit.test_operator_reconcile import KEYS, OPTS, PROFILE, body

BIG = LoaderBudget(cpu=1000.0, memory=1 << 40)
IMAGE = SourceCost("image", 3e-4, 512 * MIB)  # 0.6 x 20k tokens/s x 300 us = 3.6 cores at its peak
TEXT = SourceCost("text", 2e-6, 64 * MIB)
SCHEDULE = [(0, {"text": 0.7, "image": 0.3}), (500, {"text": 0.4, "image": 0.6})]


def covers(plan) -> None:
    for step in (0, 499, 500, 9999):
        shares = dict(SCHEDULE)[0 if step < 500 else 500]
        supply = plan.supply_tokens_per_s(step)
        for name, share in shares.items():
            assert supply[name] >= share * plan.tokens_per_s * (1 - 1e-9), (step, name)


def test_one_worker_keeps_the_single_thread_plan():
    plan = auto_partition([TEXT, IMAGE], SCHEDULE, 20_000, BIG)
    assert dict(plan.partitions) == {"text": 1, "image": 4} and dict(plan.workers) == {"text": 1, "image": 1}
    assert all(p.cpu <= 1.0 + 1e-9 for _, pods in plan.segments for p in pods.pods)


def test_auto_workers_trade_partitions_for_threads_and_the_pods_cpu_follows():
    b = PartitionBounds()
    plan = auto_partition([TEXT, IMAGE], SCHEDULE, 20_000, BIG, workers={"text": "auto", "image": "auto"})
    # 3.6 x 1.05 = 3.78 cores: 2 partitions at max_workers (3.31 each), then the fewest threads serving 1.89 each: 3
    assert dict(plan.partitions) == {"text": 1, "image": 2}
    assert dict(plan.workers) == {"text": 1, "image": 3}
    peak = plan.pods_at(500)
    image_pods = peak.pods_of("image")
    assert len(image_pods) == 2 and all(len(p.members) == 1 for p in image_pods)
    for p in image_pods:
        assert 1.0 < p.cpu <= b.capacity(3) + 1e-9  # one partition doing 1.89 cores on its 3 threads
    covers(plan)


def test_a_fixed_worker_count_is_kept_and_sizes_the_partitions():
    plan = auto_partition([TEXT, IMAGE], SCHEDULE, 20_000, BIG, workers={"image": 2})
    assert dict(plan.partitions) == {"text": 1, "image": 3}  # 3.78 / 1.87 -> 3
    assert dict(plan.workers) == {"text": 1, "image": 2}
    covers(plan)


def test_a_kept_split_gets_the_fewest_threads_that_serve_it():
    plan = auto_partition([TEXT, IMAGE], SCHEDULE, 20_000, BIG, partitions={"text": 1, "image": 3},
                          workers={"image": "auto"})
    assert dict(plan.partitions) == {"text": 1, "image": 3}
    assert plan.workers["image"] == 2  # 1.26 cores a partition: 1 thread does 1.0, 2 do 1.87
    covers(plan)


def test_layout_bounds_and_errors_name_the_source():
    assert partition_layout([TEXT], {"text": 0.5}, 20_000, PartitionBounds(), {"text": "auto"}) == {"text": (1, 1)}
    with pytest.raises(PartitionError, match=r"source image: needs 3.78 cores .* more than 1 partitions x 3.31 cores .*4 worker"):
        partition_layout([SourceCost("image", 3e-4, MIB, max_partitions=1)], {"image": 0.6}, 20_000, PartitionBounds(),
                         {"image": "auto"})
    with pytest.raises(PartitionError, match="max_workers must be >= 1"):
        PartitionBounds(max_workers=0)
    with pytest.raises(PartitionError, match="worker_speedup must start at 1.0 and never decrease"):
        PartitionBounds(worker_speedup=(1.0, 2.0, 1.5))
    assert PartitionBounds().capacity(9) == PartitionBounds().capacity(4)  # flat past the measured counts


def test_the_resolved_spec_carries_the_planned_threads(token_sources):
    from tests.conftest import token_mixture

    doc = token_mixture(token_sources["root"])
    doc["sources"][0]["workers"] = "auto"
    doc["sources"][1]["workers"] = 2
    spec = parse_spec(doc)
    out = with_partitions(spec, {"a": 2, "b": 1, "c": 1}, {"a": 3, "b": 1, "c": 1})
    assert [(s.replicas, s.workers) for s in out.sources] == [(2, 3), (1, 2), (1, 1)]


def test_an_operator_mixture_with_auto_workers_runs_threaded_loader_pods():
    b = body()
    b["spec"]["sources"][1]["workers"] = "auto"
    d = desired(b, OPTS, PROFILE, KEYS, step=120)
    # pairs from step 100: 1.2 cores x 1.05 = 1.26: one partition on 2 threads (1.87) instead of 2 partitions
    assert dict(d.plan.partitions) == {"text": 1, "pairs": 1} and d.plan.workers["pairs"] == 2
    assert [s.workers for s in d.spec.sources] == [1, 2]  # the resolved spec the loaders read
    (pod,) = [p for p in d.pods.pods if "pairs" in p.sources]
    assert pod.cpu == pytest.approx(1.26)  # its CPU request follows the two threads' work
    deps = [o for o in d.objects if o["kind"] == "Deployment" and "pairs" in o["metadata"]["name"]]
    assert deps, [o["metadata"]["name"] for o in d.objects]
    cpu = deps[0]["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"]
    assert cpu in ("1260m", "1.26"), cpu

"""A source re-partitioned at a step boundary in the planner (StepPlanner.repartition), with its windows filled by
the loaders' own code over real Parquet sources (replay.ReplayLoaders, the new partitions opened with their
mixplane.repartition layouts): nothing of an epoch delivered twice or skipped, the run deterministic, the
journal replayed bit-exact across the change, a cursor taken after it resumes exactly, bad requests named."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest

from mixplane.layout import layout_digest
from mixplane.planner.core import StepPlanner
from mixplane.planner.journal import Journal, read_journal, replan
from mixplane.planner.strategies import resolve_strategy
from mixplane.repartition import RepartitionError
from mixplane.replay import ReplayLoaders
from mixplane.samples import key_epoch, key_row
from mixplane.spec import parse_spec
from tests.conftest import write_token_source

ROWS_A = 240


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    root = tmp_path_factory.mktemp("rpp")
    write_token_source(root / "a", rows=ROWS_A, files=2, mean_len=40, seed=1, rows_per_group=20)
    write_token_source(root / "b", rows=2000, files=1, mean_len=60, seed=2)
    doc = {"name": "rp", "sources": [
        {"name": "a", "uri": str(root / "a"), "kind": "tokens", "columns": ["tokens"], "shuffle": "page",
         "replicas": 2},
        {"name": "b", "uri": str(root / "b"), "kind": "tokens", "columns": ["tokens"], "shuffle": "rowgroup"}],
        "mixture": {"weights": {"a": 0.6, "b": 0.4}, "seed": 5},
        "batch": {"sequences": 4, "seq_len": 128, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": 2}}}, "strategy": {"name": "vanilla"},
        "runtime": {"window": 16, "metrics": False}}
    return parse_spec(doc)


def _run(spec, steps, at, partitions, journal=None, loaders=None):
    """Plan steps 0..steps-1, re-partitioning source a into `partitions` before step `at`."""
    p = StepPlanner(spec, resolve_strategy(spec))
    fill = loaders or ReplayLoaders()
    plans, cursors, record = {}, {}, None
    if journal is not None:
        journal.open(spec, 0, p.cursor())
    for s in range(steps):
        if s == at:
            record = p.repartition(0, partitions)
            if journal is not None:
                journal.repartition(record)
        fill(p)
        plan = p.plan()
        plans[s] = plan
        cursors[s + 1] = p.cursor()
        if journal is not None:
            journal.step(plan)
    return p, plans, cursors, record


def _same(a, b):
    assert layout_digest(a.layout) == layout_digest(b.layout), a.layout.step
    for f in ("source", "key", "start", "length", "replica", "pos"):
        assert np.array_equal(getattr(a.pieces, f), getattr(b.pieces, f)), (a.layout.step, f)


@pytest.mark.parametrize("at,partitions", [(3, 4), (7, 1), (5, 3)])
def test_nothing_of_an_epoch_is_delivered_twice_or_skipped(spec, tmp_path, at, partitions):
    steps = 70
    with Journal(tmp_path / "journal.jsonl", every=4) as j:
        p, plans, cursors, record = _run(spec, steps, at, partitions, journal=j)
    assert record["from"] == 2 and record["partitions"] == partitions and record["step"] == at
    assert [w.replica for w in p.windows if w.source == 0] == list(range(partitions))
    assert p.partitions(0) == partitions and "partitioning" in cursors[at + 1] and "partitioning" not in cursors[at]
    # every token of every document of source a at most once; every document of an epoch started once
    spans = defaultdict(list)
    replicas_after = set()
    for s, plan in plans.items():
        pc = plan.pieces
        for src, key, start, ln, rep in zip(pc.source.tolist(), pc.key.tolist(), pc.start.tolist(), pc.length.tolist(),
                                            pc.replica.tolist()):
            if src == 0:
                spans[key].append((start, start + ln))
                if s >= at:
                    replicas_after.add(rep)
    assert replicas_after == set(range(partitions))  # every new partition delivers
    for key, sp in spans.items():
        sp.sort()
        assert sp[0][0] == 0, f"document {key} delivered from token {sp[0][0]}"
        for (a0, a1), (b0, b1) in zip(sp, sp[1:]):
            assert b0 == a1, f"document {key}: tokens [{a0}, {a1}) then [{b0}, {b1}) (repeat or gap)"
    keys = np.array(sorted(spans), np.int64)
    ep, row = key_epoch(keys), key_row(keys)
    top = int(ep.max())
    assert top >= 1, "the run did not get past the first epoch"
    for e in range(top):  # every finished epoch: each row exactly once (a key is one (epoch, row))
        assert sorted(row[ep == e].tolist()) == list(range(ROWS_A)), f"epoch {e}"

    # the same run again: the same plans (a pure function of spec, seed, files and the recorded re-partition)
    _, again, _, record2 = _run(spec, steps, at, partitions)
    assert record2 == record
    for s in plans:
        _same(plans[s], again[s])

    # the journal replays every step bit-exact, across the change, from anchors before and after it
    recs = read_journal(tmp_path / "journal.jsonl")
    assert [r["step"] for r in recs if r["event"] == "repartition"] == [at]
    fill = ReplayLoaders()
    for s in sorted({0, max(at - 1, 0), at, at + 1, at + 5, steps - 1}):
        _same(plans[s], replan(tmp_path / "journal.jsonl", s, fill))

    # a trainer's state after the change (the cursor before step at + 6) resumes exactly on a fresh planner
    fresh = StepPlanner(spec, resolve_strategy(spec))
    fresh.restore(cursors[at + 6])
    assert fresh.partitions(0) == partitions
    fill = ReplayLoaders()
    for s in range(at + 6, at + 16):
        fill(fresh)
        _same(plans[s], fresh.plan())
    # ... and one from before it rewinds to the old partitions (the re-partition is not in that cursor)
    fresh.restore(cursors[at])
    assert fresh.partitions(0) == 2 and not fresh.partitioning
    fill(fresh)
    before = fresh.plan()
    assert before.layout.step == at
    assert set(before.pieces.replica[before.pieces.source == 0].tolist()) <= {0, 1}


def test_a_second_re_partition_and_bad_requests(spec, tmp_path):
    p = StepPlanner(spec, resolve_strategy(spec))
    fill = ReplayLoaders()
    for _ in range(4):
        fill(p)
        p.plan()
    with pytest.raises(RepartitionError, match=r"partitions must be in \[1, 1024\], not 0"):
        p.repartition(0, 0)
    with pytest.raises(RepartitionError, match="already has 2 partitions"):
        p.repartition(0, 2)
    with pytest.raises(RepartitionError, match="no source 5"):
        p.repartition(5, 2)
    assert p.partitions(0) == 2 and not p.partitioning  # nothing changed
    p.repartition(0, 3)
    for _ in range(6):
        fill(p)
        p.plan()
    rec = p.repartition(0, 2)
    assert rec["from"] == 3 and p.partitions(0) == 2 and len(p.partitioning[0]) == 2
    for _ in range(6):
        fill(p)
        p.plan()
    cur = p.cursor()
    q = StepPlanner(spec, resolve_strategy(spec))
    q.restore(cur)
    assert q.partitioning == p.partitioning
    bad = dict(cur, partitioning={"0": [dict(cur["partitioning"]["0"][0], **{"from": 5})]})
    with pytest.raises(ValueError, match="re-partitions from 5 partitions, the source has 2"):
        q.restore(bad)
    with pytest.raises(RepartitionError, match="recorded at step 3"):
        q.apply_repartition(dict(p.partitioning[0][0], step=3))  # from 2 to 3, but the planner is past step 3


def test_the_partition_table_takes_the_new_partitions_under_new_epochs():
    from mixplane.planner.partitions import HandoffError, Host, PartitionTable

    t = PartitionTable([(0, 0), (0, 1), (1, 0)])
    for h, wants in (("h0", ((0, 0),)), ("h1", ((0, 1),)), ("h2", ((1, 0),)), ("new", ())):
        t.register(Host(h, wants), lambda _: True)
    with pytest.raises(HandoffError, match="no loader host 'nope'"):
        t.repartition(0, 2, ["h0", "nope", "new"])
    assert set(t.parts) == {(0, 0), (0, 1), (1, 0)}  # nothing changed
    moves = t.repartition(0, 2, ["h0", "h1", "new"])
    assert [(m.key, m.to, m.epoch, m.previous) for m in moves] == [((0, 0), "h0", 2, "h0"), ((0, 1), "h1", 2, "h1"),
                                                                   ((0, 2), "new", 1, None)]
    assert t.claim((0, 0), "h0", 2) and not t.claim((0, 0), "h0", 1)  # the old partition's server is fenced
    moves = t.repartition(0, 3, ["new"])
    assert set(t.parts) == {(0, 0), (1, 0)} and moves[0].epoch == 3 and t.hosted_by("h1") == []


def test_a_repartition_request_with_an_id_is_applied_once(spec):
    """REPARTITION with `repartition_id` (the operator's): a repeat, pending or applied, is answered with the first
    acceptance and `duplicate`, nothing else changes; another request for the source while one is pending, or a
    repeat without the id after it was applied, is refused naming why."""
    from mixplane.planner.repartitioning import PlannerRepartition

    # re-partitioning over the state it reads of its server and its hosting (their interfaces), a real planner core
    server = SimpleNamespace(spec=spec, names=[s.name for s in spec.sources], core=StepPlanner(spec, resolve_strategy(spec)),
                             recovering=None)
    p = PlannerRepartition(server, SimpleNamespace(host_ids={}))
    first = p.request_repartition({"source": "a", "partitions": 3, "repartition_id": "uid/a-2-3"})
    assert first == {"source": "a", "from": 2, "partitions": 3, "step": 0}
    again = p.request_repartition({"source": "a", "partitions": 3, "repartition_id": "uid/a-2-3"})
    assert again == {**first, "duplicate": True}
    assert len(p.pending_repartitions) == 1 and len(p.repartition_log) == 1
    assert p.repartition_status()["repartitions"][0]["repartition_id"] == "uid/a-2-3"
    with pytest.raises(RepartitionError, match="a re-partition at step 0 is pending"):
        p.request_repartition({"source": "a", "partitions": 4, "repartition_id": "uid/a-2-4"})
    with pytest.raises(RepartitionError, match="repartition_id: must be non-empty text"):
        p.request_repartition({"source": "a", "partitions": 3, "repartition_id": 7})
    p.repartition_log[0]["applied"] = True  # applied at its step (what _apply_repartition marks)
    del p.pending_repartitions[0]
    assert p.request_repartition({"source": "a", "partitions": 3, "repartition_id": "uid/a-2-3"})["duplicate"] is True
    assert len(p.repartition_log) == 1

"""The planner journal: compact records from which any past step is planned again, bit for bit."""

from __future__ import annotations

import json
import os

import pytest

from mixplane.planner.core import StepPlanner
from mixplane.planner.journal import Journal, JournalError, ReplayMismatch, layout_digest, locate, read_journal, replan
from mixplane.planner.strategies import resolve_strategy

from .planner_helpers import make_spec, planner_meta, synthetic_loaders

MODEL = {"backbone": {"hidden": 512, "layers": 4, "heads": 8, "vocab": 1000}}
META = planner_meta()


def loaders(meta=META):
    """The Source Loaders of the synthetic sources of planner_helpers (a WindowFiller for replan)."""
    return synthetic_loaders(meta)


def spec_():
    return make_spec(strategy="llm_balance", model=MODEL, dp=2, rows=16, microbatches=2,
                     phases=[{"start_step": 9, "weights": {"s0": 4}, "lr_scale": 0.5}])


def record_run(path, steps=30, every=8, update_at=None, resume_at=None, spec=None, update=None):
    spec = spec or spec_()
    pl = StepPlanner(spec, resolve_strategy(spec))
    fill = loaders()
    plans = {}
    with Journal(path, every=every) as j:
        j.open(spec, 0, pl.cursor())
        for s in range(steps):
            if update_at is not None and s == update_at:
                j.update(pl.update_mixture(**(update or {"weights": {"s1": 5.0}, "effective_step": s + 3,
                                                         "generation": 1, "lr_scale": 0.25})))
            if resume_at is not None and s == resume_at[0]:
                cur = plans[resume_at[1]].cursor_before
                pl.restore(cur)  # the loaders start over from the restored windows' cursors
                j.resume(cur, session=1)
            fill(pl)
            plan = pl.plan()
            j.step(plan)
            plans[plan.layout.step] = plan
    return plans


def test_every_past_step_replans_identically(tmp_path):
    path = tmp_path / "journal.jsonl"
    plans = record_run(path, update_at=13)
    fill = loaders()  # one set of loaders serves every replay (each starts over from its anchor)
    for s in (0, 5, 8, 9, 15, 16, 17, 29):
        p = replan(path, s, fill)
        assert layout_digest(p.layout) == layout_digest(plans[s].layout), s
        assert p.cursor_before == plans[s].cursor_before
        assert (p.layout.phase, p.layout.lr_scale, p.layout.generation) == \
            (plans[s].layout.phase, plans[s].layout.lr_scale, plans[s].layout.generation)
    assert plans[16].layout.lr_scale == 0.25 and plans[15].layout.lr_scale == 0.5


def test_replay_after_an_update_lands_in_the_later_spec_phases(tmp_path):
    """An update until the next phase boundary: replay reproduces update, phase and anneal-like phase."""
    spec = make_spec(strategy="llm_balance", model=MODEL, dp=2, rows=16, microbatches=2,
                     phases=[{"start_step": 9, "weights": {"s0": 4}, "lr_scale": 0.5},
                             {"start_step": 14, "weights": {"s2": 6}, "lr_scale": 0.1}])
    path = tmp_path / "journal.jsonl"
    plans = record_run(path, steps=20, every=4, update_at=2, spec=spec,
                       update={"weights": {"s1": 5.0}, "effective_step": 5, "generation": 1, "lr_scale": 0.25})
    got = {s: (plans[s].layout.phase, plans[s].layout.lr_scale, plans[s].layout.generation) for s in (4, 5, 8, 9, 14, 19)}
    assert got == {4: (0, 1.0, 0), 5: (0, 0.25, 1), 8: (0, 0.25, 1), 9: (1, 0.5, 0), 14: (2, 0.1, 0), 19: (2, 0.1, 0)}
    fill = loaders()
    for s in (3, 5, 7, 9, 12, 14, 19):
        p = replan(path, s, fill)
        assert layout_digest(p.layout) == layout_digest(plans[s].layout), s
        assert (p.layout.phase, p.layout.lr_scale, p.layout.generation) == \
            (plans[s].layout.phase, plans[s].layout.lr_scale, plans[s].layout.generation)


def test_journal_is_compact(tmp_path):
    path = tmp_path / "journal.jsonl"
    record_run(path, steps=40, every=20)
    recs = read_journal(path)
    steps = [r for r in recs if r["event"] == "step"]
    assert len(steps) == 40 and [r["event"] for r in recs].count("checkpoint") == 2
    assert max(len(json.dumps(r)) for r in steps) < 400  # a step costs a few hundred bytes, not a plan
    assert {"digest", "phase", "lr_scale", "generation", "tokens", "samples"} <= set(steps[0])


def test_replay_after_a_rewind_uses_the_latest_timeline(tmp_path):
    path = tmp_path / "journal.jsonl"
    plans = record_run(path, steps=25, every=8, resume_at=(20, 12))  # at step 20, rewind to before step 12
    recs = read_journal(path)
    assert [r["event"] for r in recs].count("resume") == 1
    rp = locate(recs, 14)
    assert rp.anchor["event"] == "resume" and rp.anchor["step"] == 12
    p = replan(path, 14, loaders())
    assert layout_digest(p.layout) == layout_digest(plans[14].layout)


def test_divergence_is_detected_and_named(tmp_path):
    path = tmp_path / "journal.jsonl"
    record_run(path, steps=12, every=4)

    def other(si, rep, pos, seq_len):  # different data than what was planned
        key, tok, pat = META(si, rep, pos, seq_len)
        return key, tok + 1, pat

    with pytest.raises(ReplayMismatch, match="step 8"):
        replan(path, 10, loaders(other))


def test_torn_last_line_and_bad_records(tmp_path):
    path = tmp_path / "journal.jsonl"
    plans = record_run(path, steps=6, every=4)
    with open(path, "a") as f:
        f.write('{"event": "step", "ste')  # crash mid-write
    assert layout_digest(replan(path, 5, loaders()).layout) == layout_digest(plans[5].layout)
    bad = tmp_path / "bad.jsonl"
    lines = open(path).read().split("\n")
    lines.insert(1, "not json")
    bad.write_text("\n".join(lines))
    with pytest.raises(JournalError, match="bad.jsonl:2"):
        read_journal(bad)
    with pytest.raises(JournalError, match="cannot read"):
        read_journal(tmp_path / "missing.jsonl")


def test_future_step_is_planned_ahead_from_the_last_cursor(tmp_path):
    path = tmp_path / "journal.jsonl"
    record_run(path, steps=10, every=4)
    spec = spec_()
    pl = StepPlanner(spec, resolve_strategy(spec))
    fill = loaders()
    for _ in range(13):
        fill(pl)
        last = pl.plan()
    assert layout_digest(replan(path, 12, loaders()).layout) == layout_digest(last.layout)


def test_many_sources_keep_step_records_small_and_replay_from_deflated_checkpoints(tmp_path):
    """Beyond 64 sources a step record carries totals (per-source counts go to the next checkpoint's
    interval) and large checkpoint cursors are stored deflated; replay reads them as before."""
    spec = make_spec(sources=80, rows=32, seq_len=256, dp=2, microbatches=2, window=4)
    path = tmp_path / "journal.jsonl"
    plans = record_run(path, steps=12, every=5, spec=spec)
    raw = [json.loads(line) for line in open(path)]
    assert all("cursor_z" in r and "cursor" not in r for r in raw if r["event"] == "checkpoint")
    steps = [r for r in raw if r["event"] == "step"]
    assert all("tokens" not in r and len(json.dumps(r)) < 300 for r in steps)
    assert [r["tokens_total"] for r in steps] == [int(plans[s].tokens_by_source.sum()) for s in range(12)]
    recs = read_journal(path)
    ck = [r for r in recs if r["event"] == "checkpoint"]
    assert [r["step"] for r in ck] == [0, 5, 10] and ck[1]["cursor"] == plans[5].cursor_before
    assert "interval" not in ck[0]
    for r in ck[1:]:
        lo, hi = r["interval"]["from"], r["step"]
        assert r["interval"]["tokens"] == [int(x) for x in sum(plans[s].tokens_by_source for s in range(lo, hi))]
        assert r["interval"]["samples"] == [int(x) for x in sum(plans[s].samples_by_source for s in range(lo, hi))]
    p = replan(path, 11, loaders())
    assert layout_digest(p.layout) == layout_digest(plans[11].layout)


def test_last_record_reads_from_the_end_and_agrees_with_reading_everything(tmp_path):
    from mixplane.planner.journal import last_record

    path = tmp_path / "journal.jsonl"
    record_run(path, steps=40, every=8, resume_at=(20, 10))
    spec2 = make_spec(strategy="llm_balance", model=MODEL, dp=2, rows=16, microbatches=2)
    with Journal(path, every=8) as j:  # appends
        j.spec_change(spec2, 1, 41, 40)
    records = read_journal(path)
    for events in (("open",), ("open", "spec"), ("resume",), ("checkpoint",), ("step",), ("update",)):
        want = [r for r in records if r["event"] in events]
        for block in (64, 1000, 1 << 16):  # blocks that cut lines anywhere, and one that holds the whole file
            got = last_record(path, events, block=block)
            assert got == (want[-1] if want else None), (events, block)
    assert last_record(path, ("open", "spec"))["event"] == "spec"
    with open(path, "a") as f:
        f.write('{"event":"spec","spec":{"na')  # a torn last line is skipped, as read_journal skips it
    assert last_record(path, ("open", "spec"), block=100)["generation"] == 1
    bad = tmp_path / "bad.jsonl"
    lines = open(path).read().split("\n")
    lines.insert(1, '{"event":"open", broken')
    bad.write_text("\n".join(lines))
    with pytest.raises(JournalError, match="a record naming open is not JSON"):
        last_record(bad, ("open",))
    with pytest.raises(JournalError, match="cannot read"):
        last_record(tmp_path / "missing.jsonl", ("open",))
    assert last_record(path, ("recover",)) is None

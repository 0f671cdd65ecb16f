"""Exact live updates (issue 20): an UPDATE_MIXTURE carrying the new generation's whole mixture makes the
planner deliver, from the effective step on, exactly the schedule of the new spec; the same update through
`mixplane update --mixture` and through a replay of the journal gives the same plans, sample for sample; an
update id is acknowledged once (a duplicate changes nothing, also after a restart from the journal)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mixplane.cli import mixture_update_message
from mixplane.mixing import MixtureSchedule, apply_temperature, mixture_update_meta
from mixplane.operator.autopartition import spec_schedule
from mixplane.planner.core import StepPlanner
from mixplane.planner.journal import Journal, layout_digest, read_journal, replan
from mixplane.planner.recovery import read_state
from mixplane.spec import SpecError

from .planner_helpers import fill, make_spec, planner_meta, synthetic_loaders

NAMES = ("s0", "s1", "s2", "s3")
EXAMPLES = 60  # hypothesis examples of the property test (each: 3 planners and a replay of 2-3 steps)
BUG_CAUGHT: list[int] = []  # examples where the pre-issue-20 operator message was checked and failed


@st.composite
def mixtures(draw, n: int, unit: str) -> dict:
    """A random mixture section over n sources: weights (zeros allowed), temperature (mostly != 1), phases with
    lr_scale, or an anneal that takes a source to 0."""
    names = NAMES[:n]
    w = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0, 7.0]), min_size=n, max_size=n))
    if sum(w) == 0:
        w[draw(st.integers(0, n - 1))] = 1.0
    m: dict = {"weights": dict(zip(names, w)), "temperature": draw(st.sampled_from([0.5, 2.0, 3.0, 1.0, 0.7])),
               "unit": unit, "seed": 3}
    kind = draw(st.sampled_from(["phases", "anneal", "none"]))
    if kind == "phases":
        starts = sorted(draw(st.sets(st.integers(0, 14), min_size=1, max_size=3)))
        m["phases"] = [{"start_step": s, "lr_scale": draw(st.sampled_from([1.0, 0.5, 0.25])),
                        "weights": {names[draw(st.integers(0, n - 1))]: draw(st.sampled_from([0.0, 4.0, 9.0]))}}
                       for s in starts]
    elif kind == "anneal":
        zero = draw(st.integers(0, n - 1))
        up = (zero + 1) % n
        m["anneal"] = {"start_step": draw(st.integers(0, 14)), "lr_scale": draw(st.sampled_from([0.1, 0.5])),
                       "weights": {names[zero]: 0.0, names[up]: 5.0}}  # a source annealed to 0
    return m


def spec_of(n: int, mixture: dict):
    """The spec of a drawn mixture (a draw whose phase or anneal leaves no weight is not a valid spec: skipped)."""
    try:
        return spec_from(n, mixture)
    except SpecError:
        assume(False)


def spec_from(n: int, mixture: dict):
    m = dict(mixture)
    return make_spec(sources=n, weights=m.pop("weights"), unit=m.pop("unit"), temperature=m.pop("temperature"),
                     phases=m.pop("phases", None), anneal=m.pop("anneal", None), rows=8, seq_len=256)


def with_seed(spec, seed: int):
    return spec.model_copy(update={"mixture": spec.mixture.model_copy(update={"seed": seed})})


def run_through(planner: StepPlanner, last: int) -> dict[int, object]:
    plans = {}
    while planner.next_step <= last:
        fill(planner)
        plan = planner.plan()
        plans[plan.layout.step] = plan
    return plans


def delivered_matches(planner: StepPlanner, new_schedule: MixtureSchedule, steps) -> bool:
    """Whether the planner's mixture at `steps` is the new spec's schedule: probabilities (bit for bit) and lr_scale."""
    return all(np.array_equal(planner.schedule.at(s).probs, new_schedule.at(s).probs)
               and planner.schedule.at(s).lr_scale == new_schedule.at(s).lr_scale for s in steps)


def old_operator_meta(new_spec, step: int) -> dict:
    """What operator/handlers.py:live_update sent before issue 20: the schedule's shares (temperature applied)
    as weights, segment 0's when there are no phases."""
    sched = spec_schedule(new_spec)
    weights = dict(sched[0][1]) if not new_spec.mixture.phases else [sh for s, sh in sched if s <= step][-1]
    return {"weights": {k: float(v) for k, v in weights.items()}, "effective_step": step}


def same_plans(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for s in a:
        assert layout_digest(a[s].layout) == layout_digest(b[s].layout), s
        for f in ("bin", "source", "key", "start", "length", "replica", "pos"):
            assert np.array_equal(getattr(a[s].pieces, f), getattr(b[s].pieces, f)), (s, f)
        assert (a[s].layout.phase, a[s].layout.lr_scale, a[s].layout.generation) == \
            (b[s].layout.phase, b[s].layout.lr_scale, b[s].layout.generation)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_a_whole_mixture_update_delivers_the_new_spec_exactly(data):
    n = data.draw(st.integers(2, 4), label="sources")
    unit = data.draw(st.sampled_from(["tokens", "samples"]), label="unit")
    old_m = data.draw(mixtures(n, unit), label="old mixture")
    new_m = data.draw(mixtures(n, unit), label="patched mixture")
    planned = data.draw(st.integers(0, 6), label="steps planned before the update")
    ahead = data.draw(st.one_of(st.none(), st.integers(0, 3)), label="effective step - first unplanned step")
    after = data.draw(st.integers(3, 10), label="steps planned after the effective step")
    old_spec, new_spec = spec_of(n, old_m), spec_of(n, new_m)
    eff = planned + (ahead or 0)
    last = eff + after
    uid = f"mix/{data.draw(st.integers(0, 10**6))}"

    with tempfile.TemporaryDirectory() as tmp:
        # (a) the planner given the builder's message delivers MixtureSchedule(new spec) from the effective step on
        a = StepPlanner(old_spec)
        path = Path(tmp) / "journal.jsonl"
        with Journal(path, every=4) as j:
            j.open(old_spec, 0, a.cursor())
            plans_a = run_through(a, planned - 1)
            for p in plans_a.values():
                j.step(p)
            meta = mixture_update_meta(new_spec, uid, None if ahead is None else eff)
            event, dup = a.apply_update(meta)
            assert not dup and event["effective_step"] == eff and event["generation"] == 1
            j.update(event)
            later = run_through(a, last)
            for p in later.values():
                j.step(p)
            plans_a.update(later)
            # (c) the same update again: acknowledged with the same generation and step, nothing changes
            before = json.dumps(a.schedule.state_dict())
            ack, dup = a.apply_update(meta)
            assert dup and ack == {"update_id": uid, "generation": 1, "effective_step": eff}
            ack, dup = a.apply_update(mixture_update_meta(old_spec, uid, last + 5))  # the id wins over the content
            assert dup and ack["effective_step"] == eff and json.dumps(a.schedule.state_dict()) == before
            assert a.generation == 1 and a.recent_updates() == [ack]
        new_sched = MixtureSchedule(new_spec)
        old_sched = MixtureSchedule(old_spec)
        assert delivered_matches(a, new_sched, range(eff, last + 1))
        assert all(np.array_equal(a.schedule.at(s).probs, old_sched.at(s).probs) for s in range(eff))
        for s in range(eff, last + 1):
            lay = plans_a[s].layout
            assert lay.lr_scale == new_sched.at(s).lr_scale and lay.generation == 1
            zero = new_sched.at(s).probs == 0
            assert not plans_a[s].tokens_by_source[zero].any()  # a source at 0 (e.g. annealed) delivers nothing

        # the message operator/handlers.py sent before issue 20 fails the same check: without phases it sends the
        # new spec's shares (temperature applied), and the planner applies the old temperature again
        old = StepPlanner(old_spec)
        run_through(old, planned - 1)
        old.apply_update(old_operator_meta(new_spec, eff))
        p = new_sched.at(0).probs
        if not new_spec.mixture.phases and new_spec.mixture.anneal is None and \
                not np.allclose(apply_temperature(p, old_spec.mixture.temperature), p):
            assert not delivered_matches(old, new_sched, range(eff, last + 1))
            BUG_CAUGHT.append(1)

        # (b) the same update through `mixplane update --mixture FILE` (a whole spec file): the same request and
        # the same plans, sample for sample
        spec_file = Path(tmp) / "patched.yaml"
        spec_file.write_text(yaml.safe_dump({"apiVersion": "mixplane.io/v1alpha1", "kind": "DataMixture",
                                             "metadata": {"name": "t"}, "spec": {**new_spec.model_dump(mode="json")}}))
        cli_meta = mixture_update_message(str(spec_file), uid, None if ahead is None else eff)
        assert cli_meta == meta
        b = StepPlanner(old_spec)
        plans_b = run_through(b, planned - 1)
        assert b.apply_update(cli_meta)[1] is False
        plans_b.update(run_through(b, last))
        same_plans(plans_a, plans_b)
        # ... and as a replay of the journal (restored from its last checkpoint, the update applied where it was)
        fill_r = synthetic_loaders(planner_meta())
        for s in sorted({max(eff - 1, 0), eff, last}):
            r = replan(path, s, fill_r)
            same_plans({s: plans_a[s]}, {s: r})

        # (c) after a restart from the journal the id is still acknowledged, with the same generation and step
        state = read_state(read_journal(path))
        assert state is not None
        fresh = StepPlanner(old_spec)
        fresh.remember_updates(state.history)
        assert fresh.apply_update(meta) == ({"update_id": uid, "generation": 1, "effective_step": eff}, True)


def test_patch_of_a_weight_at_temperature_two_delivers_the_patched_spec():
    """The example of issue 20: temperature 2, `b: 1 -> 9`; the new spec asks a 0.25 / b 0.75."""
    old = make_spec(sources=2, weights={"s0": 1.0, "s1": 1.0}, temperature=2.0)
    new = make_spec(sources=2, weights={"s0": 1.0, "s1": 9.0}, temperature=2.0)
    p = StepPlanner(old)
    run_through(p, 2)
    event, _ = p.apply_update(mixture_update_meta(new, "patch-1"))
    assert event["effective_step"] == 3 and np.allclose(p.schedule.at(3).probs, [0.25, 0.75])
    q = StepPlanner(old)
    run_through(q, 2)
    q.apply_update(old_operator_meta(new, 3))
    assert np.allclose(q.schedule.at(3).probs, [0.366, 0.634], atol=1e-3)  # the bug: temperature twice


def test_an_anneal_to_zero_is_not_undone_by_an_update():
    """With an anneal and no phases the old message sent segment 0's weights for the rest of the run."""
    spec = make_spec(sources=3, weights={"s0": 1, "s1": 1, "s2": 1},
                     anneal={"start_step": 6, "weights": {"s2": 0.0}, "lr_scale": 0.1})
    new = make_spec(sources=3, weights={"s0": 2, "s1": 1, "s2": 1}, temperature=1.5,
                    anneal={"start_step": 6, "weights": {"s2": 0.0}, "lr_scale": 0.1})
    p = StepPlanner(spec)
    run_through(p, 1)
    p.apply_update(mixture_update_meta(new, "u"))
    plans = run_through(p, 9)
    for s in range(6, 10):
        assert plans[s].tokens_by_source[2] == 0 and plans[s].layout.lr_scale == 0.1
    assert np.array_equal(p.schedule.at(7).probs, MixtureSchedule(new).at(7).probs)


def test_an_update_that_cannot_be_adopted_is_refused_naming_the_field_and_changes_nothing():
    spec = make_spec(sources=3, weights={"s0": 1, "s1": 1, "s2": 1})
    p = StepPlanner(spec)
    run_through(p, 4)
    before = json.dumps(p.schedule.state_dict())
    bad = [
        ({"weights": {"s0": 1.0, "zz": 2.0}}, r"mixture\.weights\.zz: unknown source 'zz'"),
        ({"weights": {"s0": 1.0}, "temperature": 0.0}, r"mixture\.temperature: temperature must be a finite number > 0"),
        ({"weights": {"s0": 1.0}, "phases": [{"start_step": 9, "weights": {"s0": 0.0}}]}, r"mixture\.phases\[0\]\.weights"),
        ({"weights": {"s0": 1.0}, "seed": 99}, r"mixture\.seed: cannot change in a running mixture"),
        ({"weights": {"s0": 1.0}, "unit": "samples"}, r"mixture\.unit: cannot change"),
        ({"weights": {"s0": 1.0}, "bogus": 1}, r"mixture\.bogus"),
        ("not a mapping", r"mixture: expected a mapping"),
    ]
    for mixture, err in bad:
        with pytest.raises(ValueError, match=err):
            p.apply_update({"mixture": mixture, "update_id": "x"})
    with pytest.raises(ValueError, match=r"effective_step 2 is already planned \(planned through step 4\)"):
        p.apply_update(mixture_update_meta(spec, "y", 2))
    with pytest.raises(ValueError, match="not both"):
        p.apply_update({**mixture_update_meta(spec, "z"), "weights": {"s0": 1.0}})
    with pytest.raises(ValueError, match="update_id"):
        p.apply_update({"mixture": {}, "update_id": ""})
    assert json.dumps(p.schedule.state_dict()) == before and p.generation == 0 and p.acked == {}
    # a refused id is not acknowledged: the corrected update with the same id is applied
    assert p.apply_update(mixture_update_meta(spec, "x", 7))[1] is False and p.generation == 1


def test_the_weights_form_keeps_working_and_is_idempotent_with_an_id():
    spec = make_spec(sources=3, weights={"s0": 1, "s1": 1, "s2": 1}, temperature=2.0)
    p = StepPlanner(spec)
    run_through(p, 2)
    ev, dup = p.apply_update({"weights": {"s0": 4.0}, "lr_scale": 0.5, "update_id": "w1"})
    assert not dup and ev["effective_step"] == 3 and ev["update_id"] == "w1" and p.schedule.at(3).lr_scale == 0.5
    assert np.allclose(p.schedule.at(3).probs, apply_temperature(np.array([4.0, 1, 1]), 2.0))
    assert p.apply_update({"weights": {"s0": 9.0}, "update_id": "w1"}) == (
        {"update_id": "w1", "generation": 1, "effective_step": 3}, True)
    ev2, _ = p.apply_update({"weights": {"s1": 2.0}, "effective_step": 5})  # no id: applied every time
    assert ev2["generation"] == 2 and "update_id" not in ev2


def test_a_rewind_keeps_a_whole_mixture_update_newer_than_the_cursor():
    """RESUME to a cursor before the update's step: the update stays in force (applied again on the cursor's
    schedule), as a planner that got the update before planning those steps would plan them."""
    old = make_spec(sources=3, weights={"s0": 1, "s1": 1, "s2": 1}, phases=[{"start_step": 20, "weights": {"s0": 5}}])
    new = make_spec(sources=3, weights={"s0": 1, "s1": 6, "s2": 1}, temperature=2.0,
                    anneal={"start_step": 9, "weights": {"s1": 0.0}, "lr_scale": 0.3})
    ref = StepPlanner(old)
    plans = run_through(ref, 2)
    cursor = plans[2].cursor_before
    ref.restore(cursor)
    ref.apply_update(mixture_update_meta(new, "m", 5))
    want = run_through(ref, 12)
    live = StepPlanner(old)
    run_through(live, 4)
    live.apply_update(mixture_update_meta(new, "m", 5))
    run_through(live, 7)
    kept = live.restore(cursor, keep_updates=True)
    assert [(e["generation"], e["effective_step"], e["update_id"], e["planned_through"]) for e in kept] == [(1, 5, "m", 1)]
    same_plans(want, run_through(live, 12))
    assert live.apply_update(mixture_update_meta(new, "m"))[1] is True


def test_cli_mixture_file_forms(tmp_path):
    spec = make_spec(sources=2, weights={"s0": 1.0, "s1": 3.0}, temperature=2.0)
    want = mixture_update_meta(spec, "id-1", 4)
    section = spec.mixture.model_dump(mode="json")
    for i, doc in enumerate([section, {"mixture": section}, spec.model_dump(mode="json")]):
        f = tmp_path / f"m{i}.yaml"
        f.write_text(yaml.safe_dump(doc))
        assert mixture_update_message(str(f), "id-1", 4) == want
    j = tmp_path / "m.json"
    j.write_text(json.dumps(section))
    assert mixture_update_message(str(j), "id-1", 4) == want
    assert mixture_update_message(str(j))["update_id"].startswith("cli-")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"weights": {"s0": "heavy"}, "tempreature": 2}))
    with pytest.raises(SpecError) as e:
        mixture_update_message(str(bad))
    assert {p.path for p in e.value.problems} == {"weights.s0", "tempreature"} and e.value.origin == str(bad)


def test_planner_server_acks_once_lists_updates_and_refuses_new_ones_while_recovering(tmp_path):
    """The planner server's UPDATE_MIXTURE handler (in process, over its real socket): ACK, duplicate ACK, STATUS's
    updates; a restarted planner (same run dir, its journal) still recovering answers the known id as a duplicate
    and refuses a new update with a retryable reason; a malformed request gets an ERROR, not silence."""
    import zmq

    from mixplane import wire
    from mixplane.control import update_retryable
    from mixplane.planner.server import PlannerServer
    from mixplane.wire import Kind

    from .test_component import _pump

    spec = make_spec(sources=3, weights={"s0": 1, "s1": 1, "s2": 1}, temperature=2.0)
    new = make_spec(sources=3, weights={"s0": 1, "s1": 9, "s2": 1}, temperature=2.0,
                    anneal={"start_step": 30, "weights": {"s2": 0.0}, "lr_scale": 0.5})
    meta = mixture_update_meta(new, "op/1", 12)
    ctx = zmq.Context()

    def ask(planner, kind, m):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(planner.endpoint)
        try:
            wire.send(s, kind, m)
            got: list = []

            def answered() -> bool:
                if s.poll(0):
                    got.append(wire.recv(s)[1])
                return bool(got)

            _pump(planner, answered)
            assert got, "no answer"
            return got[0]
        finally:
            s.close(0)

    try:
        first = PlannerServer(spec, "tcp://127.0.0.1:0", context=ctx, metrics_port=None, run_dir=str(tmp_path))
        first.open_run = True  # anonymous admin requests (no CURVE in this test)
        try:
            ack = ask(first, Kind.UPDATE_MIXTURE, meta)
            assert ack.kind == Kind.ACK and ack.meta["duplicate"] is False
            assert (ack.meta["generation"], ack.meta["effective_step"], ack.meta["update_id"]) == (1, 12, "op/1")
            dup = ask(first, Kind.UPDATE_MIXTURE, meta)
            assert dup.kind == Kind.ACK and dup.meta["duplicate"] is True and dup.meta["effective_step"] == 12
            st = ask(first, Kind.STATUS, {})
            assert st.meta["updates"] == [{"update_id": "op/1", "generation": 1, "effective_step": 12}]
            assert st.meta["generation"] == 1
            bad = ask(first, Kind.UPDATE_MIXTURE, {"effective_step": 3})
            assert bad.kind == Kind.ERROR and "carries `mixture`" in bad.meta["error"]
            assert not update_retryable(bad.meta["error"])
        finally:
            first.close()
        records = read_journal(tmp_path / "journal.jsonl")
        upd = [r for r in records if r["event"] == "update"]
        assert len(upd) == 1 and upd[0]["update_id"] == "op/1" and upd[0]["mixture"] == new.mixture.model_dump(mode="json")

        second = PlannerServer(spec, "tcp://127.0.0.1:0", context=ctx, metrics_port=None, run_dir=str(tmp_path))
        second.open_run = True
        try:
            assert second.recovering is not None  # waits for its constructors
            dup = ask(second, Kind.UPDATE_MIXTURE, meta)
            assert dup.kind == Kind.ACK and dup.meta["duplicate"] is True
            assert (dup.meta["generation"], dup.meta["effective_step"]) == (1, 12)
            other = ask(second, Kind.UPDATE_MIXTURE, mixture_update_meta(spec, "op/2"))
            assert other.kind == Kind.ERROR and "recovering" in other.meta["error"] and update_retryable(other.meta["error"])
            st = ask(second, Kind.STATUS, {})
            assert st.meta["updates"] == [{"update_id": "op/1", "generation": 1, "effective_step": 12}]
        finally:
            second.close()
    finally:
        ctx.destroy(0)


def test_a_rewind_journals_the_kept_update_and_replay_plans_every_step_again(tmp_path):
    """The server's RESUME sequence on a journal: a whole-mixture update for step 9, a rewind to step 4 (a new
    session: the update kept, journaled after the resume record), steps 4..14 again; replan rebuilds each."""
    old = make_spec(sources=3, weights={"s0": 1, "s1": 1, "s2": 1}, temperature=0.5,
                    phases=[{"start_step": 12, "weights": {"s0": 6}, "lr_scale": 0.5}])
    new = make_spec(sources=3, weights={"s0": 1, "s1": 5, "s2": 2}, temperature=3.0,
                    anneal={"start_step": 11, "weights": {"s2": 0.0}, "lr_scale": 0.2})
    path = tmp_path / "journal.jsonl"
    p = StepPlanner(old)
    plans: dict = {}
    with Journal(path, every=3) as j:
        j.open(old, 0, p.cursor())
        for plan in run_through(p, 5).values():
            j.step(plan)
            plans[plan.layout.step] = plan
        event, _ = p.apply_update(mixture_update_meta(new, "u9", 9))
        j.update(event)
        for plan in run_through(p, 10).values():
            j.step(plan)
        cur = plans[4].cursor_before
        kept = p.restore(cur, keep_updates=True)
        j.resume(cur, 1)
        for e in kept:
            j.update(e)
        assert [(e["update_id"], e["effective_step"]) for e in kept] == [("u9", 9)]
        again = run_through(p, 14)
        for plan in again.values():
            j.step(plan)
    sched = MixtureSchedule(new)
    assert delivered_matches(p, sched, range(9, 15)) and again[12].layout.lr_scale == 0.2
    fill_r = synthetic_loaders(planner_meta())
    for s in (4, 8, 9, 11, 14):
        same_plans({s: again[s]}, {s: replan(path, s, fill_r)})
    state = read_state(read_journal(path))
    assert state is not None and [u["update_id"] for u in state.history] == ["u9"]

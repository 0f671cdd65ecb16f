"""Per-step exactness of the mixture: realised counts within one sample of target at every step, through
phases, anneal, temperature, runtime updates (effective at a stated step) and resume."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mixplane.mixing import DeficitSampler, MixtureSchedule, apply_temperature, slack
from mixplane.planner.core import StepPlanner
from mixplane.planner.journal import layout_digest

from .planner_helpers import fill, make_spec, run


def check_every_step(planner: StepPlanner, steps: int, *, images: bool = False, updates=None):
    """Plan `steps` steps; after each, recompute the realised counts of the current segment from the
    plans themselves and compare with the schedule's target. Returns the worst deviation in units."""
    unit_samples = planner.unit_samples
    seg_start = None
    realized = np.zeros(planner.n_sources)
    worst = 0.0
    for _ in range(steps):
        s = planner.next_step
        if updates and s in updates:
            planner.update_mixture(**updates[s])
        fill(planner, images=images)
        plan = planner.plan()
        point = planner.schedule.at(s)
        assert plan.layout.phase == point.phase and plan.layout.lr_scale == point.lr_scale
        if point.segment_start != seg_start:
            seg_start = point.segment_start
            realized[:] = 0
        realized += plan.samples_by_source if unit_samples else plan.tokens_by_source
        total = realized.sum()
        L = 1.0 if unit_samples else planner.sampler.unit_max
        dev = np.abs(realized - point.probs * total) / L
        assert np.all(dev < 1.0), (s, realized, point.probs * total, L)
        assert np.allclose(realized, planner.sampler.realized)  # the sampler's books match the plans
        worst = max(worst, float(dev.max()))
    return worst


@pytest.mark.parametrize("unit", ["samples", "tokens"])
def test_within_one_sample_at_every_step_through_phases_and_anneal(unit):
    spec = make_spec(sources=4, weights={"s0": 5, "s1": 2, "s2": 1, "s3": 0.5}, unit=unit, temperature=1.5,
                     phases=[{"start_step": 5, "weights": {"s0": 1, "s3": 4}, "lr_scale": 0.5},
                             {"start_step": 11, "weights": {"s1": 0, "s2": 6}, "lr_scale": 0.25}],
                     rows=24, seq_len=256)
    worst = check_every_step(StepPlanner(spec), 16)
    assert worst < 1.0
    anneal = make_spec(sources=3, weights={"s0": 3, "s1": 1}, unit=unit,
                       anneal={"start_step": 6, "weights": {"s2": 1.0}, "lr_scale": 0.1})
    p = StepPlanner(anneal)
    check_every_step(p, 10)
    # unnamed sources fall back to their base weights (seed 002); s2 had none
    assert p.schedule.at(9).lr_scale == 0.1 and np.allclose(p.schedule.at(9).probs, [0.6, 0.2, 0.2])


@pytest.mark.parametrize("unit", ["samples", "tokens"])
def test_runtime_update_ends_at_the_next_phase_and_stays_exact(unit):
    """Updates before a phase and before the anneal: each lasts until the next boundary; the realised
    counts stay within one sample of target at every step through every change."""
    spec = make_spec(sources=3, weights={"s0": 3, "s1": 2, "s2": 1}, unit=unit, rows=16,
                     phases=[{"start_step": 6, "weights": {"s2": 4}, "lr_scale": 0.5},
                             {"start_step": 10, "weights": {"s0": 0.5}, "lr_scale": 0.2}])
    p = StepPlanner(spec)
    updates = {2: {"weights": {"s1": 6.0, "s0": 0.0}, "effective_step": 3, "generation": 1, "lr_scale": 0.9},
               7: {"weights": {"s2": 0.0}, "effective_step": 8, "generation": 2}}
    check_every_step(p, 13, updates=updates)
    at = {s: p.schedule.at(s) for s in (2, 3, 6, 8, 10)}
    assert [(a.phase, a.generation, a.lr_scale) for a in at.values()] == \
        [(0, 0, 1.0), (0, 1, 0.9), (1, 0, 0.5), (1, 2, 0.5), (2, 0, 0.2)]
    assert np.allclose(at[8].probs, [0.6, 0.4, 0.0])  # s0, s1 from phase 1 (base), s2 zeroed
    assert np.allclose(at[10].probs, np.array([0.5, 2, 1]) / 3.5)  # phase 2 as written
    anneal = make_spec(sources=3, weights={"s0": 1, "s1": 1, "s2": 1}, unit=unit, rows=16,
                       anneal={"start_step": 7, "weights": {"s2": 5.0}, "lr_scale": 0.1})
    q = StepPlanner(anneal)
    check_every_step(q, 10, updates={1: {"weights": {"s0": 4.0}, "effective_step": 2, "generation": 1}})
    a = q.schedule.at(9)
    assert a.lr_scale == 0.1 and a.segment_start == 7 and np.allclose(a.probs, [1 / 7, 1 / 7, 5 / 7])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.floats(0.05, 10.0), min_size=2, max_size=4), st.sampled_from([0.5, 1.0, 2.0]),
       st.sampled_from(["samples", "tokens"]), st.integers(2, 6))
def test_exactness_property(weights, temperature, unit, phase_at):
    names = {f"s{i}": w for i, w in enumerate(weights)}
    spec = make_spec(sources=len(weights), weights=names, unit=unit, temperature=temperature,
                     phases=[{"start_step": phase_at, "weights": {"s0": weights[-1], "s1": weights[0]}}],
                     rows=12, seq_len=256)
    check_every_step(StepPlanner(spec), phase_at + 4)


@pytest.mark.parametrize("unit", ["samples", "tokens"])
def test_runtime_update_takes_effect_at_its_step_and_keeps_exactness(unit):
    spec = make_spec(sources=3, weights={"s0": 1, "s1": 1, "s2": 1}, unit=unit, rows=16)
    planner = StepPlanner(spec)
    run(planner, 3)
    # arrives after step 2 was planned, effective from step 6
    ev = planner.update_mixture({"s0": 6.0, "s2": 0.0}, effective_step=6, generation=1, lr_scale=0.5, temperature=2.0)
    assert ev["effective_step"] == 6 and ev["planned_through"] == 2 and ev["generation"] == 1
    assert ev["segment"]["temperature"] == 2.0
    plans = []
    for _ in range(8):
        fill(planner)
        plans.append(planner.plan())
    before, after = plans[:3], plans[3:]  # steps 3..5, 6..10
    assert all(p.layout.lr_scale == 1.0 and p.layout.generation == 0 for p in before)
    assert all(p.layout.lr_scale == 0.5 and p.layout.generation == 1 for p in after)
    assert all((p.samples_by_source[2] == 0) for p in after)  # s2 dropped to 0 exactly from step 6
    assert any(p.samples_by_source[2] > 0 for p in before)
    with pytest.raises(ValueError, match="already planned"):
        planner.update_mixture({"s0": 1.0}, effective_step=5, generation=2)
    p2 = StepPlanner(spec)
    check_every_step(p2, 10, updates={4: {"weights": {"s1": 5.0}, "effective_step": 5, "generation": 1}})


def test_resume_lands_in_the_right_phase_and_replays_identically():
    spec = make_spec(sources=3, weights={"s0": 2, "s1": 1, "s2": 1},
                     phases=[{"start_step": 4, "weights": {"s2": 5}, "lr_scale": 0.3}], rows=16)
    a = StepPlanner(spec)
    run(a, 2)
    a.update_mixture({"s1": 4.0}, effective_step=8, generation=1, lr_scale=0.7)
    plans = run(a, 10)  # steps 2..11
    cur = plans[4].cursor_before  # before step 6: phase 1 (spec phase), update pending at 8
    b = StepPlanner(spec)  # fresh planner from the original spec (generation 0)
    b.restore(cur)
    assert b.schedule.at(6).phase == 1 and b.schedule.at(8).generation == 1
    replayed = run(b, 6)  # steps 6..11
    for x, y in zip(plans[4:], replayed):
        assert layout_digest(x.layout) == layout_digest(y.layout)
        assert (x.layout.phase, x.layout.lr_scale) == (y.layout.phase, y.layout.lr_scale)
    assert replayed[-1].layout.lr_scale == 0.7


def test_rebase_adopts_a_new_generation_from_a_step():
    old = make_spec(sources=3, weights={"s0": 1, "s1": 1, "s2": 1}, phases=[{"start_step": 50, "weights": {"s0": 9}}])
    new = make_spec(sources=3, weights={"s0": 1, "s1": 3, "s2": 0}, temperature=2.0,
                    phases=[{"start_step": 30, "weights": {"s2": 2}, "lr_scale": 0.5}])
    s = MixtureSchedule(old)
    segs = s.rebase(new, effective_step=20, generation=3, planned_through=10)
    assert [g.start_step for g in segs] == [20, 30] and all(g.generation == 3 for g in segs)
    assert np.allclose(s.at(19).probs, [1 / 3] * 3) and s.at(19).generation == 0
    assert np.allclose(s.at(20).probs, apply_temperature(np.array([1.0, 3, 0]), 2.0))
    assert s.at(40).lr_scale == 0.5 and s.at(60).phase == segs[-1].phase  # the old step-50 phase is gone
    with pytest.raises(ValueError, match="already planned"):
        s.rebase(new, effective_step=5, generation=4, planned_through=10)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.05, 5.0), min_size=2, max_size=6), st.integers(0, 2**31 - 1))
def test_edf_pick_with_known_sizes_stays_within_one_sample(weights, seed):
    rng = np.random.default_rng(seed)
    p = apply_temperature(np.array(weights), 1.0)
    n = len(p)
    s = DeficitSampler(n)
    L = 1000.0
    kinds = rng.integers(0, 3, n)
    for _ in range(300):
        sizes = np.array([rng.integers(1, 50) if k == 0 else rng.integers(200, 1001) if k == 1 else
                          min(1000, 1 + int(rng.pareto(1.2) * 40)) for k in kinds], dtype=float)
        i = s.pick(p, np.ones(n, bool), sizes=sizes, scale=L)
        s.record(i, sizes[i])
        assert np.all(np.abs(s.deviation(p)) < L)
    assert 0 < slack(n) < 1


def test_sampler_state_roundtrip_keeps_the_scale():
    s = DeficitSampler(3)
    s.pick(np.array([0.2, 0.3, 0.5]), np.ones(3, bool), sizes=np.array([5.0, 7.0, 9.0]))
    t = DeficitSampler(3)
    t.load_state_dict(s.state_dict())
    assert t.unit_max == s.unit_max == 9.0

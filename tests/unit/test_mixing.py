"""Mixture semantics (KempnerForge rules) and the stratified sampler's per-step exactness."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mixplane.mixing import DeficitSampler, MixtureSchedule, apply_temperature
from mixplane.spec import parse_spec


def spec_with(mixture: dict, names=("web", "code", "books")):
    return parse_spec({
        "sources": [{"name": n, "uri": f"/nowhere/{n}", "kind": "tokens", "columns": ["t"]} for n in names],
        "mixture": mixture, "batch": {"sequences": 4, "seq_len": 128}, "strategy": {"name": "vanilla"},
    })


def test_temperature_matches_kempnerforge():
    w = [1.0, 0.3, 0.5]
    for t in (0.5, 1.0, 2.0, 5.0):
        log_w = [math.log(x) / t for x in w]
        m = max(log_w)
        scaled = [math.exp(x - m) for x in log_w]
        ref = [s / sum(scaled) for s in scaled]
        assert np.allclose(apply_temperature(np.array(w), t), ref)
    flat = apply_temperature(np.array(w), 100.0)
    assert flat.max() - flat.min() < 0.01  # T -> inf: uniform


def test_zero_weight_stays_zero_under_temperature():
    p = apply_temperature(np.array([1.0, 0.0, 1.0]), 3.0)
    assert p[1] == 0 and np.isclose(p.sum(), 1)


def test_phase_falls_back_to_base_weights():
    s = MixtureSchedule(spec_with({"weights": {"web": 1.0, "code": 0.3, "books": 0.5},
                                   "phases": [{"start_step": 100, "weights": {"web": 0.4, "code": 0.3}, "lr_scale": 1.0},
                                              {"start_step": 180, "weights": {"web": 0.1, "books": 0.7}, "lr_scale": 0.3}]}))
    assert np.allclose(s.at(0).probs, np.array([1.0, 0.3, 0.5]) / 1.8)
    assert np.allclose(s.at(99).probs, np.array([1.0, 0.3, 0.5]) / 1.8)
    assert np.allclose(s.at(100).probs, np.array([0.4, 0.3, 0.5]) / 1.2)  # books keeps its base weight
    p = s.at(180)
    assert np.allclose(p.probs, np.array([0.1, 0.3, 0.7]) / 1.1) and p.lr_scale == 0.3 and p.phase == 2


def test_anneal_falls_back_to_base_weights():
    # seed 002: "everything else drops to its default" -- its original weight, not 0
    s = MixtureSchedule(spec_with({"weights": {"web": 0.7, "code": 0.3, "books": 0.5},
                                   "anneal": {"start_step": 50, "weights": {"books": 1.0}, "lr_scale": 0.5}}))
    assert np.allclose(s.at(49).probs, np.array([0.7, 0.3, 0.5]) / 1.5)
    a = s.at(50)
    assert np.allclose(a.probs, np.array([0.7, 0.3, 1.0]) / 2.0) and a.lr_scale == 0.5 and a.phase == 1


def test_explicit_zero_drops_a_source_in_phases_and_anneal():
    s = MixtureSchedule(spec_with({"weights": {"web": 1, "code": 1, "books": 2},
                                   "phases": [{"start_step": 10, "weights": {"code": 0}}]}))
    assert np.allclose(s.at(10).probs, [1 / 3, 0, 2 / 3])
    a = MixtureSchedule(spec_with({"weights": {"web": 1, "code": 1, "books": 2},
                                   "anneal": {"start_step": 10, "weights": {"web": 0, "code": 0, "books": 1}}}))
    assert np.allclose(a.at(10).probs, [0, 0, 1])


def test_anneal_source_without_base_weight_stays_at_zero():
    # a source absent from mixture.weights has base weight 0, so the fallback keeps it out
    s = MixtureSchedule(spec_with({"weights": {"web": 0.7, "code": 0.3},
                                   "anneal": {"start_step": 50, "weights": {"code": 0.7}}}))
    assert np.allclose(s.at(50).probs, [0.5, 0.5, 0.0])


def test_runtime_update_takes_effect_at_its_step():
    s = MixtureSchedule(spec_with({"weights": {"web": 1, "code": 1, "books": 1},
                                   "phases": [{"start_step": 500, "weights": {"books": 5}, "lr_scale": 0.5}]}))
    seg = s.update({"code": 2.0}, effective_step=120, generation=1, planned_through=100)
    assert seg.start_step == 120 and seg.generation == 1
    assert np.allclose(s.at(119).probs, [1 / 3] * 3)
    assert np.allclose(s.at(120).probs, [0.25, 0.5, 0.25]) and s.at(499).generation == 1
    # the later spec phase still starts at its step, with its weights as written
    p = s.at(600)
    assert np.allclose(p.probs, np.array([1, 1, 5]) / 7) and p.lr_scale == 0.5 and p.phase == 1
    with pytest.raises(ValueError, match="already planned"):
        s.update({"web": 1.0}, effective_step=90, generation=2, planned_through=100)
    with pytest.raises(ValueError, match="unknown source"):
        s.update({"nope": 1.0}, effective_step=200, generation=2, planned_through=100)


def test_runtime_update_before_the_anneal_keeps_the_anneal():
    s = MixtureSchedule(spec_with({"weights": {"web": 1, "code": 1, "books": 1},
                                   "anneal": {"start_step": 100, "weights": {"books": 4}, "lr_scale": 0.1}}))
    s.update({"web": 3.0}, effective_step=10, generation=1, lr_scale=0.8)
    u = s.at(50)
    assert np.allclose(u.probs, [0.6, 0.2, 0.2]) and u.lr_scale == 0.8 and u.generation == 1
    assert u.phase == 0  # batches keep the spec's phase id; the generation names the update
    a = s.at(150)
    assert np.allclose(a.probs, np.array([1, 1, 4]) / 6) and a.lr_scale == 0.1 and a.phase == 1
    assert a.segment_start == 100 and a.generation == 0


def test_runtime_update_at_a_phase_start_modifies_that_phase():
    s = MixtureSchedule(spec_with({"weights": {"web": 1, "code": 1, "books": 1},
                                   "phases": [{"start_step": 100, "weights": {"books": 4}, "lr_scale": 0.5},
                                              {"start_step": 200, "weights": {"web": 2}}]}))
    s.update({"code": 0.0}, effective_step=100, generation=1)
    p = s.at(150)  # unnamed sources and lr_scale come from the phase in force at the step
    assert np.allclose(p.probs, [0.2, 0, 0.8]) and p.lr_scale == 0.5 and p.phase == 1 and p.generation == 1
    assert np.allclose(s.at(200).probs, [0.5, 0.25, 0.25]) and s.at(200).phase == 2
    assert [g.start_step for g in s.segments] == [0, 100, 200]


def test_schedule_state_roundtrip():
    s = MixtureSchedule(spec_with({"weights": {"web": 1, "code": 1}}))
    s.update({"books": 3.0}, effective_step=10, generation=4)
    t = MixtureSchedule(spec_with({"weights": {"web": 1, "code": 1}}))
    t.load_state_dict(s.state_dict())
    assert np.allclose(t.at(20).probs, s.at(20).probs) and t.at(20).generation == 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 10.0), min_size=2, max_size=6).filter(lambda w: sum(w) > 0.1),
       st.integers(50, 400))
def test_sample_counts_within_one_of_target_at_every_pick(weights, picks):
    p = apply_temperature(np.array(weights), 1.0)
    s = DeficitSampler(len(weights))
    eligible = np.ones(len(weights), dtype=bool)
    k = int((p > 0).sum())
    bound = 1.0 - 1.0 / (2 * k - 2) if k > 1 else 0.0  # Tijdeman's bound, below one sample
    for n in range(1, picks + 1):
        i = s.pick(p, eligible, unit=1.0)
        s.record(i, 1.0)
        assert np.all(np.abs(s.realized - p * n) <= bound + 1e-9), (n, s.realized, p * n)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.05, 5.0), min_size=2, max_size=5), st.integers(0, 2**31 - 1))
def test_token_counts_track_target_within_documents(weights, seed):
    rng = np.random.default_rng(seed)
    p = apply_temperature(np.array(weights), 1.0)
    s = DeficitSampler(len(weights))
    eligible = np.ones(len(weights), dtype=bool)
    longest = 0
    for _ in range(300):
        i = s.pick(p, eligible, unit=0.0)
        n = int(rng.integers(1, 500))
        longest = max(longest, n)
        s.record(i, n)
        total = s.realized.sum()
        # a source is picked only while it is behind, so it overshoots by less than one document;
        # the shortfalls balance the overshoots, so they stay below (k - 1) documents
        assert np.all(s.realized - p * total <= longest + 1e-6)
        assert np.all(p * total - s.realized <= (len(weights) - 1) * longest + 1e-6)

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
    }, check_files=False)


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


def test_anneal_drops_unnamed_sources():
    s = MixtureSchedule(spec_with({"weights": {"web": 0.7, "code": 0.3}, "anneal": {"start_step": 50, "weights": {"books": 1.0}, "lr_scale": 0.5}}))
    assert np.allclose(s.at(49).probs, [0.7, 0.3, 0.0])
    a = s.at(50)
    assert np.allclose(a.probs, [0, 0, 1]) and a.lr_scale == 0.5 and a.phase == 1


def test_runtime_update_takes_effect_at_its_step():
    s = MixtureSchedule(spec_with({"weights": {"web": 1, "code": 1, "books": 1},
                                   "phases": [{"start_step": 500, "weights": {"books": 5}}]}))
    seg = s.update({"code": 2.0}, effective_step=120, generation=1, planned_through=100)
    assert seg.start_step == 120 and seg.generation == 1
    assert np.allclose(s.at(119).probs, [1 / 3] * 3)
    assert np.allclose(s.at(120).probs, [0.25, 0.5, 0.25])
    assert np.allclose(s.at(600).probs, [0.25, 0.5, 0.25])  # later spec phases are superseded
    with pytest.raises(ValueError, match="already planned"):
        s.update({"web": 1.0}, effective_step=90, generation=2, planned_through=100)
    with pytest.raises(ValueError, match="unknown source"):
        s.update({"nope": 1.0}, effective_step=200, generation=2, planned_through=100)


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

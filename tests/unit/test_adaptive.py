"""Adaptive mixtures, the method (issue 23 item 5; mixplane.adaptive): DoReMi's exponentiated-gradient update on
per-source excess loss, with bounds. On a synthetic workload whose per-source losses are known functions of the
tokens each source has received, the weights follow the method's prediction (an independent numpy transcription of
the paper's update), the source whose loss stays furthest above its reference gains weight, and the bounds hold."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mixplane.adaptive import AdaptiveConfig, doremi_step, interval_losses, project

SOURCES = ("web", "code", "math")
FLOOR = np.array([2.0, 1.2, 1.6])  # irreducible loss of each source
SCALE = np.array([1.0, 3.0, 6.0])  # how far above it a fresh model starts
HALF = np.array([4e5, 2e5, 8e5])  # tokens after which the reducible part has halved (power law)
REF = FLOOR + 0.05  # reference losses: what a well-trained model reaches


def loss_after(tokens_seen: np.ndarray) -> np.ndarray:
    """Mean token loss of each source once it has been trained on `tokens_seen` of its tokens."""
    return FLOOR + SCALE * (1 + tokens_seen / HALF) ** -0.5


def paper_update(w: np.ndarray, loss: np.ndarray, ref: np.ndarray, eta: float, c: float) -> np.ndarray:
    """DoReMi, Algorithm 1, one step (numpy, no bounds): alpha <- normalise(alpha * exp(eta * lambda)),
    then (1 - c) alpha + c u, with lambda = max(L - L_ref, 0)."""
    lam = np.maximum(loss - ref, 0.0)
    a = w * np.exp(eta * lam)
    a = a / a.sum()
    return (1 - c) * a + c / len(w)


def simulate(cfg: AdaptiveConfig, updates: int, tokens_per_update: float, w0: np.ndarray):
    """The weights over `updates` intervals (running loss totals as the planner keeps them), and the prediction."""
    seen = np.zeros(3)
    sums, counts = np.zeros(3), np.zeros(3, np.int64)
    w, pred = w0.copy(), w0.copy()
    traj, ptraj = [w.copy()], [pred.copy()]
    for _ in range(updates):
        got = np.floor(w * tokens_per_update).astype(np.int64)
        before_s, before_n = sums.copy(), counts.copy()
        seen += got
        lossnow = loss_after(seen)
        sums += lossnow * got
        counts += got
        interval = interval_losses(sums.tolist(), counts.tolist(), before_s.tolist(), before_n.tolist())
        assert interval == pytest.approx(lossnow.tolist(), rel=1e-9)
        w = np.array(doremi_step(w.tolist(), interval, REF.tolist(), cfg))
        pred = paper_update(pred, loss_after(ptraj_seen(ptraj, tokens_per_update)), REF, cfg.step_size, cfg.smoothing)
        traj.append(w.copy())
        ptraj.append(pred.copy())
    return np.array(traj), np.array(ptraj)


def ptraj_seen(ptraj: list[np.ndarray], tokens_per_update: float) -> np.ndarray:
    """Tokens each source has received under the predicted weights so far."""
    return sum(np.floor(p * tokens_per_update) for p in ptraj)


def test_weights_follow_the_methods_prediction_on_a_synthetic_workload():
    cfg = AdaptiveConfig(every_steps=100, reference_loss=dict(zip(SOURCES, REF)), step_size=0.5, smoothing=1e-3)
    cfg.check(SOURCES)
    traj, pred = simulate(cfg, updates=12, tokens_per_update=2e5, w0=np.array([0.6, 0.3, 0.1]))
    np.testing.assert_allclose(traj, pred, rtol=1e-12, atol=1e-15)
    # the source furthest above its reference (math: largest and slowest-falling reducible loss) gains weight,
    # the one closest to it (web) loses
    assert traj[-1][2] > traj[0][2] + 0.3 and traj[-1][0] < traj[0][0] - 0.3
    assert np.allclose(traj.sum(1), 1.0)


def test_bounds_and_the_largest_change_per_update_hold():
    cfg = AdaptiveConfig(every_steps=100, reference_loss=dict(zip(SOURCES, REF)), step_size=2.0, smoothing=0.0,
                         min_weight=0.1, max_weight=0.6, max_change=0.05)
    traj, _ = simulate(cfg, updates=15, tokens_per_update=2e5, w0=np.array([0.6, 0.3, 0.1]))
    assert np.all(traj >= 0.1 - 1e-12) and np.all(traj <= 0.6 + 1e-12)
    assert np.max(np.abs(np.diff(traj, axis=0))) <= 0.05 + 1e-12
    assert np.allclose(traj.sum(1), 1.0)
    assert traj[-1][2] == pytest.approx(0.6)  # math reached its ceiling, 0.05 at a time


def test_missing_reports_change_nothing_and_the_update_is_deterministic():
    cfg = AdaptiveConfig(every_steps=10, reference_loss={"web": 1.0, "code": 1.0, "math": 1.0}, step_size=1.0, smoothing=0.0)
    w = [0.5, 0.3, 0.2]
    assert doremi_step(w, [None, None, None], [1.0, 1.0, 1.0], cfg) == pytest.approx(w)
    # a source without a report keeps no excess: only the others' excess moves the weights
    a = doremi_step(w, [3.0, None, 1.0], [1.0, 1.0, 1.0], cfg)
    e = math.exp(2.0)
    assert a == pytest.approx([0.5 * e / (0.5 * e + 0.5), 0.3 / (0.5 * e + 0.5), 0.2 / (0.5 * e + 0.5)])
    assert doremi_step(w, [3.0, None, 1.0], [1.0, 1.0, 1.0], cfg) == a  # bit for bit
    assert interval_losses([10.0, 5.0], [10, 4], [4.0, 5.0], [4, 4]) == [1.0, None]


def test_configuration_errors_name_the_field():
    for cfg, what in [(AdaptiveConfig(every_steps=0, reference_loss={}), "every_steps"),
                      (AdaptiveConfig(every_steps=1, reference_loss={"zz": 1.0}), "reference_loss.zz: unknown source"),
                      (AdaptiveConfig(every_steps=1, reference_loss={}, min_weight=0.5), "min_weight"),
                      (AdaptiveConfig(every_steps=1, reference_loss={}, max_change=0.0), "max_change")]:
        with pytest.raises(ValueError, match=what):
            cfg.check(SOURCES)
    assert project([0.9, 0.05, 0.05], 0.1, 0.8) == pytest.approx([0.8, 0.1, 0.1])


def test_the_planners_adaptation_follows_the_rule_and_takes_live_updates_as_its_new_start():
    from mixplane.adaptive import AdaptiveState, advance, effective_step
    from mixplane.planner.adaptation import Adaptation

    section = {"every_steps": 10, "delay_steps": 4, "reference_loss": {"web": 1.0, "code": 1.0, "math": 1.0},
               "step_size": 1.0, "smoothing": 0.0}
    mix = {"weights": {"web": 2.0, "code": 1.0, "math": 1.0}, "temperature": 2.0, "adaptive": section}
    a = Adaptation(SOURCES, mix)
    assert a.state == AdaptiveState.start([2.0, 1.0, 1.0]) and a.state.weights == (0.5, 0.25, 0.25)
    assert a.next_update([5.0, 1.0, 1.0], [5, 1, 1], [8], 12) is None  # interval 1 (steps 0..9) not covered yet
    meta, rec = a.next_update([5.0, 1.0, 1.0], [5, 1, 1], [9], 12)
    cfg = AdaptiveConfig.of(section)
    want, losses = advance(AdaptiveState.start([2.0, 1.0, 1.0]), [5.0, 1.0, 1.0], [5, 1, 1], 9, [1.0] * 3, cfg)
    assert rec == {**want.to_json(), "losses": losses, "late": False} and losses == [1.0, 1.0, 1.0]
    assert meta == {"mixture": {**mix, "weights": dict(zip(SOURCES, want.weights))}, "update_id": "adaptive-1",
                    "effective_step": 14}
    assert a.state.k == 0  # the state moves on once applied
    a.applied(rec, meta["mixture"])
    assert a.state == want and a.status() == {"updates": 1, "every_steps": 10, "weights": dict(zip(SOURCES, want.weights))}
    # the next one is late: step 24 was planned already -> the first step not planned
    meta2, rec2 = a.next_update([30.0, 1.0, 1.0], [10, 2, 2], [19], 30)
    assert meta2["effective_step"] == 30 and rec2["late"] and rec2["losses"] == [5.0, 0.0, 0.0]
    assert effective_step(2, cfg, 20) == (24, False) and effective_step(2, AdaptiveConfig.of({**section, "delay_steps": None}), 20) == (20, False)
    # a live update: its weights are where adaptation goes on from, the intervals and loss totals stay
    a.replaced({**mix, "weights": {"web": 1.0, "code": 1.0, "math": 2.0}})
    assert a.state.k == 1 and a.state.weights == (0.25, 0.25, 0.5) and a.state.loss_sum == want.loss_sum
    a.reweighted({"math": 1.5})  # weights only: the others keep theirs, then all normalised
    assert a.state.weights == pytest.approx((0.125, 0.125, 0.75)) and a.state.k == 1
    a.reweighted({"web": 0.0, "code": 0.0, "math": 0.0})  # not a mixture: ignored, not a division by zero
    a.replaced({**mix, "weights": {"web": 0.0}})
    assert a.state.k == 1 and sum(a.state.weights) == pytest.approx(1.0)
    a.replaced({"weights": {"web": 1.0}})  # no adaptive section: adaptation stops
    assert a.state is None and a.status() is None and a.next_update([1.0] * 3, [1] * 3, [100], 101) is None
    assert Adaptation(SOURCES, {"weights": {}}).state is None


def test_an_interval_waits_for_every_reporting_rank_but_a_straggler_holds_it_back_at_most_wait_steps():
    from mixplane.adaptive import covered_through
    from mixplane.planner.adaptation import Adaptation
    from mixplane.planner.losses import SourceLosses
    from mixplane.protocol import LossReport

    assert covered_through([], 4) == -1
    assert covered_through([9], 4) == 9
    assert covered_through([9, 5], 4) == 5  # the slower rank has not covered steps 6..9
    assert covered_through([12, 5], 4) == 8  # the faster is 7 past the slower: the slower holds it back by 4 at most
    assert covered_through([12, 5], 0) == 12  # no waiting: the first report past the interval closes it
    section = {"every_steps": 10, "reference_loss": {"web": 1.0, "code": 1.0, "math": 1.0}, "smoothing": 0.0}
    a = Adaptation(SOURCES, {"weights": {"web": 1.0, "code": 1.0, "math": 1.0}, "adaptive": section})
    losses = SourceLosses(3)
    losses.add(LossReport(0, 0, 9, (9.0, 1.0, 1.0), (3, 1, 1)))  # rank 0 reported the whole interval
    losses.add(LossReport(1, 0, 4, (1.0, 1.0, 1.0), (1, 1, 1)))  # rank 1 only its first half
    assert losses.rank_through() == {0: 9, 1: 4} and losses.status()["ranks"] == {"0": 9, "1": 4}

    def nxt():
        return a.next_update(losses.loss_sum.tolist(), losses.tokens.tolist(), losses.rank_through().values(), 30)

    assert nxt() is None  # waits for rank 1
    losses.add(LossReport(1, 5, 9, (5.0, 1.0, 1.0), (1, 1, 1)))
    meta, rec = nxt()  # both covered it: the interval's losses are both ranks'
    assert rec["k"] == 1 and rec["losses"] == [15.0 / 5, 3.0 / 3, 3.0 / 3]
    a.applied(rec, meta["mixture"])
    # interval 2 (steps 10..19): rank 1 stops reporting; rank 0 goes on, the update comes once it is 10 steps past
    losses.add(LossReport(0, 10, 28, (2.0, 2.0, 2.0), (2, 2, 2)))
    assert nxt() is None  # 28 - 10 = 18 < 19
    losses.add(LossReport(0, 29, 29, (1.0, 1.0, 1.0), (1, 1, 1)))
    meta2, rec2 = nxt()
    assert rec2["k"] == 2 and rec2["losses"] == [1.0, 1.0, 1.0]
    assert AdaptiveConfig.of({**section, "wait_steps": -1}).problems(SOURCES) == [("wait_steps", "wait_steps must be >= 0, got -1")]

"""Rewinding the planner: bad cursors change nothing, runtime mixture updates survive a rewind,
and a source without weight does not hold a step back."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from mixplane.planner.core import StepPlanner
from tests.unit.test_planner_core import fill, make_spec, run


def layouts_equal(a, b) -> bool:
    return all(np.array_equal(getattr(a.layout, n), getattr(b.layout, n))
               for n in ("seg_row", "seg_source", "seg_key", "seg_start", "seg_len")) and a.layout.phase == b.layout.phase


@pytest.mark.parametrize("damage", [
    lambda c: c.pop("sampler"),
    lambda c: c["sampler"].update(realized=[1.0]),  # wrong number of sources
    lambda c: c["windows"][0].update(partial=[1, 2]),  # not a mapping
    lambda c: c["windows"][1].update(low=-5),
    lambda c: c["schedule"].update(segments=[]),
    lambda c: c["windows"].pop(),
    lambda c: c.update(step="x"),
])
def test_a_bad_cursor_changes_nothing(damage):
    p = StepPlanner(make_spec())
    run(p, 3)
    good = p.cursor()
    bad = copy.deepcopy(good)
    damage(bad)
    with pytest.raises(ValueError):
        p.restore(bad)
    assert p.cursor() == good  # untouched
    p.restore(good)  # and still usable


def test_runtime_update_newer_than_the_cursor_survives_a_rewind():
    full = StepPlanner(make_spec())
    run(full, 3)
    cursor = full.cursor()  # before step 3
    full.update_mixture({"b": 5.0}, effective_step=4, generation=1)
    ref = run(full, 3)  # steps 3, 4, 5 with the update from 4

    # the live planner got the update for step 4 (generation 1) after planning step 3; a client rewinds to step 3
    live = StepPlanner(make_spec())
    run(live, 4)
    live.update_mixture({"b": 5.0}, effective_step=4, generation=1)
    kept = live.restore(cursor, keep_updates=True)
    assert [e["effective_step"] for e in kept] == [4] and live.next_step == 3
    got = run(live, 3)
    assert all(layouts_equal(a, b) for a, b in zip(ref, got))
    # without keep_updates the rewind would plan with the old weights from step 4 on
    plain = StepPlanner(make_spec())
    run(plain, 4)
    plain.update_mixture({"b": 5.0}, effective_step=4, generation=1)
    plain.restore(cursor)
    old = run(plain, 3)
    assert not layouts_equal(ref[1], old[1])


def test_a_source_without_weight_does_not_hold_the_step_back():
    spec = make_spec()
    p = StepPlanner(spec)
    p.update_mixture({"c": 0.0}, effective_step=0, generation=1)
    for w in p.windows:  # fill every window but c's
        if w.source != 2:
            pos = w.next_pos
            while not w.ready:
                w.add(np.array([pos]), np.array([pos]), np.array([50]), np.zeros(1, np.int64))
                pos += 1
    assert p.ready and not p.window(2, 0).ready
    plan = p.plan()
    assert 2 not in set(plan.layout.seg_source.tolist())

"""The planner's decisions produce exactly the recorded outputs (tests/unit/planner_goldens.py says how they were
recorded and what each case observes): the compiled pick-and-place loop, whole plans through re-mixes, failed
strategies and restores, single windows under valid and refused adds."""

from __future__ import annotations

import json

import pytest

from tests.unit.planner_goldens import CASES, RECORD, run_case

with open(RECORD) as _f:
    RECORDED = json.load(_f)


def test_every_case_was_recorded():
    assert sorted(RECORDED) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_outputs_equal_the_recorded_ones(name):
    got, want = run_case(name), RECORDED[name]
    assert got["first"] == want["first"], name
    assert got["n"] == want["n"], name
    assert got["sha256"] == want["sha256"], f"{name}: the planner's output changed (see tests/unit/planner_goldens.py)"

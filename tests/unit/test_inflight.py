"""The planner's record of steps a restarted loader must send again (planner.inflight)."""

from __future__ import annotations

import numpy as np
import pytest

from mixplane.planner.inflight import InFlight
from mixplane.planner.routing import Instructions


def ins(*pos: int) -> Instructions:
    n = len(pos)
    z = np.zeros(n, np.int64)
    return Instructions(np.array(pos, np.int64), z, z + 5, np.zeros(n, np.int32), np.zeros(n, np.uint8), np.zeros(n, np.uint8))


def test_keeps_steps_until_every_constructor_has_them():
    f = InFlight(max_steps=10)
    f.record(0, {(0, 0): ins(3, 4), (1, 0): ins(9)})
    f.record(1, {(1, 0): ins(10)})
    f.record(2, {(0, 0): ins(7), (1, 0): ins()})
    assert [s for s, _ in f.for_loader((0, 0))] == [0, 2]
    assert [s for s, _ in f.for_loader((1, 0))] == [0, 1]  # a step with nothing for it is not resent
    assert InFlight.low_position(f.for_loader((0, 0))) == 3
    f.release(0)
    assert [s for s, _ in f.for_loader((0, 0))] == [2]
    assert InFlight.low_position(f.for_loader((0, 0))) == 7
    f.release(2)
    assert f.for_loader((0, 0)) == [] and f.for_loader((1, 0)) == []
    assert f.overflowed == 0


def test_bounded_and_ordered():
    f = InFlight(max_steps=2)
    for s in range(4):
        f.record(s, {(0, 0): ins(s)})
    assert [s for s, _ in f.for_loader((0, 0))] == [2, 3]
    assert f.overflowed == 2
    with pytest.raises(ValueError, match="step 3 recorded after step 3"):
        f.record(3, {})
    f.clear()
    assert f.for_loader((0, 0)) == []

"""Each compiled kernel's inputs are defined once, as a NamedTuple its Python wrapper builds and splats: the kernel's
parameters must be the tuple's fields, in order, or a column added to one and not the other would shift every
argument after it silently."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from mixplane.planner import layoutloop, routeloop, selectloop


@pytest.mark.parametrize(("kernel", "inputs"), [
    (selectloop._loop, selectloop.LoopInput),
    (routeloop._route, routeloop.RouteInput),
    (layoutloop.gather, layoutloop.GatherInput),
])
def test_a_kernels_parameters_are_its_input_tuples_fields_in_order(kernel, inputs):
    params = list(inspect.signature(kernel.py_func).parameters)
    assert params == list(inputs._fields)


def test_the_wrappers_call_the_kernels_through_their_tuples():
    # a mismatch in arity would raise here; goldens (test_planner_goldens) hold the outputs byte for byte
    cand, row, start, length = selectloop.run(
        np.array([5, 3], np.int64), np.zeros(2, np.int64), np.array([0, 1, 2], np.int64), np.array([0.5, 0.5]),
        np.zeros(2), 5.0, 2.5, 2.5, unit_samples=False, truncate=False, seq_len=4, rows=2, policy="best_fit")
    assert int(length.sum()) == 8 and set(row.tolist()) == {0, 1}
    cols, o_img = layoutloop.gather_columns(np.array([1, 0], np.int64), np.array([1, 0], np.int64),
                                            np.array([0, 1], np.int16), np.array([7, 9], np.int64),
                                            np.zeros(2, np.int64), np.array([3, 4], np.int64),
                                            np.array([0, 2], np.int64), np.array([5], np.int64))
    assert cols["seg_key"].tolist() == [9, 7] and o_img.tolist() == [1] and cols["img_rank"].tolist() == [5]

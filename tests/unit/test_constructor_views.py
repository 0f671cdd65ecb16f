"""The constructor builds one batch per data-parallel rank per step and derives every CP / PP / TP
view from it: ranks with the same view key get the very same view object (same buffers)."""

from __future__ import annotations

import numpy as np
import zmq

from mixplane import wire
from mixplane.constructor.collate import SpanStore
from mixplane.constructor.server import ConstructorServer, StepState
from mixplane.layout import StepLayout
from mixplane.spec import parse_spec
from mixplane.wire import Kind


def _spec():
    return parse_spec({"name": "views", "batch": {"sequences": 2, "seq_len": 8},
                       "sources": [{"name": "s", "uri": "/nonexistent/s", "kind": "tokens"}],
                       "topology": {"modules": {"backbone": {"dp": 1, "pp": 3, "tp": 2}}},
                       "runtime": {"metrics": False}})


def _step(broadcast: tuple[str, ...]) -> StepState:
    lay = StepLayout(step=0, seq_len=8, dp=1, microbatches=1, rows_per_microbatch=2, seg_row=np.array([0, 1]),
                     seg_source=np.array([0, 0]), seg_key=np.array([5, 6]), seg_start=np.array([0, 0]),
                     seg_len=np.array([8, 5]))
    st = StepState()
    st.spans.add(0, np.array([5, 6]), np.array([0, 0]), np.array([0, 9, 15]), np.arange(15, dtype=np.int32))
    st.expect(lay, list(range(6)))
    st.broadcast = broadcast
    assert st.complete
    return st


def _built(cons: ConstructorServer) -> float:
    return cons.m.registry.get_sample_value("mixplane_constructor_steps_total")


def test_one_build_per_step_and_shared_views():
    ctx = zmq.Context()
    cons = ConstructorServer(_spec(), 0, "tcp://127.0.0.1:9", context=ctx, metrics_port=None)
    try:
        cons.on_planner(wire.Message(Kind.WELCOME, {"ranks": list(range(6)), "dp_ranks": [0], "session": 0, "start_step": 0}))
        for broadcast in ((), ("TP",)):
            st = _step(broadcast)
            before = _built(cons)
            views = {r: cons._view_for(st, r) for r in range(6)}  # rank = tp + 2 * pp
            assert _built(cons) - before == 1  # one batch for six ranks
            first, middle, last = views[0], views[2], views[4]
            assert "input_ids" in first and "labels" not in first
            assert "labels" in last and "input_ids" not in last
            assert not any(isinstance(v, np.ndarray) and v.ndim == 2 for v in middle.values())  # metadata only
            batch = st.batches[0]
            assert np.shares_memory(first["input_ids"], batch["input_ids"])  # a view of the batch, not a copy
            for pp in range(3):
                tp0, tp1 = views[2 * pp], views[2 * pp + 1]
                if broadcast:
                    assert tp1.get("meta_only") and not any(isinstance(v, np.ndarray) for v in tp1.values())
                else:
                    assert tp1 is tp0  # TP peers share one view object
            assert len(st.views) == (6 if broadcast else 3)
            assert cons._view_for(st, 3) is views[3] and _built(cons) - before == 1  # asked again: nothing rebuilt
    finally:
        cons.close()
        ctx.destroy(linger=0)

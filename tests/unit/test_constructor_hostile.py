"""Hostile but well-formed messages: SAMPLES for steps that will never be planned are refused (they
would never be freed), counted and logged; the planner ignores window and pacing messages from peers
that are not the registered loader / constructor."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zmq

from mixplane import wire
from mixplane.constructor.server import ConstructorServer
from mixplane.planner.server import PlannerServer
from mixplane.spec import parse_spec
from mixplane.wire import Kind, WireError

LEAD = 4


@pytest.fixture()
def spec(tmp_path):
    rows = [list(range(1, 1 + n)) for n in range(3, 40)]
    pq.write_table(pa.table({"tokens": pa.array(rows, type=pa.list_(pa.int32()))}), tmp_path / "s.parquet")
    return parse_spec({"name": "hostile", "batch": {"sequences": 2, "seq_len": 32},
                       "sources": [{"name": "s", "uri": str(tmp_path / "s.parquet"), "kind": "tokens", "columns": ["tokens"]}],
                       "topology": {"modules": {"backbone": {"dp": 1}}},
                       "runtime": {"metrics": False, "max_lead_steps": LEAD}})


def _samples(step: int, session: int = 0) -> wire.Message:
    vals = np.arange(5, dtype=np.int32)
    return wire.Message(Kind.SAMPLES, {"session": session, "step": step, "source": 0, "replica": 0},
                        {"key": np.array([7], np.int64), "start": np.zeros(1, np.int64), "len": np.array([5], np.int64),
                         "offsets": np.array([0, 5], np.int64), "values": vals},
                        wire.FLAG_CHECKSUM | wire.FLAG_END)  # as decoded from a checksummed payload


def test_samples_beyond_the_planned_horizon_are_refused(spec):
    ctx = zmq.Context()
    cons = ConstructorServer(spec, 0, "tcp://127.0.0.1:9", context=ctx, metrics_port=None)
    try:
        cons.on_planner(wire.Message(Kind.WELCOME, {"ranks": [0], "dp_ranks": [0], "session": 0, "start_step": 10}))
        assert cons.sample_horizon == 9 + LEAD
        cons.on_samples(_samples(10 + LEAD - 1))  # within the horizon: kept until planned
        assert list(cons.steps) == [10 + LEAD - 1]
        for step in (10 + LEAD, 2**40):
            with pytest.raises(WireError, match="beyond the planned horizon"):
                cons.on_samples(_samples(step))
        cons.on_samples(_samples(3))  # before the session's first step: ignored
        cons.on_samples(_samples(11, session=5))  # another session: ignored
        assert list(cons.steps) == [10 + LEAD - 1]
        cons.asked_through = 30  # a client asked further: the horizon follows
        cons.on_samples(_samples(30 + LEAD))
        assert 30 + LEAD in cons.steps
    finally:
        cons.close()
        ctx.destroy(linger=0)


def test_refused_samples_are_counted_on_the_wire(spec):
    ctx = zmq.Context()
    cons = ConstructorServer(spec, 0, "tcp://127.0.0.1:9", context=ctx, metrics_port=None)
    cons.on_planner(wire.Message(Kind.WELCOME, {"ranks": [0], "dp_ranks": [0], "session": 0, "start_step": 0}))
    cons.welcomed = True
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    push.connect(cons.data_endpoint)
    try:
        for step in (10**6, 10**6 + 1, 2):
            m = _samples(step)
            wire.send(push, Kind.SAMPLES, m.meta, m.arrays)
        cons.run(max_seconds=1.0)
        bad = cons.m.registry.get_sample_value("mixplane_wire_bad_messages_total", {"component": "constructor", "reason": "content"})
        assert bad == 2 and list(cons.steps) == [2]
    finally:
        push.close(0)
        ctx.destroy(linger=0)


def test_planner_ignores_window_and_pacing_messages_from_strangers(spec):
    ctx = zmq.Context()
    planner = PlannerServer(spec, "tcp://127.0.0.1:0", context=ctx, metrics_port=None)
    try:
        with pytest.raises(WireError, match="not a registered constructor"):
            planner.handle(b"stranger", wire.Message(Kind.NEED_STEPS, {"session": 0, "through": -10**9}))
        assert planner.need_through == -1 and not planner.need_by
        meta = wire.Message(Kind.LOADER_META, {"session": 0, "source": 0, "replica": 0},
                            {"pos": np.zeros(1, np.int64), "key": np.zeros(1, np.int64), "tokens": np.ones(1, np.int64),
                             "patches": np.zeros(1, np.int64)})
        with pytest.raises(WireError, match="not its loader"):
            planner.handle(b"stranger", meta)
        assert len(planner.core.window(0, 0)) == 0
    finally:
        planner.close()
        ctx.destroy(linger=0)


def test_a_request_before_the_welcome_waits_and_is_answered_with_a_retry(spec):
    """A restarted constructor does not know its ranks until the planner's WELCOME: a rank's request that reaches it
    first waits (it used to be refused: 'does not serve rank 0 (serves [])', a DeliveryError in the trainer) and the
    WELCOME answers it with a retry, so the client asks again."""
    ctx = zmq.Context()
    cons = ConstructorServer(spec, 0, "tcp://127.0.0.1:9", context=ctx, metrics_port=None)
    client = ctx.socket(zmq.DEALER)
    try:
        client.connect(cons.client_endpoint)
        wire.send(client, Kind.GET_STEP, {"step": 12, "rank": 0, "ahead": 2})
        deadline = time.monotonic() + 5
        while not cons.pending and time.monotonic() < deadline:
            cons.drain(cons.entry("client"))
        assert [(p[1], p[2]) for p in cons.pending] == [(12, 0)]
        assert not client.poll(200), "answered before the WELCOME"
        cons.on_planner(wire.Message(Kind.WELCOME, {"ranks": [0], "dp_ranks": [0], "session": 0, "start_step": 10,
                                                    "planned_through": 11}))
        assert client.poll(5000)
        _, msg = wire.recv(client)
        assert msg.kind == Kind.ERROR and msg.meta.get("retry") is True and msg.meta.get("step") == 12, msg.meta
        wire.send(client, Kind.GET_STEP, {"step": 12, "rank": 0, "ahead": 2})  # asked again: now a request it keeps
        deadline = time.monotonic() + 5
        while not cons.pending and time.monotonic() < deadline:
            cons.drain(cons.entry("client"))
        assert [(p[1], p[2]) for p in cons.pending] == [(12, 0)] and cons.last_request == {0: 12}
    finally:
        client.close(0)
        cons.close()
        ctx.destroy(linger=0)

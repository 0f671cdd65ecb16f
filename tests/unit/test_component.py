"""The component base: bounded logs, membership, routed sends that survive departed peers, role checks."""

from __future__ import annotations

import logging
import time

import pytest
import zmq

from mixplane import protocol, wire
from mixplane.component import Membership, RateLimitedLog, peer_name
from mixplane.constructor.server import ConstructorServer
from mixplane.planner.server import PlannerServer
from mixplane.spec import parse_spec
from mixplane.wire import Kind
from tests.conftest import token_mixture


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_rate_limited_log_bounds_lines_and_says_how_many_were_suppressed(caplog):
    clock = _Clock()
    lim = RateLimitedLog(logging.getLogger("t.rl"), every_s=10, burst=3, clock=clock)
    with caplog.at_level(logging.WARNING, "t.rl"):
        written = [lim.log(logging.WARNING, "k", "bad %d", i) for i in range(1000)]
        assert sum(written) == 3
        assert lim.log(logging.WARNING, "other", "another key")  # keys are limited separately
        clock.t = 10.0
        assert lim.log(logging.WARNING, "k", "bad again")
    assert len(caplog.records) == 5
    assert "997 similar lines suppressed" in caplog.records[-1].getMessage()


def test_membership_tracks_last_seen_and_stays_bounded():
    clock = _Clock()
    m = Membership(clock, max_peers=3)
    m.seen("loader:a:0", "component")
    clock.t = 5.0
    m.seen("constructor:0")
    assert m.silent_for("loader:a:0") == 5.0
    st = m.status()
    assert st["loader:a:0"] == {"role": "component", "last_seen_s": 5.0, "messages": 1}
    for i in range(10):  # a flood of one-shot peers evicts the longest silent, never grows past the bound
        m.seen(f"stranger{i}")
    assert len(m.peers) == 3 and "loader:a:0" not in m.peers
    assert peer_name(b"\x00\x80\x01") == "0x008001" and peer_name(b"loader:a:0") == "loader:a:0"


@pytest.fixture
def spec(token_sources):
    return parse_spec(token_mixture(token_sources["root"], runtime={"metrics": False}))


def _refused(server, kind: str, role: str) -> float:
    v = server.m.registry.get_sample_value("mixplane_wire_refused_total",
                                           {"component": server.component, "kind": kind, "role": role})
    return v or 0.0


def _pump(server, until, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    e = server.entry("planner")
    while time.monotonic() < deadline and not until():
        if e.sock.poll(50):
            server.drain(e)


def test_heartbeat_to_a_constructor_from_a_vanished_dealer_is_counted_not_fatal(spec):
    """issue 10 item 1: the reproduced crash (ROUTER_MANDATORY EHOSTUNREACH on the reply)."""
    ctx = zmq.Context()
    planner = PlannerServer(spec, "tcp://127.0.0.1:0", context=ctx, metrics_port=None)
    cons = ConstructorServer(spec, 0, planner.endpoint, context=ctx, metrics_port=None)
    try:
        for _ in range(20):
            s = ctx.socket(zmq.DEALER)
            s.connect(cons.client_endpoint)
            wire.send(s, Kind.HEARTBEAT, {})
            s.close(0)
        cons.run(max_seconds=1.0)  # would raise ZMQError: Host unreachable before
        assert not cons.stopped
        # a reply to an identity the ROUTER never saw fails inside send_routed: False, counted
        assert cons.send_routed(cons.clients, b"gone", Kind.HEARTBEAT, {}) is False
        und = cons.m.registry.get_sample_value("mixplane_wire_bad_messages_total",
                                               {"component": "constructor", "reason": "undeliverable"})
        assert und >= 1
    finally:
        planner.close()
        ctx.destroy(0)


def test_anonymous_control_is_refused_unless_the_run_is_open(spec):
    ctx = zmq.Context()
    planner = PlannerServer(spec, "tcp://127.0.0.1:0", context=ctx, metrics_port=None)
    planner.open_run = False  # runtime.security: secure without CURVE: every peer is anonymous
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(planner.endpoint)
    try:
        wire.send(s, Kind.UPDATE_MIXTURE, {"weights": {"a": 1.0, "b": 0.0, "c": 0.0}, "effective_step": 0})
        wire.send(s, Kind.RESUME, {"cursor": planner.core.cursor()})
        wire.send(s, Kind.SHUTDOWN, {})
        wire.send(s, Kind.STATUS, {})  # not a control kind: answered
        _pump(planner, lambda: _refused(planner, "SHUTDOWN", "anonymous") >= 1)
        for kind in ("UPDATE_MIXTURE", "RESUME", "SHUTDOWN"):
            assert _refused(planner, kind, "anonymous") == 1, kind
        assert not planner.stopped and planner.generation == 0 and planner.session == 0
        _pump(planner, lambda: bool(s.poll(0)))  # the STATUS may arrive in a later drain than the refused kinds
        assert s.poll(2000)
        _, reply = wire.recv(s)
        assert reply.kind == Kind.STATUS_REPLY and "peers" in reply.meta
        planner.open_run = True  # runtime.security: open: the same SHUTDOWN is obeyed
        wire.send(s, Kind.SHUTDOWN, {})
        _pump(planner, lambda: planner.stopped)
        assert planner.stopped
    finally:
        s.close(0)
        planner.close()
        ctx.destroy(0)


def test_curve_roles_a_client_key_cannot_control_an_admin_key_can(spec, tmp_path):
    keys = tmp_path / "keys"
    wire.ensure_keys(keys, ("server", "client", "admin"))
    spec = spec.model_copy(update={"runtime": spec.runtime.model_copy(update={
        "curve": spec.runtime.curve.model_copy(update={"enabled": True, "key_dir": str(keys)})})})
    ctx = zmq.Context()
    planner = PlannerServer(spec, "tcp://127.0.0.1:0", context=ctx, metrics_port=None)
    server_pub = wire.load_public_key(keys, "server")

    def peer(name: str) -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        wire.curve_client(s, wire.load_keys(keys, name), server_pub)
        s.connect(planner.endpoint)
        return s

    trainer, admin = peer("client"), peer("admin")
    try:
        wire.send(trainer, Kind.UPDATE_MIXTURE, {"weights": {"a": 1.0, "b": 0.0, "c": 0.0}, "effective_step": 0})
        wire.send(trainer, Kind.SHUTDOWN, {})
        wire.send(trainer, Kind.HELLO, {"role": "loader", "source": 0, "replica": 0})  # a client posing as a loader
        _pump(planner, lambda: _refused(planner, "HELLO", "client") >= 1)
        assert _refused(planner, "UPDATE_MIXTURE", "client") == 1 and _refused(planner, "SHUTDOWN", "client") == 1
        assert not planner.stopped and planner.generation == 0 and not planner.loaders
        assert not planner.members.peers  # refused messages do not make a member
        wire.send(admin, Kind.UPDATE_MIXTURE, {"weights": {"a": 0.2, "b": 0.4, "c": 0.4}, "effective_step": 0})
        _pump(planner, lambda: planner.generation == 1)
        assert planner.generation == 1
        assert [p.role for p in planner.members.peers.values()] == [protocol.ADMIN]  # the ZAP User-Id
        wire.send(admin, Kind.SHUTDOWN, {})
        _pump(planner, lambda: planner.stopped)
        assert planner.stopped
    finally:
        trainer.close(0)
        admin.close(0)
        planner.close()
        ctx.destroy(0)


def test_planner_reports_a_registered_constructor_that_stops_talking(spec):
    """Application liveness: beats every interval (<= 1 s); a peer silent past 3 intervals is named in
    STATUS and counted, and leaves the list when it talks again."""
    spec = spec.model_copy(update={"runtime": spec.runtime.model_copy(update={"heartbeat_s": 0.2})})
    ctx = zmq.Context()
    planner = PlannerServer(spec, "tcp://127.0.0.1:0", context=ctx, metrics_port=None)
    fake = ctx.socket(zmq.DEALER)
    fake.setsockopt(zmq.IDENTITY, b"constructor:0")
    fake.setsockopt(zmq.LINGER, 0)
    fake.connect(planner.endpoint)
    e = planner.entry("planner")

    def turn(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if e.sock.poll(20):
                planner.drain(e)
            planner.on_liveness(time.monotonic())

    try:
        wire.send(fake, Kind.HELLO, {"role": "constructor", "index": 0, "data_endpoint": "tcp://127.0.0.1:1",
                                     "client_endpoint": "tcp://127.0.0.1:2"})
        turn(0.3)
        assert 0 in planner.constructors and planner.status()["silent"] == {}
        turn(1.2)  # 3 missed beats of 0.2 s
        assert list(planner.status()["silent"]) == ["constructor:0"]
        assert planner.m.registry.get_sample_value("mixplane_liveness_detections_total",
                                                   {"component": "planner", "peer": "constructor:0"}) == 1
        beats = 0
        while fake.poll(0):
            _, m = wire.recv(fake)
            beats += m.kind == Kind.HEARTBEAT
        assert beats >= 4  # the planner beat to its constructor every interval
        wire.send(fake, Kind.HEARTBEAT, {})
        turn(0.3)
        assert planner.status()["silent"] == {}
    finally:
        fake.close(0)
        planner.close()
        ctx.destroy(0)


def test_pre_encoded_frames_reach_the_peer_as_the_message_and_a_gone_peer_is_counted(spec):
    """send_routed(frames=...) (the planner's batch-encoded plans): the peer decodes the message
    wire.encode would have sent; a departed identity is undeliverable (False, counted), never raised."""
    import numpy as np
    ctx = zmq.Context()
    planner = PlannerServer(spec, "tcp://127.0.0.1:0", context=ctx, metrics_port=None)
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.IDENTITY, b"peer-1")
    try:
        peer.connect(planner.endpoint)
        wire.send(peer, Kind.HEARTBEAT, {})
        _pump(planner, lambda: False, 0.5)  # the ROUTER learns the identity
        arrays = {"pos": np.arange(5, dtype=np.int64), "big": np.arange(40_000, dtype=np.int32)}  # one zero-copy size
        frames = wire.encode_columns(Kind.PLAN_LOADER, [{"step": 3}], [wire.Column(n, a, [0, len(a)]) for n, a in arrays.items()])[0]
        assert planner.send_routed(planner.sock, b"peer-1", Kind.PLAN_LOADER, {"step": 3}, frames=frames) is True
        assert peer.poll(5000)
        msg = wire.decode(peer.recv_multipart())
        assert msg.kind == Kind.PLAN_LOADER and msg.meta == {"step": 3}
        assert all(np.array_equal(msg.arrays[n], a) for n, a in arrays.items())
        assert planner.send_routed(planner.sock, b"gone", Kind.PLAN_LOADER, {"step": 3}, frames=frames) is False
        und = planner.m.registry.get_sample_value("mixplane_wire_bad_messages_total",
                                                  {"component": "planner", "reason": "undeliverable"})
        assert und >= 1
    finally:
        peer.close(0)
        planner.close()
        ctx.destroy(0)


def test_a_burst_of_one_hosts_queued_hellos_registers_it_once(spec):
    """HELLOs a loader host queued while the planner was unreachable arrive at once: the same process (same
    incarnation) is registered once, its partitions keep their epoch; a restarted process (a new incarnation under
    the same name) registers again and its partitions move to it under a new epoch."""
    spec = spec.model_copy(update={"runtime": spec.runtime.model_copy(update={"heartbeat_s": 0.2})})
    ctx = zmq.Context()
    planner = PlannerServer(spec, "tcp://127.0.0.1:0", context=ctx, metrics_port=None)
    host = ctx.socket(zmq.DEALER)
    host.setsockopt(zmq.IDENTITY, protocol.host_identity("loader-a").encode())
    host.connect(planner.endpoint)
    try:
        hello = {"role": "host", "host": "loader-a", "partitions": [[0, 0]], "serving": [], "shadow": False}
        for _ in range(12):  # the burst
            wire.send(host, Kind.HELLO, {**hello, "incarnation": "p1"})
        _pump(planner, lambda: False, 1.0)
        key = (0, 0)
        assert planner.hosting.partitions.parts[key].host == "loader-a"
        first = planner.hosting.partitions.epoch(key)
        got = []
        while host.poll(200):
            got.append(wire.recv(host)[1].kind)
        assert got.count(Kind.WELCOME) == 12 and got.count(Kind.ADOPT) == 1, got
        # the registered host hears the planner's beats (it watches the planner on this socket)
        e = planner.entry("planner")
        deadline = time.monotonic() + 0.7
        while time.monotonic() < deadline:
            if e.sock.poll(20):
                planner.drain(e)
            planner.on_liveness(time.monotonic())
        beats = 0
        while host.poll(100):
            beats += wire.recv(host)[1].kind == Kind.HEARTBEAT
        assert beats >= 2, beats
        wire.send(host, Kind.HELLO, {**hello, "incarnation": "p2"})  # the process restarted under the same name
        _pump(planner, lambda: planner.hosting.partitions.epoch(key) != first, 2.0)
        assert planner.hosting.partitions.epoch(key) == first + 1
    finally:
        host.close(0)
        planner.close()
        ctx.destroy(0)

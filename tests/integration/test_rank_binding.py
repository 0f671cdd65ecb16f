"""Rank claims bound to keys (issue 10): the embedded runtime generates one client key per trainer rank
(`client-r<rank>`); a rank's route, batches and resume go only to the holder of that rank's key. A
trainer holding another rank's key, or the shared `client` key, is refused (answered with an ERROR,
counted in mixplane_wire_refused_total) and cannot take or advance another rank's steps: the real
trainers' batches stay identical to a run without the impostor."""

from __future__ import annotations

import stat
import time
import urllib.request

import numpy as np
import pytest
import zmq

from mixplane import protocol, wire
from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from mixplane.wire import Kind
from tests.conftest import token_mixture
from tests.integration.test_runtime import fetch

pytestmark = pytest.mark.timeout(300)
STEPS = 6


def _metric(port: int, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()))


def _peer(ctx: zmq.Context, keys, name: str, endpoint: str) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    wire.curve_client(s, wire.load_keys(keys, name), wire.load_public_key(keys, "server"))
    s.connect(endpoint)
    return s


def _ask(s: zmq.Socket, kind: Kind, meta: dict) -> wire.Message:
    wire.send(s, kind, meta)
    _, msg = wire.recv_timeout(s, 30, what=kind.name)
    return msg


def test_rank_names_and_claims_are_pure():
    assert wire.ranks_of_key_name("client-r3") == (3, 3)
    assert wire.ranks_of_key_name("client-r0-7") == (0, 7)
    assert wire.ranks_of_key_name("client") is None and wire.ranks_of_key_name("client-rx") is None
    assert protocol.parse_user_id("client:3-3") == ("client", (3, 3))
    assert protocol.parse_user_id("client") == ("client", None)
    assert protocol.parse_user_id("admin") == ("admin", None)
    assert protocol.parse_user_id("client:x") == ("client", (0, -1))  # malformed: bound to nothing
    assert protocol.parse_user_id("root:1-2") == ("client", (1, 2))  # unknown role: no control rights
    ok = protocol.rank_claim_ok
    assert ok(Kind.GET_STEP, {"rank": 3}, "client", (3, 3), required=True)
    assert not ok(Kind.GET_STEP, {"rank": 2}, "client", (3, 3), required=False)  # bound keys are always checked
    assert ok(Kind.GET_STEP, {"rank": 5}, "client", (0, 7), required=True)
    assert not ok(Kind.GET_STEP, {"rank": 0}, "client", None, required=True)
    assert ok(Kind.GET_STEP, {"rank": 0}, "client", None, required=False)  # rank_binding off / no rank keys
    assert not ok(Kind.RESUME, {"cursor": {}}, "client", (3, 3), required=True)  # a bound client's resume names its rank
    assert ok(Kind.RESUME, {"cursor": {}}, "admin", None, required=True)
    assert ok(Kind.ROUTE, {"coords": {"dp": 0}}, "client", (3, 3), required=True)  # the GET_STEPs are checked
    assert not ok(Kind.ROUTE, {"rank": True}, "client", (1, 1), required=True)  # a bool is not a rank
    assert ok(Kind.STATUS, {}, "client", None, required=True)


def test_a_client_key_gets_only_its_own_ranks_batches(token_sources, tmp_path):
    spec = parse_spec(token_mixture(token_sources["root"], runtime={"window": 64, "metrics": True}))
    assert spec.runtime.rank_binding == "auto" and spec.world_size == 2
    with EmbeddedRuntime(spec, tmp_path / "clean") as rt:
        ref = fetch(rt.planner_endpoint, 2, STEPS)
    with EmbeddedRuntime(spec, tmp_path / "run") as rt:
        keys = rt.key_dir
        assert keys is not None
        for r in (0, 1):  # one key pair per rank, secret 0600 in the 0700 key dir
            assert stat.S_IMODE((keys / f"client-r{r}.key_secret").stat().st_mode) == 0o600
        comps = rt.endpoints()["components"]
        ports = {n: c["metrics_port"] for n, c in comps.items() if n == "planner" or n.startswith("constructor")}
        ctx = zmq.Context()
        try:
            # rank 1's key: its own route is answered, rank 0's is refused with the reason
            r1 = _peer(ctx, keys, "client-r1", rt.planner_endpoint)
            own = _ask(r1, Kind.ROUTE, {"rank": 1})
            assert own.kind == Kind.ROUTE_REPLY
            other = _ask(r1, Kind.ROUTE, {"rank": 0})
            assert other.kind == Kind.ERROR and "bound to ranks 1..1" in other.meta["error"]
            # ... and so are a resume in rank 0's name, and one that names no rank
            for meta in ({"cursor": {"step": 0}, "rank": 0}, {"cursor": {"step": 0}}):
                assert _ask(r1, Kind.RESUME, meta).kind == Kind.ERROR
            # rank 0's constructor (found with rank 0's own key) refuses rank 0's steps to rank 1's key and to
            # the shared client key, so neither can take them nor move rank 0's delivery state forward
            r0 = _peer(ctx, keys, "client-r0", rt.planner_endpoint)
            ep0 = _ask(r0, Kind.ROUTE, {"rank": 0}).get("endpoint", str)
            thief = _peer(ctx, keys, "client-r1", ep0)
            shared = _peer(ctx, keys, "client", ep0)
            for step in range(STEPS + 2):
                m = _ask(thief, Kind.GET_STEP, {"step": step, "rank": 0})
                assert m.kind == Kind.ERROR and "rank 0 refused" in m.meta["error"], m.meta
                m = _ask(shared, Kind.GET_STEP, {"step": step, "rank": 0})
                assert m.kind == Kind.ERROR and "requires rank-bound keys" in m.meta["error"], m.meta
            # the real trainers (each with its own rank's key, found through the exported key dir) get
            # exactly the batches of the run without the impostors
            got = fetch(rt.planner_endpoint, 2, STEPS)
            time.sleep(0.5)
            refused_route = _metric(ports["planner"], "mixplane_wire_refused_total", kind="ROUTE", role="client")
            refused_resume = _metric(ports["planner"], "mixplane_wire_refused_total", kind="RESUME", role="client")
            refused_steps = sum(_metric(p, "mixplane_wire_refused_total", kind="GET_STEP", role="client")
                                for n, p in ports.items() if n.startswith("constructor"))
        finally:
            ctx.destroy(linger=0)
        assert not rt.dead(), rt.dead()
    assert refused_route == 1 and refused_resume == 2 and refused_steps == 2 * (STEPS + 2)
    for r in (0, 1):
        assert [int(b["step"]) for b in got[r]] == list(range(STEPS))
        for a, b in zip(ref[r], got[r]):
            assert a.keys() == b.keys()
            for k in a:
                assert np.array_equal(a[k], b[k]), (r, k)


def test_rank_binding_off_lets_the_shared_key_claim_any_rank(token_sources, tmp_path):
    """`runtime.rank_binding: off` (and a key dir without rank keys, under auto): the old trust model."""
    spec = parse_spec(token_mixture(token_sources["root"], runtime={"window": 64, "rank_binding": "off"}))
    with EmbeddedRuntime(spec, tmp_path / "run") as rt:
        assert rt.key_dir is not None and not wire.has_rank_keys(rt.key_dir)
        ctx = zmq.Context()
        try:
            s = _peer(ctx, rt.key_dir, "client", rt.planner_endpoint)
            assert _ask(s, Kind.ROUTE, {"rank": 0}).kind == Kind.ROUTE_REPLY
            assert _ask(s, Kind.ROUTE, {"rank": 1}).kind == Kind.ROUTE_REPLY
        finally:
            ctx.destroy(linger=0)
        got = fetch(rt.planner_endpoint, 2, 2)
        assert [len(got[r]) for r in (0, 1)] == [2, 2] and not rt.dead()

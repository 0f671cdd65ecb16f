"""Well-formed but hostile messages at a running planner: valid headers (checksummed or not) of every
kind but SHUTDOWN, with random fields and arrays. Nothing crashes and the batches delivered afterwards
are exactly those of an undisturbed run (registration, resume and mixture updates from any peer are
trusted without CURVE; docs/constructor.md says to enable CURVE with an allowlist)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from mixplane import wire
from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from mixplane.wire import Kind
from tests.conftest import token_mixture
from tests.integration.test_runtime import as_client, fetch

pytestmark = pytest.mark.timeout(240)

FIELDS = ("role", "source", "replica", "index", "session", "through", "rank", "cursor", "weights", "effective_step",
          "step", "data_endpoint", "client_endpoint", "attempt", "lr_scale", "temperature", "metrics_port")


def _value(rng: np.random.Generator, depth: int = 0):
    """A random JSON value; strings never name a role, source or endpoint the runtime uses."""
    c = int(rng.integers(0, 9 if depth < 2 else 6))
    if c == 0:
        return int(rng.choice([0, 1, -1, 2**31, -(2**40), 10**15]))
    if c == 1:
        return float(rng.choice([0.0, -1.5, 1e300, 0.5]))
    if c == 2:
        return str(rng.choice(["", "x", "trainer", "tcp://127.0.0.1:1", "é" * 3]))
    if c == 3:
        return bool(rng.integers(0, 2))
    if c == 4:
        return None
    if c == 5:
        return 0  # the live session number: gets past the session checks
    if c == 6:
        return [_value(rng, depth + 1) for _ in range(int(rng.integers(0, 4)))]
    return {str(rng.choice(["x", "step", "low", "zz"])): _value(rng, depth + 1) for _ in range(int(rng.integers(0, 4)))}


def _message(rng: np.random.Generator) -> list:
    kinds = [k for k in Kind if k != Kind.SHUTDOWN]
    kind = kinds[int(rng.integers(0, len(kinds)))]
    meta = {f: _value(rng) for f in rng.choice(FIELDS, size=int(rng.integers(0, 6)), replace=False)}
    arrays = {n: rng.integers(-5, 10**6, size=int(rng.integers(0, 20))).astype(np.int64)
              for n in rng.choice(["pos", "key", "tokens", "patches", "x"], size=int(rng.integers(0, 5)), replace=False)}
    return wire.encode(kind, meta, arrays, checksum=bool(rng.integers(0, 2)))


def test_valid_headers_with_random_fields_break_nothing(token_sources, tmp_path):
    spec = parse_spec(token_mixture(token_sources["root"]))
    with EmbeddedRuntime(spec, tmp_path / "ok") as rt:
        ref = fetch(rt.planner_endpoint, 2, 6)
    with EmbeddedRuntime(spec, tmp_path / "noisy") as rt:
        ctx = zmq.Context.instance()
        rng = np.random.default_rng(4)
        s = as_client(ctx.socket(zmq.DEALER), rt)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(rt.planner_endpoint)
        for _ in range(400):
            s.send_multipart(_message(rng))
        s.send_multipart(wire.encode(Kind.NEED_STEPS, {"session": 0, "through": -(10**9)}))  # would stall planning
        time.sleep(0.3)
        while s.poll(0):
            s.recv_multipart()  # replies (errors, status) are the fuzzer's business
        s.close(0)
        got = fetch(rt.planner_endpoint, 2, 6)
        assert not rt.dead()
    for r in (0, 1):
        assert len(got[r]) == len(ref[r]) == 6
        for a, b in zip(ref[r], got[r]):
            assert a.keys() == b.keys()
            for k in a:
                assert np.array_equal(a[k], b[k]), (r, k)

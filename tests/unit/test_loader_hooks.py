"""hooks.loader: the result check (a permutation, a read-ahead, nothing else) and a loader serving a step's spans in
the order its hook gives (one loader in this process, real PUSH/PULL sockets to two constructors' places)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import zmq

from mixplane import wire
from mixplane.loader.hooks import LoaderHookError, apply_loader_hook, load_loader_hook
from mixplane.loader.server import LoaderServer
from mixplane.spec import parse_spec
from mixplane.wire import Kind
from tests.conftest import write_token_source

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "strategies" / "busiest_first.py"
CTX = {"step": 3, "source": "a", "replica": 1, "constructors": 2}
WHERE = "hooks.loader 'h' at step 3 (source 'a', replica 1)"


def plan(n=4):
    return {"pos": np.arange(n), "key": np.arange(n) + 100, "start": np.zeros(n, np.int64), "len": np.array([5, 9, 2, 7][:n]),
            "dest": np.array([0, 1, 1, 0][:n]), "img": np.zeros(n, np.int8), "retire": np.ones(n, np.int8),
            "tokens": np.array([5, 9, 2, 7][:n])}


@pytest.mark.parametrize("result,error", [
    ({"order": [0, 1, 2]}, "field 'order' must be a permutation of the step's 4 planned span(s) (0..3, each once), got [0, 1, 2]"),
    ({"order": [0, 0, 1, 2]}, "field 'order' must be a permutation"),
    ({"order": [0.0, 1.0, 2.0, 3.0]}, "field 'order' must be a permutation of the step's 4 planned span(s) (0..3, each once), got float64 array of shape (4,)"),
    ({"read_ahead_tokens": -1}, "field 'read_ahead_tokens' must be an integer in 0..268435456, got -1"),
    ({"read_ahead_tokens": True}, "field 'read_ahead_tokens' must be an integer"),
    ({"dest": [1, 1, 0, 0]}, "unknown field(s) dest (a loader hook decides order, read_ahead_tokens; which samples go where is the plan's)"),
    ([3, 2, 1, 0], "returned list, not None or a mapping"),
])
def test_a_result_that_is_no_way_to_consume_the_plan_is_refused_naming_hook_step_and_field(result, error):
    with pytest.raises(LoaderHookError, match=re.escape(f"{WHERE}") + ".*" + re.escape(error)):
        apply_loader_hook(lambda p, c: result, "h", plan(), CTX)


def test_the_hook_gets_read_only_arrays_and_its_exceptions_are_named():
    def writes(p, c):
        p["dest"][0] = 1
    with pytest.raises(LoaderHookError, match=re.escape(f"{WHERE} raised ValueError: assignment destination is read-only")):
        apply_loader_hook(writes, "h", plan(), CTX)
    d = apply_loader_hook(lambda p, c: None, "h", plan(), CTX)
    assert d.order is None and d.read_ahead_tokens is None
    d = apply_loader_hook(lambda p, c: {"order": np.array([3, 2, 1, 0], np.int32), "read_ahead_tokens": np.int64(10)}, "h", plan(), CTX)
    assert d.order.tolist() == [3, 2, 1, 0] and d.read_ahead_tokens == 10


def test_the_example_serves_the_busiest_constructor_first_longest_spans_first():
    spec = parse_spec({"name": "x", "sources": [{"name": "a", "uri": "/nowhere", "kind": "tokens", "columns": ["tokens"]}],
                       "batch": {"sequences": 2, "seq_len": 64}, "topology": {"modules": {"backbone": {"dp": 2}}},
                       "hooks": {"loader": {"name": f"{EXAMPLE}:busiest_first", "options": {"read_ahead_steps": 2}}}})
    hook = load_loader_hook(spec, "a")
    d = apply_loader_hook(hook, "h", plan(), CTX)
    # constructor 0 gets 5 + 7 tokens, constructor 1 gets 9 + 2: 0 first, its 7 before its 5; then 1's 9, its 2
    assert d.order.tolist() == [3, 0, 1, 2]
    assert d.read_ahead_tokens == 2 * 23


def test_a_loader_serves_its_spans_in_the_hooks_order(tmp_path):
    write_token_source(tmp_path / "t", rows=200, files=1, mean_len=20, seed=3)
    hook = tmp_path / "rev.py"
    hook.write_text("def rev(plan, ctx):\n    return {'order': list(range(len(plan['pos'])))[::-1], 'read_ahead_tokens': 777}\n")
    spec = parse_spec({
        "name": "hooked", "sources": [{"name": "t", "uri": str(tmp_path / "t"), "kind": "tokens", "columns": ["tokens"]}],
        "batch": {"sequences": 2, "seq_len": 64, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": 1}}}, "runtime": {"window": 32, "metrics": False},
        "hooks": {"loader": {"name": f"{hook}:rev"}},
    })
    ctx = zmq.Context()
    pulls, eps = [], []
    for _ in range(2):
        p = ctx.socket(zmq.PULL)
        eps.append(f"tcp://127.0.0.1:{p.bind_to_random_port('tcp://127.0.0.1')}")
        pulls.append(p)
    server = LoaderServer(spec, 0, 0, "tcp://127.0.0.1:9", context=ctx)
    try:
        server.handle(wire.decode(wire.encode(Kind.WELCOME, {"constructors": eps, "session": 1, "cursor": {"low": 0}})))
        server._fill()
        held = sorted(server.window.buffer)[:6]
        keys = [int(server.window.buffer[q].key) for q in held]
        dest = np.array([0, 1, 0, 1, 0, 1])
        p = {"pos": np.array(held), "start": np.zeros(6, np.int64), "len": np.ones(6, np.int64), "dest": dest,
             "retire": np.zeros(6, np.int64), "img": np.zeros(6, np.int64)}
        server.handle(wire.decode(wire.encode(Kind.PLAN_LOADER, {"session": 1, "step": 0}, p)))
        assert server.hook_calls == 1 and server.window.read_ahead_tokens == 777
        got = []
        for pull in pulls:
            assert pull.poll(5000)
            m = wire.recv(pull)[1]
            got.append(m.array("key").tolist())
        assert got == [[keys[4], keys[2], keys[0]], [keys[5], keys[3], keys[1]]]  # reversed, per constructor
    finally:
        server.close()
        for p in pulls:
            p.close(0)
        ctx.term()

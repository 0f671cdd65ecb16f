"""protocol: the window cursor both sides parse, message schemas, the role table."""

from __future__ import annotations

import numpy as np
import pytest

from mixplane import protocol, wire
from mixplane.loader.window import LoaderWindow
from mixplane.planner.windows import ReplicaWindow
from mixplane.protocol import WindowCursor
from mixplane.wire import Kind, WireError


def test_cursor_round_trip_and_defaults():
    c = WindowCursor.parse({"low": 5, "next": 9, "skip": [7, 6], "partial": {"8": 3}})
    assert (c.low, c.next, c.skip, dict(c.partial)) == (5, 9, frozenset({6, 7}), {8: 3})
    assert WindowCursor.parse(c.to_json()) == c
    assert c.to_json() == {"low": 5, "next": 9, "skip": [6, 7], "partial": {"8": 3}}
    bare = WindowCursor.parse({"low": 4})
    assert (bare.next, bare.skip, dict(bare.partial)) == (4, frozenset(), {})


@pytest.mark.parametrize("bad, word", [
    ({}, "malformed"), ([1, 2], "malformed"), ({"low": "x"}, "malformed"), ({"low": True}, "malformed"),
    ({"low": 1.5}, "malformed"), ({"low": 0, "skip": 3}, "malformed"), ({"low": 0, "partial": [1]}, "malformed"),
    ({"low": 0, "partial": {"a": 1}}, "malformed"), ({"low": -1}, "inconsistent"), ({"low": 5, "skip": [4]}, "inconsistent"),
    ({"low": 0, "partial": {"3": 0}}, "inconsistent"), ({"low": 5, "next": 4}, "inconsistent"),
])
def test_cursor_parser_rejects_by_name(bad, word):
    with pytest.raises(ValueError, match=word):
        WindowCursor.parse(bad)


class _Stream:
    def __init__(self):
        self.at = None

    def seek(self, pos):
        self.at = pos


def test_planner_and_loader_share_the_parser():
    """The planner's ReplicaWindow and a loader's LoaderWindow accept and refuse the same cursors."""
    good = {"low": 3, "next": 7, "skip": [4], "partial": {"5": 2}}
    w = ReplicaWindow(0, 0, 4)
    w.restore(good)
    assert (w.low, w.skip, w.restored_done) == (3, {4}, {5: 2})
    stream = _Stream()
    lw = LoaderWindow(stream, lambda raw: raw, (1, 1, 4))
    lw.seek(good)
    assert (stream.at, lw.skip, lw.partial) == (3, {4}, {5: 2})
    for bad in ({"low": 3, "skip": [1]}, {"low": "x"}, {"skip": []}):
        with pytest.raises(ValueError):
            ReplicaWindow.parse_cursor(bad)
        stream.at = None
        with pytest.raises(ValueError):
            lw.seek(bad)
        assert stream.at is None  # validated before anything changes


def test_window_full_rule():
    assert protocol.window_full(4, 0, 2, 10, 4)  # cap
    assert protocol.window_full(2, 10, 2, 10, 8)
    assert not protocol.window_full(2, 9, 2, 10, 8)
    assert not protocol.window_full(1, 100, 2, 10, 8)
    assert isinstance(protocol.window_full(2, 10, 2, 10, 8), bool)


def test_window_full_elementwise_agrees_with_the_scalar_rule():
    import numpy as np

    rng = np.random.default_rng(3)
    for _ in range(200):
        have_n, have_t = int(rng.integers(0, 6)), int(rng.integers(0, 50))
        tok = rng.integers(1, 30, int(rng.integers(0, 12)))
        lo, cap, min_t = int(rng.integers(1, 8)), int(rng.integers(1, 16)), int(rng.integers(1, 120))
        n_after, cum = have_n + np.arange(1, len(tok) + 1), have_t + np.cumsum(tok)
        vec = protocol.window_full(n_after, cum, lo, min_t, cap)
        assert list(vec) == [protocol.window_full(int(a), int(b), lo, min_t, cap) for a, b in zip(n_after, cum)]
        # the shortest filling prefix, as a loader adds samples one at a time
        k, n, t = None, have_n, have_t
        for i, x in enumerate(tok):
            n, t = n + 1, t + int(x)
            if protocol.window_full(n, t, lo, min_t, cap):
                k = i + 1
                break
        assert protocol.window_fill_length(have_n, have_t, tok, lo, min_t, cap) == k


def _msg(kind, meta=None, arrays=None):
    return wire.decode(wire.encode(kind, meta, arrays))


def test_schemas_name_the_missing_field():
    protocol.check(_msg(Kind.GET_STEP, {"step": 1, "rank": 0}))
    with pytest.raises(WireError, match="'rank'"):
        protocol.check(_msg(Kind.GET_STEP, {"step": 1}))
    with pytest.raises(WireError, match="'step' has type str"):
        protocol.check(_msg(Kind.GET_STEP, {"step": "1", "rank": 0}))
    arrays = {n: np.zeros(1, np.int64) for n in protocol.SAMPLES_ARRAYS if n != "values"}
    with pytest.raises(WireError, match="'values'"):
        protocol.check(_msg(Kind.SAMPLES, {"session": 0, "step": 0, "source": 0}, arrays))
    assert set(protocol.SCHEMAS) == set(Kind)


def test_roles():
    a = protocol.allowed
    for kind in (Kind.SHUTDOWN, Kind.UPDATE_MIXTURE, Kind.RESUME):
        assert not a(kind, protocol.ANONYMOUS)
        assert a(kind, protocol.ANONYMOUS, open_run=True)
        assert a(kind, protocol.ADMIN)
    assert not a(Kind.SHUTDOWN, protocol.CLIENT)
    assert not a(Kind.UPDATE_MIXTURE, protocol.CLIENT)
    assert a(Kind.RESUME, protocol.CLIENT)
    assert not a(Kind.LOADER_META, protocol.CLIENT)
    assert a(Kind.GET_STEP, protocol.CLIENT) and a(Kind.STATUS, protocol.ANONYMOUS)
    assert wire.role_of_key_name("server") == protocol.COMPONENT
    assert wire.role_of_key_name("admin") == protocol.ADMIN
    assert wire.role_of_key_name("stranger") == protocol.CLIENT

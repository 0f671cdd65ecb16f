"""The partition table (planner.partitions) and warm window seeks (loader.window): pure, no sockets."""

from __future__ import annotations

import numpy as np
import pytest

from mixplane.loader.stream import open_stream
from mixplane.loader.transforms import make_transform
from mixplane.loader.window import LoaderWindow
from mixplane.planner.partitions import HandoffError, Host, PartitionTable, parse_partition
from mixplane.protocol import loader_identity
from mixplane.spec import SourceSpec
from tests.conftest import write_token_source

A0, A1, B0 = (0, 0), (0, 1), (1, 0)


def table(shadows: int = 0) -> PartitionTable:
    return PartitionTable([A0, A1, B0], shadows_wanted=shadows)


def test_hosts_take_free_partitions_and_every_assignment_bumps_the_epoch():
    t = table()
    alive = {"h1", "h2"}
    moves = t.register(Host("h1", (A0, A1)), alive.__contains__)
    assert [(m.key, m.to, m.mode, m.epoch, m.previous) for m in moves] == [(A0, "h1", "primary", 1, None),
                                                                           (A1, "h1", "primary", 1, None)]
    t.register(Host("h2", (B0,)), alive.__contains__)
    m = t.move(A1, "h2")
    assert (m.key, m.to, m.epoch, m.previous) == (A1, "h2", 2, "h1")
    assert t.hosted_by("h1") == [A0] and t.hosted_by("h2") == [A1, B0]
    # the old server of A1 (epoch 1) is stale now; the new one claims it
    assert not t.claim(A1, "h1", 1) and not t.claim(A1, "h2", 1) and t.claim(A1, "h2", 2)
    with pytest.raises(HandoffError, match="already served"):
        t.move(A1, "h2")
    with pytest.raises(HandoffError, match="no loader host 'nobody'"):
        t.move(A1, "nobody")
    with pytest.raises(HandoffError, match="no partition"):
        t.move((5, 0), "h1")


def test_a_restarted_host_re_adopts_under_a_new_epoch_and_a_loader_without_host_claims_free_ones():
    t = table()
    t.register(Host("h1", (A0,)), lambda h: True)
    again = t.register(Host("h1", (A0,)), lambda h: True)
    assert [(m.mode, m.epoch, m.previous) for m in again] == [("primary", 2, "h1")]
    assert t.claim(B0, None, 0) and not t.claim(A0, None, 2)  # A0 is a host's now


def test_shadows_are_promoted_when_the_primary_is_silent_and_the_old_primary_becomes_a_shadow():
    t = table(shadows=1)
    up = {"p", "s"}
    t.register(Host("p", (A0, B0)), up.__contains__)
    ms = t.register(Host("s", (A0, B0), shadow=True), up.__contains__)
    assert [(m.key, m.mode) for m in ms] == [(A0, "shadow"), (B0, "shadow")]
    assert t.failover(lambda h: h not in up) == []  # nobody silent: nothing moves
    up.discard("p")  # SIGKILL or SIGSTOP: silent past the budget
    moves = t.failover(lambda h: h not in up)
    assert [(m.key, m.to, m.mode, m.epoch, m.previous) for m in moves] == [(A0, "s", "primary", 2, "p"),
                                                                           (B0, "s", "primary", 2, "p")]
    assert t[A0].shadows == [] and t.failover(lambda h: h not in up) == []
    # the old primary comes back (restarted, or resumed): it shadows what it used to serve
    up.add("p")
    back = t.register(Host("p", (A0, B0)), up.__contains__)
    assert [(m.key, m.to, m.mode) for m in back] == [(A0, "p", "shadow"), (B0, "p", "shadow")]
    assert t.wanted_shadows(up.__contains__) == []
    # a shadow process restarted under its name is told again what to follow (it is a new process)
    again = t.register(Host("p", (A0,)), up.__contains__)
    assert [(m.key, m.to, m.mode) for m in again] == [(A0, "p", "shadow")] and t[A0].shadows == ["p"]


def test_only_a_fresh_shadow_is_promoted_and_a_partition_without_one_waits_for_a_host():
    t = table(shadows=1)
    up, fresh = {"p", "s"}, {"p", "s"}
    t.register(Host("p", (A0,)), up.__contains__)
    t.register(Host("s", (A0,), shadow=True), up.__contains__)
    assert t.without_host(up.__contains__) == [A1, B0]  # never assigned
    # the primary died and its shadow 57 ms later: still inside the failover window, but not heard for two beats
    up.discard("p")
    fresh.discard("p")
    fresh.discard("s")
    assert t.failover(lambda h: h not in up, fresh.__contains__) == []
    assert t[A0].host == "p" and A0 in t.without_host(up.__contains__)
    up.discard("s")  # silent past the window too: nothing to promote, the partition waits
    assert t.failover(lambda h: h not in up, fresh.__contains__) == []
    # the shadow was alive after all (a late beat): promoted once heard again
    up.add("s")
    fresh.add("s")
    assert [(m.key, m.to) for m in t.failover(lambda h: h not in up, fresh.__contains__)] == [(A0, "s")]
    assert A0 not in t.without_host(up.__contains__)
    # both gone again: the restarted primary takes it back (register), the partition has a host
    up.discard("s")
    up.add("p")
    back = t.register(Host("p", (A0,)), up.__contains__)
    assert [(m.key, m.to, m.mode) for m in back] == [(A0, "p", "primary")] and A0 not in t.without_host(up.__contains__)


def test_a_resumed_zombie_is_given_the_shadow_slot_and_a_shadow_never_takes_a_free_partition():
    t = table(shadows=1)
    up = {"p", "s"}
    t.register(Host("s", (A0,), shadow=True), up.__contains__)
    assert t[A0].host is None and t[A0].shadows == ["s"]
    t.register(Host("p", (A0,)), up.__contains__)
    assert t[A0].host == "p"
    up.discard("p")
    t.failover(lambda h: h not in up)
    up.add("p")  # SIGCONT: it never re-registered, the reconciliation finds it
    assert [(m.key, m.to, m.mode) for m in t.wanted_shadows(up.__contains__)] == [(A0, "p", "shadow")]


def test_partition_names_and_loader_identities():
    names = ["a", "b"]
    assert parse_partition("b:0", names) == (1, 0) and parse_partition("a", names) == (0, 0)
    with pytest.raises(HandoffError, match="unknown source 'z'"):
        parse_partition("z:1", names)
    with pytest.raises(HandoffError, match="not an integer"):
        parse_partition("a:x", names)
    assert loader_identity("a", 0, 0) == loader_identity("a", 0, 1) == "loader:a:0"
    assert loader_identity("a", 0, 3) == "loader:a:0@3"


def _window(root, min_tokens=400):
    src = SourceSpec(name="a", uri=str(root), kind="tokens", columns=["tokens"], shuffle="rowgroup")
    stream = open_stream(src, seed=3)
    return LoaderWindow(stream, make_transform(src), (8, min_tokens, 64))


def _announce(w: LoaderWindow) -> list[tuple[int, int, int]]:
    a = w.fill()
    return [(int(p), int(k), int(t)) for p, k, t in zip(a.pos, a.key, a.tokens)]


@pytest.mark.parametrize("cursor", [{"low": 40, "next": 40},
                                    {"low": 40, "next": 60, "skip": [41, 45], "partial": {"42": 3}}])
def test_a_warm_seek_announces_exactly_what_a_cold_seek_does_without_reading_again(tmp_path, cursor):
    write_token_source(tmp_path / "a", rows=600, files=2, mean_len=30, seed=5)
    cold = _window(tmp_path / "a")
    cold.seek(cursor)
    want = _announce(cold)
    warm = _window(tmp_path / "a")
    warm.read_ahead_tokens = 4000
    warm.seek({"low": 30})  # a shadow following from an earlier cursor, reading ahead
    while warm.read_ahead():
        pass
    read_before = warm._read_samples
    warm.seek(cursor)
    assert warm.warm_seeks == 1 and warm.warm_samples > 0
    got = _announce(warm)
    assert got == want
    assert warm._read_samples == read_before  # nothing read or tokenized again
    # partial progress comes from the cursor: a span of position 42 starts after its 3 delivered tokens
    if "partial" in cursor:
        assert warm.buffer[42].done == 3 and cold.buffer[42].done == 3


def test_a_seek_below_what_was_read_or_wanting_a_consumed_sample_is_cold(tmp_path):
    write_token_source(tmp_path / "a", rows=300, files=1, mean_len=30, seed=6)
    w = _window(tmp_path / "a")
    w.seek({"low": 50})
    _announce(w)
    w.seek({"low": 20})  # before what was read: cold
    assert w.warm_seeks == 0
    a = _announce(w)
    w.retire(a[0][0])  # consumed and gone
    w.seek({"low": a[0][0]})  # wants it again (a replay): cold
    assert w.warm_seeks == 0
    assert _announce(w)[0][0] == a[0][0]
    w.seek({"low": a[0][0], "skip": [a[0][0]]})  # consumed per the cursor: warm
    assert w.warm_seeks == 1
    ref = _window(tmp_path / "a")
    ref.seek({"low": a[0][0], "skip": [a[0][0]]})
    assert _announce(w) == _announce(ref)


def test_loader_snapshots_round_trip_and_bad_ones_are_named(tmp_path):
    from mixplane.loader import snapshot

    cur = snapshot.window_cursor([12, 10, 15], {10: 4, 12: 0, 3: 9}, 99)
    assert (cur.low, cur.next, dict(cur.partial)) == (10, 10, {10: 4})
    assert snapshot.window_cursor([], {}, 42).low == 42
    snap = snapshot.LoaderSnapshot("a", 1, 3, 0, 17, cur.to_json(), {"position": 16}, 1.0)
    p = snapshot.write(tmp_path, snap)
    assert p.name == "a-1.json" and snapshot.read(tmp_path, "a", 1) == snap
    assert snapshot.read(tmp_path, "b", 0) is None
    (tmp_path / "b-0.json").write_text('{"version": 1, "source": "a"}')
    with pytest.raises(ValueError, match="b-0.json: malformed loader snapshot"):
        snapshot.read(tmp_path, "b", 0)
    (tmp_path / "b-0.json").write_text("{not json")
    with pytest.raises(ValueError, match="unreadable loader snapshot"):
        snapshot.read(tmp_path, "b", 0)
    (tmp_path / "c-0.json").write_text(p.read_text())
    with pytest.raises(ValueError, match="snapshot of a:1, not c:0"):
        snapshot.read(tmp_path, "c", 0)


def test_a_shadow_launched_beside_a_host_stands_by_for_what_that_host_is_handed_after_a_repartition():
    """Source 0 goes 2 -> 3: the new partition's host `n` names no partition at launch, nor does its shadow `ns`
    (`shadow_of` n); once `n` serves (0, 2), `ns` is offered it -- every partition has its shadow again. The old
    shadow `s` (launched with the old partitions beside `p`) shadows (0, 0) and (0, 1) again; a shadow of another
    group is not offered what `n` serves. After `ns` is promoted, the restarted `n` (an empty host of the same
    group) becomes the shadow."""
    t = table(shadows=1)
    up = {"p", "s", "n", "ns", "q", "qs"}
    t.register(Host("p", (A0, A1, B0)), up.__contains__)
    t.register(Host("s", (A0, A1, B0), shadow=True, shadow_of="p"), up.__contains__)
    t.register(Host("q", ()), up.__contains__)
    t.register(Host("qs", (), shadow=True, shadow_of="q"), up.__contains__)
    t.register(Host("n", ()), up.__contains__)
    assert t.register(Host("ns", (), shadow=True, shadow_of="n"), up.__contains__) == []  # nothing served by n yet
    assert t.wanted_shadows(up.__contains__) == []  # every partition has its shadow (s)
    moves = t.repartition(0, 2, ["p", "p", "n"])
    assert [(m.key, m.to) for m in moves] == [(A0, "p"), (A1, "p"), ((0, 2), "n")]
    assert all(t[k].shadows == [] for k in (A0, A1, (0, 2)))
    shadows = t.wanted_shadows(up.__contains__)
    assert sorted((m.key, m.to, m.mode) for m in shadows) == [(A0, "s", "shadow"), (A1, "s", "shadow"),
                                                              ((0, 2), "ns", "shadow")]
    assert t.wanted_shadows(up.__contains__) == []  # k = 1 each: nothing more, qs never takes n's partition
    assert t.status(["a", "b"], up.__contains__, lambda h: 0.0)["hosts"]["ns"]["shadow_of"] == "n"
    up.discard("n")  # SIGKILL of the new partition's primary: its shadow takes over
    assert [(m.key, m.to, m.previous) for m in t.failover(lambda h: h not in up)] == [((0, 2), "ns", "n")]
    assert t[(0, 2)].shadows == [] and t.wanted_shadows(up.__contains__) == []  # no live host of the group is free
    up.add("n")
    assert t.register(Host("n", ()), up.__contains__) == []  # restarted empty: what its group serves comes next pass
    assert [(m.key, m.to, m.mode) for m in t.wanted_shadows(up.__contains__)] == [((0, 2), "n", "shadow")]


def test_a_launch_partition_that_a_repartition_to_fewer_took_away_is_skipped():
    t = table(shadows=1)
    up = {"p", "s"}
    t.register(Host("p", (A0, A1)), up.__contains__)
    t.register(Host("s", (A0, A1), shadow=True, shadow_of="p"), up.__contains__)
    t.repartition(0, 2, ["p"])  # source 0: 2 -> 1, (0, 1) is gone; s's launch list still names it
    assert [(m.key, m.to) for m in t.wanted_shadows(up.__contains__)] == [(A0, "s")]


def test_a_partition_handed_to_another_pod_is_shadowed_by_that_pods_shadow_and_the_old_one_is_let_go():
    """A0 moves from p (shadow s) to q (shadow qs): s keeps standing by until qs does, then it is let go (dormant);
    moved to a host without shadows of its own (x), the old shadow stays -- k live shadows either way."""
    t = table(shadows=1)
    up = {"p", "s", "q", "qs", "x"}
    t.register(Host("p", (A0, A1)), up.__contains__)
    t.register(Host("s", (A0, A1), shadow=True, shadow_of="p"), up.__contains__)
    t.register(Host("q", ()), up.__contains__)
    t.register(Host("x", ()), up.__contains__)
    t.move(A0, "q")
    assert t[A0].shadows == ["s"]
    assert t.wanted_shadows(up.__contains__) == []  # q's group has no shadow yet: s stays
    t.register(Host("qs", (), shadow=True, shadow_of="q"), up.__contains__)
    moves = t.wanted_shadows(up.__contains__)
    assert [(m.key, m.to, m.mode) for m in moves] == [(A0, "qs", "shadow"), (A0, "s", "dormant")]
    assert t[A0].shadows == ["qs"] and t[A1].shadows == ["s"] and t.wanted_shadows(up.__contains__) == []
    t.move(A1, "x")  # x stands alone: its partition keeps p's shadow
    assert t.wanted_shadows(up.__contains__) == [] and t[A1].shadows == ["s"]
    up.discard("qs")  # q's shadow died: a live host launched with A0 (p, first by name) stands by again
    assert [(m.key, m.to, m.mode) for m in t.wanted_shadows(up.__contains__)] == [(A0, "p", "shadow")]

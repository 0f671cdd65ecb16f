"""Re-partitioning a source at a step boundary (mixplane.repartition + SourceStream layouts): the new
partitions read exactly the unread rows of every epoch the old ones had started (no repeat, no gap),
deterministically, and their streams seek and resume exactly."""

from collections import Counter

import numpy as np
import pytest

from tests.unit.loader_testdata import write_source
from mixplane.loader.stream import open_stream
from mixplane.repartition import Layout, Piece, RepartitionError, initial_layouts, repartition
from mixplane.samples import key_epoch, key_row
from mixplane.spec import SourceSpec

MODES = ["page", "row", "rowgroup", "sequential"]


@pytest.fixture(scope="module")
def srcdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("rp")
    # 2 files x 2 row groups, small pages: enough pages and chunks for 4 partitions in every mode
    write_source(str(d), nfiles=2, rows=480, page_size=512, row_group_size=240)
    return str(d)


def _spec(d, mode):
    return SourceSpec(name="src", uri=d, columns=["text", "row"], kind="text", shuffle=mode)


def _open(d, mode, p, n, buffer_rows=60):
    return open_stream(_spec(d, mode), seed=3, partition=p, num_partitions=n, cache_dir=None,
                       buffer_rows=buffer_rows, row_block=17)


def _rows_of(stream):
    return int(stream.index.num_rows)


def _read_until(stream, end):
    """Keys and positions of slots [stream.position, end) (every slot holds a row in these sources)."""
    n = end - stream.position
    if n <= 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    got = stream.take(n)  # n rows: past ``end`` when slots in between are empty
    mine = got.positions < end
    if not mine.all():
        stream.seek(end)
    return got.keys[mine], got.positions[mine]


def _consume(streams, rng, max_epochs=2.5):
    """Each old stream read from its position to a random cursor; a random part of a window past it
    consumed out of order. Returns the consumed keys and the cursors (low, skip)."""
    keys, cursors = [], []
    for s in streams:
        per_epoch = max(1, s.epoch_rows(0, s.partition, s.num_partitions))
        low = s.position + int(rng.integers(0, int(per_epoch * max_epochs) + 1))
        k, _ = _read_until(s, low)
        keys.append(k)
        w = int(rng.integers(0, 40))
        k2, pos2 = _read_until(s, low + w)
        took = rng.random(len(pos2)) < 0.4
        keys.append(k2[took])
        cursors.append((low, [int(p) for p in pos2[took]]))
    return np.concatenate(keys), cursors


def _prefix_keys(stream, layout):
    """Everything a new partition's prefix delivers (its consumed slots stay empty)."""
    slots = layout.prefix_rows - sum(len(p.skip) for p in layout.prefix)
    got = stream.take(slots)
    assert len(got) == slots
    assert (got.positions < layout.prefix_rows).all()
    return got.keys


def _check_exact(keys, n_rows, epochs):
    """Every row of every epoch < ``epochs`` exactly once, nothing else."""
    c = Counter(zip(key_epoch(keys).tolist(), key_row(keys).tolist()))
    dup = [k for k, v in c.items() if v > 1]
    assert not dup, f"read twice: {dup[:5]}"
    want = {(e, r) for e in range(epochs) for r in range(n_rows)}
    have = set(c)
    assert not (want - have), f"skipped: {sorted(want - have)[:5]} ({len(want - have)})"
    assert not (have - want), f"beyond the epochs: {sorted(have - want)[:5]}"


@pytest.mark.parametrize("case", range(24))
def test_new_partitions_read_exactly_the_unread_epochs(srcdir, case):
    rng = np.random.default_rng(case)
    mode = MODES[case % 4]
    N, M, L = (int(x) for x in rng.integers(1, 5, size=3))
    old = [_open(srcdir, mode, i, N) for i in range(N)]
    n_rows = _rows_of(old[0])
    consumed, cursors = _consume(old, rng)
    new = repartition([s.layout() for s in old], cursors, M, old[0].epoch_rows, source="src")
    assert new == repartition(initial_layouts(N), cursors, M, old[0].epoch_rows, source="src")  # pure, same again
    assert [(lay.partition, lay.num_partitions) for lay in new] == [(k, M) for k in range(M)]
    E = new[0].epoch
    assert all(lay.epoch == E for lay in new)
    assert sum(len(p) for lay in new for p in lay.prefix) > 0 or all(c[0] == 0 for c in cursors)
    # shares are even: contiguous cuts of one concatenation
    sizes = [lay.prefix_rows for lay in new]
    assert max(sizes) - min(sizes) <= 1
    streams = [_open(srcdir, mode, k, M) for k in range(M)]
    got = [consumed]
    for s, lay in zip(streams, new):
        s.set_layout(lay)
        got.append(_prefix_keys(s, lay))
    _check_exact(np.concatenate(got), n_rows, E)
    # then each new partition's own epoch E: the new partitioning covers it exactly
    own = []
    for s, lay in zip(streams, new):
        assert s.position == lay.prefix_rows or len(lay.prefix[-1].skip)
        s.seek(lay.prefix_rows)
        k, _ = _read_until(s, lay.prefix_rows + s.epoch_rows(E, s.partition, M))
        own.append(k)
    own_keys = np.concatenate(own)
    assert (key_epoch(own_keys) == E).all()
    assert sorted(key_row(own_keys).tolist()) == list(range(n_rows))

    # a second re-partition of the re-partitioned source (M -> L), cut anywhere (in the prefix or after)
    again = [_open(srcdir, mode, k, M) for k in range(M)]
    for s, lay in zip(again, new):
        s.set_layout(lay)
    consumed2, cursors2 = _consume(again, rng, max_epochs=1.5)
    newer = repartition([s.layout() for s in again], cursors2, L, again[0].epoch_rows, source="src")
    E2 = newer[0].epoch
    got2 = [consumed, consumed2]
    for k, lay in enumerate(newer):
        s = _open(srcdir, mode, k, L)
        s.set_layout(lay)
        got2.append(_prefix_keys(s, lay))
    # the second prefix never needs more than the second stage's epochs
    _check_exact(np.concatenate(got2), n_rows, E2)


@pytest.mark.parametrize("mode", MODES)
def test_a_new_partition_seeks_and_resumes_exactly(srcdir, mode):
    rng = np.random.default_rng(7)
    old = [_open(srcdir, mode, i, 2) for i in range(2)]
    _, cursors = _consume(old, rng)
    new = repartition([s.layout() for s in old], cursors, 3, old[0].epoch_rows, source="src")
    lay = max(new, key=lambda x: len(x.prefix))
    ref = _open(srcdir, mode, lay.partition, 3)
    ref.set_layout(lay)
    total = lay.prefix_rows + 2 * ref.epoch_rows(lay.epoch, lay.partition, 3)
    full = ref.take(total)
    for cut in sorted({0, 1, lay.prefix_rows // 2, lay.prefix_rows - 1, lay.prefix_rows, lay.prefix_rows + 5,
                       *(int(x) for x in rng.integers(0, total, 6))}):
        at = int(np.searchsorted(full.positions, cut))
        # seek on a stream with the layout
        s = _open(srcdir, mode, lay.partition, 3)
        s.set_layout(lay)
        s.seek(cut)
        rest = s.take(len(full) - at)
        assert np.array_equal(rest.keys, full.keys[at:]), cut
        assert np.array_equal(rest.positions, full.positions[at:])
        assert np.array_equal(rest.columns["row"].to_numpy(), full.columns["row"].to_numpy()[at:])
        # resume from a state_dict taken there, on a fresh stream that was never given the layout
        s2 = _open(srcdir, mode, lay.partition, 3)
        s.seek(cut)
        st = s.state_dict()
        assert st.get("prefix", []) == [p.to_json() for p in lay.prefix]
        s2.load_state_dict(st)
        assert s2.layout() == lay
        rest2 = s2.take(len(full) - at)
        assert np.array_equal(rest2.keys, full.keys[at:]), cut


def test_a_piece_reads_its_plan_slots_in_the_plan_order(srcdir):
    """A piece (epoch, p, N)[lo, hi) delivers exactly what partition p of N delivers at those slots of that epoch."""
    s = _open(srcdir, "page", 1, 3)
    n0 = s.epoch_rows(0, 1, 3)
    n1 = s.epoch_rows(1, 1, 3)
    ref = s.take(n0 + n1)
    lo, hi = 11, n1 - 7
    lay = Layout(0, 1, (Piece(1, 1, 3, lo, hi, (lo + 2, hi - 1)),), epoch=5)
    t = _open(srcdir, "page", 0, 1)
    t.set_layout(lay)
    got = t.take(hi - lo - 2)
    want = np.delete(ref.keys[n0 + lo : n0 + hi], [2, hi - lo - 1])
    assert np.array_equal(got.keys, want)
    assert got.positions.tolist() == [p for p in range(hi - lo) if p not in (2, hi - lo - 1)]
    nxt = t.take(3)
    assert (key_epoch(nxt.keys) == 5).all() and nxt.positions[0] == hi - lo


def test_bad_input_is_refused_naming_the_field(srcdir):
    rows = _open(srcdir, "row", 0, 2).epoch_rows
    lays = initial_layouts(2)
    with pytest.raises(RepartitionError, match="partitions must be in"):
        repartition(lays, [(0, []), (0, [])], 0, rows, source="src")
    with pytest.raises(RepartitionError, match="partitions must be in"):
        repartition(lays, [(0, []), (0, [])], 5000, rows, source="src")
    with pytest.raises(RepartitionError, match="1 cursors for 2 partitions"):
        repartition(lays, [(0, [])], 3, rows, source="src")
    with pytest.raises(RepartitionError, match="negative"):
        repartition(lays, [(-1, []), (0, [])], 3, rows, source="src")
    with pytest.raises(RepartitionError, match="malformed"):
        Piece.parse([0, 1, 2, "x", 4, []])
    with pytest.raises(RepartitionError, match="inconsistent"):
        Piece.parse([0, 2, 2, 0, 4, []])
    s = _open(srcdir, "row", 0, 2)
    with pytest.raises(ValueError, match="layout of partition 1 of 2 given to partition 0 of 2"):
        s.set_layout(Layout(1, 2))
    # a layout survives JSON (the journal's form)
    new = repartition(lays, [(5, [7, 9]), (300, [])], 3, rows, source="src")
    assert [Layout.parse(x.to_json()) for x in new] == new

"""Page index, shuffle orders and the stream contract: determinism, seek, partitions, epochs, resume."""

import os

import numpy as np
import pyarrow as pa
import pytest

from tests.unit.loader_testdata import write_source
from mixplane.loader import pageindex as pi
from mixplane.loader.pagereader import IOStats
from mixplane.loader.shuffle import BufferShuffle, FeistelPermutation
from mixplane.loader.stream import open_stream
from mixplane.samples import key_epoch, key_row
from mixplane.spec import SourceSpec

MODES = ["page", "row", "rowgroup", "sequential"]


@pytest.fixture(autouse=True)
def _index_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    d = tmp_path_factory.mktemp("src")
    # files with and without OffsetIndex, v1 pages: index from both paths
    paths, table = write_source(str(d), nfiles=3, rows=900, page_index=[True, False])
    return str(d), paths, table


def spec(d, mode="page", columns=("text", "ids", "row"), **kw):
    return SourceSpec(name="src", uri=d, columns=list(columns), kind="tokens", shuffle=mode, **kw)


def rows_of(r):
    return r.columns["row"].to_numpy()


# ---------------------------------------------------------------- index

def test_index_from_offset_index_equals_header_scan(tmp_path):
    from tests.unit.loader_testdata import text_table
    import pyarrow.parquet as pq
    t = text_table(2000)
    a, b = str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")
    pq.write_table(t, a, data_page_size=1024, row_group_size=700, write_page_index=True)
    pq.write_table(t, b, data_page_size=1024, row_group_size=700, write_page_index=False)
    fa = pi.index_file(a, ["ids", "text"])
    fb = pi.index_file(b, ["ids", "text"])
    for c in ("ids", "text"):
        assert (fa.pages[c].unit_rows == fb.pages[c].unit_rows).all()
        assert len(fa.pages[c].unit_off) == len(fb.pages[c].unit_off)
        # page headers differ (statistics live in the page index or in the headers), the pages do not
        assert (np.diff(fb.pages[c].unit_off) == fb.pages[c].unit_len[:-1]).sum() >= len(fb.pages[c].unit_off) - 3


def test_layered_binary_search_matches_brute_force(src):
    d, paths, _ = src
    idx = pi.build_source_index(paths, ["ids", "text"], cache_dir=None)
    p = idx.primary
    u = np.arange(idx.num_units)
    f, c, k = idx.locate(u)
    brute_c = np.repeat(np.arange(len(p["chunk_rg"])), np.diff(p["chunk_first_unit"]))
    assert (c == brute_c).all()
    assert (f == p["chunk_file"][brute_c]).all()
    assert (k == u - p["chunk_first_unit"][brute_c]).all()
    assert idx.bytes_per_page < 80
    with pytest.raises(IndexError):
        idx.locate([idx.num_units])


@pytest.mark.parametrize("dictionary", [False, True])
def test_units_read_equal_the_rows_of_the_source(tmp_path, dictionary):
    paths, table = write_source(str(tmp_path), nfiles=2, rows=700, page_index=[False, True], dictionary=dictionary,
                                version="2.0", compression="zstd")
    idx = pi.build_source_index(paths, ["text", "ids", "row"], cache_dir=None)
    rd = pi.SourceReader(idx)
    rng = np.random.default_rng(0)
    for u in rng.choice(idx.num_units, min(40, idx.num_units), replace=False):
        c = int(idx.chunk_of_units([u])[0])
        r0 = int(idx.unit_row_start[u])
        r1 = r0 + int(idx.unit_rows[u])
        got = rd.read_rows(c, r0, r1, (int(u), int(u) + 1))
        for name in ("ids", "text", "row"):
            assert got[name].equals(table.column(name).slice(r0, r1 - r0).combine_chunks()), name
    rd.close()


def test_sidecar_reused_and_invalidated(src, tmp_path):
    d, paths, _ = src
    cache = str(tmp_path / "side")
    s1 = IOStats()
    i1 = pi.build_source_index(paths, ["ids"], cache_dir=cache, stats=s1)
    assert s1.bytes_read > 0 and len(os.listdir(cache)) == len(paths)
    s2 = IOStats()
    i2 = pi.build_source_index(paths, ["ids"], cache_dir=cache, stats=s2)
    assert s2.bytes_read == 0  # nothing read: every file came from its sidecar
    assert (i1.unit_row_start == i2.unit_row_start).all() and i1.fingerprint() == i2.fingerprint()
    # a damaged sidecar is rebuilt, not trusted
    for f in os.listdir(cache):
        with open(os.path.join(cache, f), "wb") as fh:
            fh.write(b"garbage")
    s3 = IOStats()
    i3 = pi.build_source_index(paths, ["ids"], cache_dir=cache, stats=s3)
    assert s3.bytes_read > 0 and (i3.unit_rows == i1.unit_rows).all()
    # a changed file (new mtime) is re-indexed
    st = os.stat(paths[0])
    os.utime(paths[0], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    s4 = IOStats()
    pi.build_source_index(paths, ["ids"], cache_dir=cache, stats=s4)
    assert 0 < s4.bytes_read


# ---------------------------------------------------------------- orders

def test_feistel_is_a_bijection():
    for n in (1, 2, 3, 17, 1000, 4097):
        p = FeistelPermutation(n, 12345)(np.arange(n))
        assert sorted(p.tolist()) == list(range(n))
    a = FeistelPermutation(1000, 1)(np.arange(1000))
    b = FeistelPermutation(1000, 2)(np.arange(1000))
    assert (a != b).any()


def test_buffer_shuffle_emits_every_row_once_and_mixes_pages():
    rows = np.full(200, 50, np.int64)
    starts = np.arange(200, dtype=np.int64) * 50
    order = np.random.default_rng(0).permutation(200)
    sim = BufferShuffle(order, starts, rows, buffer_rows=1000, rows_per_page=50, rng=np.random.default_rng(1))
    out, done = [], []
    while (b := sim.next_block()) is not None:
        out.append(b[0])
        done += b[1]
    out = np.concatenate(out)
    assert sorted(out.tolist()) == list(range(10_000))
    assert sorted(done) == list(range(200))
    gap = np.abs(np.diff(out)).mean() / 10_000
    assert gap > 0.25  # close to a full shuffle's 1/3


# ---------------------------------------------------------------- stream contract

@pytest.mark.parametrize("mode", MODES)
def test_each_epoch_is_the_whole_source_once(src, mode):
    d, _, table = src
    n = len(table)
    s = open_stream(spec(d, mode), seed=3, buffer_rows=300)
    r = s.take(2 * n + 10)
    ep = key_epoch(r.keys)
    assert (ep[:n] == 0).all() and (ep[n : 2 * n] == 1).all() and (ep[2 * n :] == 2).all()
    for e in (0, 1):
        sel = ep == e
        assert sorted(key_row(r.keys[sel]).tolist()) == list(range(n))
        assert (rows_of(r)[sel] == key_row(r.keys[sel])).all()  # the key names the row that was delivered
    assert (r.positions == np.arange(2 * n + 10)).all()
    if mode != "sequential":
        assert (key_row(r.keys[:n]) != key_row(r.keys[n : 2 * n])).any()  # a new order each epoch
    else:
        assert (key_row(r.keys[:n]) == np.arange(n)).all()
    s.close()


@pytest.mark.parametrize("mode", MODES)
def test_same_seed_same_order_other_seed_other_order(src, mode):
    d, _, _ = src
    a = open_stream(spec(d, mode), seed=5, buffer_rows=300).take(500).keys
    b = open_stream(spec(d, mode), seed=5, buffer_rows=300).take(500).keys
    assert (a == b).all()
    if mode != "sequential":
        c = open_stream(spec(d, mode), seed=6, buffer_rows=300).take(500).keys
        assert (a != c).any()


@pytest.mark.parametrize("mode", MODES)
def test_seek_equals_unbroken_run_and_take_sizes_do_not_matter(src, mode):
    d, _, table = src
    n = len(table)
    full = open_stream(spec(d, mode), seed=9, buffer_rows=300).take(2 * n + 100)
    for p in (0, 1, 777, n - 1, n, n + 123, 2 * n + 3):
        s = open_stream(spec(d, mode), seed=9, buffer_rows=300)
        s.seek(p)
        assert s.position == p
        r = s.take(60)
        k = min(60, len(full) - p)
        assert (r.keys[:k] == full.keys[p : p + k]).all()
        assert (r.positions[:k] == full.positions[p : p + k]).all()
        assert r.columns["text"][:k].equals(full.columns["text"][p : p + k])
        assert r.columns["ids"][:k].equals(full.columns["ids"][p : p + k])
    s = open_stream(spec(d, mode), seed=9, buffer_rows=300)
    parts = [s.take(k) for k in (1, 2, 97, 1000, 5, 1500)]
    keys = np.concatenate([p.keys for p in parts])
    assert (keys == full.keys[: len(keys)]).all()
    # seeking backwards works too
    s.seek(10)
    assert (s.take(5).keys == full.keys[10:15]).all()


@pytest.mark.parametrize("mode", MODES)
def test_partitions_are_disjoint_and_cover_each_epoch(src, mode):
    d, _, table = src
    n = len(table)
    N = 3
    for epoch in (0, 1):
        seen = []
        for p in range(N):
            s = open_stream(spec(d, mode), seed=2, partition=p, num_partitions=N, buffer_rows=200)
            got = []
            while True:
                r = s.take(400)
                e = key_epoch(r.keys)
                got.append(r.keys[e == epoch])
                if e.max() > epoch:
                    break
            seen.append(np.concatenate(got))
        allk = np.concatenate(seen)
        assert len(allk) == n and len(np.unique(allk)) == n
        assert sorted(key_row(allk).tolist()) == list(range(n))


@pytest.mark.parametrize("mode", MODES)
def test_state_dict_resumes_exactly_mid_epoch(src, mode):
    d, _, table = src
    a = open_stream(spec(d, mode), seed=4, partition=1, num_partitions=2, buffer_rows=300)
    a.take(1234)
    st = a.state_dict()
    rest = a.take(2000)
    b = open_stream(spec(d, mode), seed=4, partition=1, num_partitions=2, buffer_rows=300)
    b.load_state_dict(st)
    again = b.take(2000)
    assert (rest.keys == again.keys).all() and (rest.positions == again.positions).all()
    assert rest.columns["text"].equals(again.columns["text"])


@pytest.mark.parametrize("mode", ["page", "row"])
def test_replica_count_changes_at_an_epoch_boundary(src, mode):
    d, _, table = src
    n = len(table)
    # epoch 0 with 2 replicas; each saves its state at its epoch boundary
    states = []
    for p in range(2):
        s = open_stream(spec(d, mode), seed=8, partition=p, num_partitions=2, buffer_rows=200)
        k = 0
        while True:
            r = s.take(1)
            if key_epoch(r.keys)[0] == 1:
                break
            k += 1
        s.seek(k)
        st = s.state_dict()
        assert st["position"] == st["epoch_start"] and st["epoch"] == 1
        states.append(st)
    # epoch 1 with 3 replicas, resumed from replica 0's boundary state
    seen = []
    for p in range(3):
        s = open_stream(spec(d, mode), seed=8, partition=p, num_partitions=3, buffer_rows=200)
        s.load_state_dict(states[0])
        assert s.position == states[0]["position"]
        got = []
        while True:
            r = s.take(500)
            e = key_epoch(r.keys)
            got.append(r.keys[e == 1])
            if e.max() > 1:
                break
        seen.append(np.concatenate(got))
    allk = np.concatenate(seen)
    assert len(allk) == n and sorted(key_row(allk).tolist()) == list(range(n))
    # mid-epoch a different replica count is refused
    s = open_stream(spec(d, mode), seed=8, partition=0, num_partitions=2, buffer_rows=200)
    s.take(10)
    t = open_stream(spec(d, mode), seed=8, partition=0, num_partitions=3, buffer_rows=200)
    with pytest.raises(ValueError, match="epoch boundary"):
        t.load_state_dict(s.state_dict())


def test_page_mode_holds_only_buffered_pages(src):
    d, _, table = src
    s = open_stream(spec(d, "page"), seed=1, buffer_rows=200)
    rows_per_page = float(s.index.unit_rows.mean())
    peak = 0
    for _ in range(60):
        s.take(50)
        peak = max(peak, len(s._cache))
    # pages decoded and kept: those with rows still in the buffer (a few buffers' worth at most)
    assert peak <= 4 * (200 / rows_per_page + 2)
    assert peak < s.index.num_units / 3


def test_page_mode_reads_little_more_than_it_delivers(src):
    d, paths, table = src
    s = open_stream(spec(d, "page", columns=["text"]), seed=1, buffer_rows=200, cache_dir=None)
    start = s.stats.bytes_read
    s.take(len(table))  # one epoch
    read = s.stats.bytes_read - start
    fis = [pi.index_file(p, ["text"]).pages["text"] for p in paths]
    data = sum(int(f.unit_len.sum()) + int(f.chunk_dict_len.sum()) for f in fis)
    assert read <= 1.05 * data  # each page once, each dictionary page once

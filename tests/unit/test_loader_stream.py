"""Page index, shuffle orders and the stream contract: determinism, seek, partitions, epochs, resume."""

import os

import numpy as np
import pyarrow as pa
import pytest

from tests.unit.loader_testdata import write_source
from mixplane.loader import indexscan as scan
from mixplane.loader import sourcereader as sr
from mixplane.loader.parquet import IOStats
from mixplane.loader.shuffle import BufferShuffle, FeistelPermutation, PageParts, stratified_permutation
from mixplane.loader.stream import SLAB_LIVE_RATIO, MAX_PAGE_READS, READ_BUDGET, open_stream
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
    return SourceSpec(name="src", uri=d, columns=list(columns), kind="tokens" if columns[0] == "ids" else "text", shuffle=mode, **kw)


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
    fa = scan.index_file(a, ["ids", "text"])
    fb = scan.index_file(b, ["ids", "text"])
    for c in ("ids", "text"):
        assert (fa.pages[c].unit_rows == fb.pages[c].unit_rows).all()
        assert len(fa.pages[c].unit_off) == len(fb.pages[c].unit_off)
        # page headers differ (statistics live in the page index or in the headers), the pages do not
        assert (np.diff(fb.pages[c].unit_off) == fb.pages[c].unit_len[:-1]).sum() >= len(fb.pages[c].unit_off) - 3


def test_locate_matches_brute_force(src):
    d, paths, _ = src
    idx = scan.build_source_index(paths, ["ids", "text"], cache_dir=None)
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
    idx = scan.build_source_index(paths, ["text", "ids", "row"], cache_dir=None)
    rd = sr.SourceReader(idx)
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
    i1 = scan.build_source_index(paths, ["ids"], cache_dir=cache, stats=s1)
    assert s1.bytes_read > 0 and len(os.listdir(cache)) == len(paths)
    s2 = IOStats()
    i2 = scan.build_source_index(paths, ["ids"], cache_dir=cache, stats=s2)
    assert s2.bytes_read == 0  # nothing read: every file came from its sidecar
    assert (i1.unit_row_start == i2.unit_row_start).all() and i1.fingerprint() == i2.fingerprint()
    # a damaged sidecar is rebuilt, not trusted
    for f in os.listdir(cache):
        with open(os.path.join(cache, f), "wb") as fh:
            fh.write(b"garbage")
    s3 = IOStats()
    i3 = scan.build_source_index(paths, ["ids"], cache_dir=cache, stats=s3)
    assert s3.bytes_read > 0 and (i3.unit_rows == i1.unit_rows).all()
    # a changed file (new mtime) is re-indexed
    st = os.stat(paths[0])
    os.utime(paths[0], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    s4 = IOStats()
    scan.build_source_index(paths, ["ids"], cache_dir=cache, stats=s4)
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


def test_page_mode_holds_only_buffered_rows(src):
    import pyarrow.compute as pc
    d, _, table = src
    # decoded bytes of each source row (values and offsets), to weigh what the buffer holds
    row_bytes = (pc.binary_length(table.column("text")).to_numpy(zero_copy_only=False) + 4
                 + 4 * pc.list_value_length(table.column("ids")).to_numpy(zero_copy_only=False) + 4 + 8)
    slab = 64 << 10
    s = open_stream(spec(d, "page"), seed=1, buffer_rows=200, slab_bytes=slab)
    assert s.segments[0].page_reads > 1  # these files compress well: pages are split
    worst, unit_max = 0.0, 0
    for _ in range(80):
        s.take(50)
        sim = s._plan_obj.sim
        live = float(row_bytes[sim.buf[: sim.size]].sum()) + 64 * 5 * len(s.cache)  # + buffer alignment
        unit_max = max([unit_max] + [nb for _, nb in s.cache.arena_units()])
        worst = max(worst, s.cache.arena.resident_bytes - live / SLAB_LIVE_RATIO / (1 - unit_max / slab))
    # memory held: the buffered rows' bytes / ratio (a slab's unused tail is less than one unit),
    # plus the newest slab and the spare ones
    assert worst <= (1 + s.cache.arena._max_spares) * slab
    assert not s.cache.arena._pending  # nothing points into emptied slabs once take() has returned
    assert s.cache.arena.copied_bytes < 8 * float(row_bytes.sum())


def test_page_mode_reads_each_page_once_per_part(src):
    d, paths, table = src
    fis = [scan.index_file(p, ["text"]).pages["text"] for p in paths]
    data = sum(int(f.unit_len.sum()) + int(f.chunk_dict_len.sum()) for f in fis)
    raw = sum(int(f.chunk_raw_len.sum()) for f in fis)
    for reads in (1, 2, None):
        s = open_stream(spec(d, "page", columns=["text"]), seed=1, buffer_rows=200, cache_dir=None, page_reads=reads)
        start = s.stats.bytes_read
        r = s.take(len(table))  # one epoch
        assert sorted(key_row(r.keys).tolist()) == list(range(len(table)))
        read = s.stats.bytes_read - start
        k = s.segments[0].page_reads
        assert k == (reads or k)
        assert read <= 1.05 * k * data  # each page once per part, each dictionary page at most once per part
        if reads is None:  # automatic: as many parts as the read budget allows, from the footers' sizes
            assert 1 < k <= MAX_PAGE_READS and k * data / raw <= READ_BUDGET * 1.05
    with pytest.raises(ValueError):
        open_stream(spec(d, "page"), seed=1, page_reads=0)


def test_page_parts_split_pages_exactly():
    starts = np.array([0, 10, 13, 40], np.int64)
    rows = np.array([10, 3, 27, 5], np.int64)
    lay = PageParts(starts, rows, np.array([3, 1, 2, 1]))
    units = lay.units_of(np.arange(4))
    assert units.tolist() == [0, 1, 2, 3, 6, 7, 9]  # stride 3: page u's parts are 3u, 3u+1, ...
    got = np.concatenate([lay.rows_of(int(v)) for v in units])
    assert sorted(got.tolist()) == list(range(45))
    assert (lay.size(units) == [len(lay.rows_of(int(v))) for v in units]).all()
    assert lay.rows_of(1).tolist() == [1, 4, 7]  # interleaved: row j of a page goes to part j mod parts
    v, loc = lay.unit_and_local(got)
    for u in units:
        assert (lay.rows_of(int(u))[loc[v == u]] == got[v == u]).all()
    sim = BufferShuffle(units[np.random.default_rng(0).permutation(len(units))], starts, rows, buffer_rows=8,
                        rows_per_page=6, rng=np.random.default_rng(1), parts=np.array([3, 1, 2, 1]))
    out, done = [], []
    while (b := sim.next_block()) is not None:
        out.append(b[0])
        done += b[1]
    assert sorted(np.concatenate(out).tolist()) == list(range(45)) and sorted(done) == units.tolist()


def test_stratified_permutation_spreads_every_prefix():
    rng = np.random.default_rng(0)
    for n in (0, 1, 2, 3, 7, 64, 1000):
        p = stratified_permutation(n, rng)
        assert sorted(p.tolist()) == list(range(n))
    n = 1024
    for _ in range(5):
        p = stratified_permutation(n, rng)
        for j in range(11):  # the first 2^j items hold one item of each of the 2^j strata
            m = 1 << j
            assert len(np.unique(p[:m] * m // n)) == m
    # not a power of two: still nearly one item per stratum
    p = stratified_permutation(1985, rng)
    assert len(np.unique(p[:64] * 64 // 1985)) >= 60
    # every item is equally likely at every place, as in a uniform permutation
    first = np.array([stratified_permutation(16, np.random.default_rng(s))[0] for s in range(4000)])
    counts = np.bincount(first, minlength=16)
    assert counts.min() > 180 and counts.max() < 330
    a, b = stratified_permutation(100, np.random.default_rng(1)), stratified_permutation(100, np.random.default_rng(2))
    assert (a != b).any()


def test_page_mode_first_fill_covers_the_source(tmp_path):
    """Window coverage: the first 1% of an epoch comes from (nearly) every 1% of the stored order.
    With P pages touched by then, an unstratified page order covers about 1 - 0.99^P of it."""
    import pyarrow.parquet as pq
    from tests.unit.loader_testdata import text_table
    n = 0
    for k in range(2):  # ~7 rows per page
        t = text_table(15000, k, n)
        n += len(t)
        pq.write_table(t, str(tmp_path / f"p{k}.parquet"), data_page_size=1024, write_batch_size=4,
                       row_group_size=5000, use_dictionary=False)
    for reads, want in ((1, 0.75), (2, 0.9)):
        s = open_stream(spec(str(tmp_path), "page", columns=["text", "row"]), seed=1, buffer_rows=600, page_reads=reads)
        first = key_row(s.take(n // 100).keys)
        pages = len(np.unique(s.index.unit_of_rows(first)))
        cover = len(np.unique(first * 100 // n)) / 100
        assert cover >= max(want, 1 - 0.99**pages + 0.05), (reads, pages, cover)

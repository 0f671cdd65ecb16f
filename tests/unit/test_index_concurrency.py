"""A source's files are indexed by a bounded pool of threads (issue 24): the index, the bad files and what each
lost are exactly those of indexing one file after another, on real Parquet files, with the sidecar cache cold
and warm; on an S3 server behind 100 ms of latency per request the pool overlaps the round trips."""

import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.unit.loader_testdata import write_source
from mixplane.loader import indexscan as scan
from mixplane.loader.parquet import IOStats
from mixplane.loader.stream import open_stream
from mixplane.spec import SourceSpec

COLUMNS = ["text", "row"]


def _source(tmp_path, nfiles=24):
    """nfiles real files, with and without OffsetIndexes, one of each bad kind among them."""
    d = str(tmp_path / "src")
    paths, table = write_source(d, nfiles=nfiles, rows=300, row_group_size=120, page_index=[True, True, False])
    with open(paths[3], "r+b") as f:  # corrupt footer length: not readable
        f.seek(-8, os.SEEK_END)
        f.write(b"\xff\xff\xff\x7fPAR1")
    open(paths[7], "wb").close()  # empty
    t = pq.read_table(paths[11])  # a column of another type: a mismatch
    pq.write_table(t.set_column(t.column_names.index("row"), "row", t.column("row").cast(pa.string())), paths[11])
    pq.write_table(t.drop_columns(["text"]), paths[15])  # no column text
    return d, paths


def _build(paths, threads, monkeypatch, cache_dir=None, **kw):
    monkeypatch.setenv("MIXPLANE_INDEX_THREADS", str(threads))
    bad = []
    idx = scan.build_source_index(paths, COLUMNS, cache_dir=cache_dir, on_bad=bad.append, **kw)
    return idx, bad


def _same(a, b):
    assert [f.path for f in a.files] == [f.path for f in b.files]
    assert a.fingerprint() == b.fingerprint() and a.num_rows == b.num_rows and a.num_units == b.num_units
    for c in COLUMNS:
        assert a.cols[c].keys() == b.cols[c].keys()
        for k in a.cols[c]:
            np.testing.assert_array_equal(a.cols[c][k], b.cols[c][k], err_msg=f"{c}.{k}")
    assert list(a.bad_files) == list(b.bad_files)
    assert [getattr(e, "pages_lost", None) for e in a.bad_files.values()] == \
           [getattr(e, "pages_lost", None) for e in b.bad_files.values()]


def test_pool_builds_exactly_the_sequential_index_bad_files_included(tmp_path, monkeypatch):
    _, paths = _source(tmp_path)
    one, bad1 = _build(paths, 1, monkeypatch)
    many, bad8 = _build(paths, 8, monkeypatch)
    _same(one, many)
    assert set(one.bad_files) == {paths[3], paths[7], paths[11], paths[15]}
    assert len(one.files) == len(paths) - 4
    # reported as one by one: unreadable files in path order, then the type mismatch found against the majority
    assert [e.file for e in bad1] == [e.file for e in bad8] == [paths[3], paths[7], paths[15], paths[11]]


def test_pool_with_the_sidecar_cache_cold_then_warm(tmp_path, monkeypatch):
    _, paths = _source(tmp_path)
    ref, _ = _build(paths, 1, monkeypatch)
    cache = str(tmp_path / "cache")
    cold, _ = _build(paths, 6, monkeypatch, cache_dir=cache)
    _same(ref, cold)
    # one sidecar per readable file (the mismatched one too: it is refused against the source, not unreadable),
    # none half written
    assert sorted(n.split(".parquet.")[0] for n in os.listdir(cache)) == sorted(
        os.path.basename(p)[: -len(".parquet")] for p in paths if p not in (paths[3], paths[7], paths[15]))
    stats = IOStats()
    warm, _ = _build(paths, 6, monkeypatch, cache_dir=cache, stats=stats)
    _same(ref, warm)
    # only the bad files are read again (a sidecar is kept only for a good file)
    assert 0 < stats.reads and stats.bytes_read < sum(os.path.getsize(p) for p in paths) / 4


def test_files_missing_or_changed_after_listing_are_bad_files_named_and_the_rest_indexed(tmp_path, monkeypatch):
    from mixplane.loader.files import list_source_files

    d, paths = _source(tmp_path, nfiles=16)
    files = list_source_files(d)
    os.remove(paths[5])  # gone between the listing and the read
    with open(paths[9], "r+b") as f:  # rewritten shorter: the listing's size no longer holds
        f.truncate(os.path.getsize(paths[9]) // 2)
    one, _ = _build(files.paths, 1, monkeypatch, sizes=files.sizes, mtimes=files.mtimes_ns)
    many, bad = _build(files.paths, 8, monkeypatch, sizes=files.sizes, mtimes=files.mtimes_ns)
    _same(one, many)
    assert {paths[5], paths[9]} <= set(many.bad_files)
    assert any(paths[5] in str(e) for e in bad) and any(paths[9] in str(e) for e in bad)
    assert len(many.files) == 16 - 6


def test_index_threads_setting_is_checked(tmp_path, monkeypatch):
    assert scan.index_workers(None, 1000) == scan.LOCAL_INDEX_THREADS
    assert scan.index_workers(None, 2) == 2
    monkeypatch.setenv("MIXPLANE_INDEX_THREADS", "0")
    with pytest.raises(ValueError, match="MIXPLANE_INDEX_THREADS"):
        scan.index_workers(None, 10)
    monkeypatch.setenv("MIXPLANE_INDEX_THREADS", "many")
    with pytest.raises(ValueError, match="MIXPLANE_INDEX_THREADS"):
        scan.index_workers(None, 10)


def test_stream_over_the_pool_delivers_what_the_sequential_stream_does(tmp_path, monkeypatch):
    d, paths = _source(tmp_path, nfiles=16)
    spec = SourceSpec(name="pool", uri=d, columns=COLUMNS, kind="text")
    got = []
    for threads in (1, 5):
        monkeypatch.setenv("MIXPLANE_INDEX_THREADS", str(threads))
        s = open_stream(spec, seed=3, buffer_rows=200, cache_dir=None)
        r = s.take(2000)
        got.append((r.keys.tolist(), r.columns["row"].to_pylist(), r.columns["text"].to_pylist(), s.quarantine.counts()))
    assert got[0] == got[1]


@pytest.mark.timeout(120)
def test_pool_overlaps_round_trips_on_s3(tmp_path, monkeypatch):
    from tests.s3server import MotoS3, S3Proxy, credentials_env
    from mixplane.loader.files import list_source_files

    for k, v in credentials_env().items():
        monkeypatch.setenv(k, v)
    server = MotoS3(process=True)  # its own process: the server does not share this interpreter's lock
    proxy = None
    try:
        d = str(tmp_path / "src")
        write_source(d, nfiles=16, rows=200, row_group_size=100)
        server.upload_dir(d, "corpus", "pool")
        proxy = S3Proxy(server.endpoint, latency_s=0.1)
        files = list_source_files("s3://corpus/pool/", endpoint=proxy.endpoint)
        assert len(files.paths) == 16
        took = {}
        for threads in (1, 16):
            t0 = time.monotonic()
            idx, bad = _build(files.paths, threads, monkeypatch, sizes=files.sizes, mtimes=files.mtimes_ns,
                              filesystem=files.filesystem)
            took[threads] = time.monotonic() - t0
            assert not bad and len(idx.files) == 16
            if threads == 1:
                ref = idx
        _same(ref, idx)
        # >= 2 requests of >= 100 ms per file: 16 files one by one take >= 3.2 s; 16 at once about 2 round trips
        assert took[1] >= 3.2 and took[16] < took[1] / 2, took
    finally:
        if proxy is not None:
            proxy.stop()
        server.stop()


def _good_source(tmp_path, nfiles=12):
    d = str(tmp_path / "good")
    paths, _ = write_source(d, nfiles=nfiles, rows=300, row_group_size=120, page_index=[True, False])
    return paths


def test_a_listing_seen_before_is_read_from_its_pack_alone(tmp_path, monkeypatch):
    from mixplane.loader import sidecar

    monkeypatch.setattr(sidecar, "PACK_MIN_FILES", 2)
    paths = _good_source(tmp_path)
    ref, _ = _build(paths, 1, monkeypatch)
    cache = tmp_path / "cache"
    cold, _ = _build(paths, 4, monkeypatch, cache_dir=str(cache))
    _same(ref, cold)
    packs = sorted(cache.glob(sidecar.PACK_PREFIX + "*.npz"))
    assert len(packs) == 1
    for p in cache.iterdir():  # only the pack left: the warm start reads it and nothing else
        if p not in packs:
            p.unlink()
    stats = IOStats()
    warm, _ = _build(paths, 4, monkeypatch, cache_dir=str(cache), stats=stats)
    _same(ref, warm)
    assert stats.reads == 0 and stats.bytes_read == 0
    assert [f.columns for f in warm.files] == [f.columns for f in ref.files]


def test_a_changed_listing_or_a_damaged_pack_falls_back_to_the_files(tmp_path, monkeypatch):
    from mixplane.loader import sidecar

    monkeypatch.setattr(sidecar, "PACK_MIN_FILES", 2)
    paths = _good_source(tmp_path)
    cache = tmp_path / "cache"
    _build(paths, 4, monkeypatch, cache_dir=str(cache))
    (pack,) = cache.glob(sidecar.PACK_PREFIX + "*.npz")
    # a file rewritten: another listing, another pack; the index is the new file's
    t = pq.read_table(paths[4]).slice(0, 100)
    pq.write_table(t, paths[4], row_group_size=50)
    fresh, _ = _build(paths, 1, monkeypatch)
    again, _ = _build(paths, 4, monkeypatch, cache_dir=str(cache))
    _same(fresh, again)
    assert again.files[4].num_rows == 100 and len(list(cache.glob(sidecar.PACK_PREFIX + "*.npz"))) == 2
    # a damaged pack is ignored
    (new_pack,) = set(cache.glob(sidecar.PACK_PREFIX + "*.npz")) - {pack}
    new_pack.write_bytes(new_pack.read_bytes()[:200])
    stats = IOStats()
    damaged, _ = _build(paths, 4, monkeypatch, cache_dir=str(cache), stats=stats)
    _same(fresh, damaged)


def test_a_listing_with_a_bad_file_packs_the_good_ones_and_reports_the_bad_on_every_start(tmp_path, monkeypatch):
    from mixplane.loader import sidecar

    monkeypatch.setattr(sidecar, "PACK_MIN_FILES", 2)
    _, paths = _source(tmp_path)
    ref, _ = _build(paths, 1, monkeypatch)
    cache = tmp_path / "cache"
    cold, bad = _build(paths, 4, monkeypatch, cache_dir=str(cache))
    _same(ref, cold)
    assert bad and len(list(cache.glob(sidecar.PACK_PREFIX + "*.npz"))) == 1
    assert not [p for p in cache.iterdir() if ".parquet." in p.name]  # no per-file sidecar beside the pack
    stats = IOStats()
    warm, bad_again = _build(paths, 4, monkeypatch, cache_dir=str(cache), stats=stats)
    _same(ref, warm)
    assert [e.file for e in bad_again] == [e.file for e in bad]  # reported on every start
    # the good files come from the pack: only the bad ones are read again
    bad_bytes = sum(os.path.getsize(p) for p in paths if p in ref.bad_files)
    assert 0 < stats.reads and stats.bytes_read <= bad_bytes
    assert len(list(cache.glob(sidecar.PACK_PREFIX + "*.npz"))) == 1  # the same pack, not rewritten


def test_a_listing_with_a_file_added_reuses_the_packed_files(tmp_path, monkeypatch):
    """A pack is keyed by file: a listing with one file more (or one rewritten) reads only that file, the rest
    come from the pack of the listing before, and the index equals a scan of every file."""
    from mixplane.loader import sidecar

    monkeypatch.setattr(sidecar, "PACK_MIN_FILES", 2)
    paths = _good_source(tmp_path, nfiles=12)
    cache = tmp_path / "cache"
    _build(paths[:11], 4, monkeypatch, cache_dir=str(cache))
    assert not [p for p in cache.iterdir() if ".parquet." in p.name]  # the pack only: no sidecar per file
    stats = IOStats()
    grown, _ = _build(paths, 4, monkeypatch, cache_dir=str(cache), stats=stats)
    ref, _ = _build(paths, 1, monkeypatch)
    _same(ref, grown)
    assert [f.columns for f in grown.files] == [f.columns for f in ref.files]
    assert 0 < stats.bytes_read <= os.path.getsize(paths[11])  # the new file alone was read
    # the grown listing has its own pack now: a warm start reads nothing
    stats = IOStats()
    warm, _ = _build(paths, 4, monkeypatch, cache_dir=str(cache), stats=stats)
    _same(ref, warm)
    assert stats.reads == 0
    # a file rewritten: that file is scanned again (its old index is never taken for it), the others reused
    t = pq.read_table(paths[4]).slice(0, 100)
    pq.write_table(t, paths[4], row_group_size=50)
    stats = IOStats()
    again, _ = _build(paths, 4, monkeypatch, cache_dir=str(cache), stats=stats)
    fresh, _ = _build(paths, 1, monkeypatch)
    _same(fresh, again)
    assert again.files[4].num_rows == 100 and 0 < stats.bytes_read <= os.path.getsize(paths[4])
    # only the last RECENT_PACKS packs are kept
    assert len(list(cache.glob(sidecar.PACK_PREFIX + "*.npz"))) == sidecar.RECENT_PACKS
    # a damaged recent-list or pack is ignored: every file is scanned again, the index is the same
    for p in cache.iterdir():
        p.write_bytes(p.read_bytes()[:40])
    stats = IOStats()
    damaged, _ = _build(paths, 4, monkeypatch, cache_dir=str(cache), stats=stats)
    _same(fresh, damaged)
    assert stats.bytes_read > 0


def test_a_packed_file_rewritten_or_removed_is_read_again_and_named_bad(tmp_path, monkeypatch):
    """A pack answers by the listing's (path, size, mtime): a file truncated since the pack was written is read
    from disk and named as a bad file, a removed one is gone, the others come from the pack."""
    from mixplane.loader import sidecar
    from mixplane.loader.files import list_source_files

    monkeypatch.setattr(sidecar, "PACK_MIN_FILES", 2)
    paths = _good_source(tmp_path, nfiles=8)
    cache = str(tmp_path / "cache")
    files = list_source_files(os.path.dirname(paths[0]))
    _build(files.paths, 4, monkeypatch, cache_dir=cache, sizes=files.sizes, mtimes=files.mtimes_ns)
    with open(paths[2], "r+b") as f:
        f.truncate(os.path.getsize(paths[2]) // 2)
    os.remove(paths[6])
    relisted = list_source_files(os.path.dirname(paths[0]))
    stats = IOStats()
    got, bad = _build(relisted.paths, 4, monkeypatch, cache_dir=cache, sizes=relisted.sizes,
                      mtimes=relisted.mtimes_ns, stats=stats)
    assert [e.file for e in bad] == [paths[2]] and paths[2] in str(bad[0])
    assert [f.path for f in got.files] == [p for i, p in enumerate(paths) if i not in (2, 6)]
    assert 0 < stats.bytes_read <= os.path.getsize(paths[2])  # the truncated file alone was read


def test_stream_from_a_pack_delivers_what_the_cold_stream_does(tmp_path, monkeypatch):
    from mixplane.loader import sidecar

    monkeypatch.setattr(sidecar, "PACK_MIN_FILES", 2)
    paths = _good_source(tmp_path)
    spec = SourceSpec(name="pack", uri=os.path.dirname(paths[0]), columns=COLUMNS, kind="text")
    cache = str(tmp_path / "cache")
    got = []
    for _ in range(2):  # cold (writes the pack), then warm (reads it)
        stats = IOStats()
        s = open_stream(spec, seed=5, buffer_rows=150, cache_dir=cache, stats=stats)
        if got:
            assert stats.reads == 0  # nothing read for the index
        r = s.take(3000)
        got.append((r.keys.tolist(), r.columns["row"].to_pylist(), r.columns["text"].to_pylist()))
    assert got[0] == got[1]


def test_files_added_in_rounds_give_the_index_of_one_build(tmp_path, monkeypatch):
    """A live source adds files to its index round by round: only the new files are folded in, and the arrays
    are those of indexing every file at once."""
    from mixplane.loader.pageindex import SourceIndex

    paths = _good_source(tmp_path, nfiles=10)
    whole, _ = _build(paths, 1, monkeypatch)
    idx = SourceIndex(COLUMNS)
    for lo, hi in ((0, 1), (1, 1), (1, 4), (4, 9), (9, 10)):
        scan.build_source_index(paths[lo:hi], COLUMNS, cache_dir=None, index=idx)
        part, _ = _build(paths[:hi], 1, monkeypatch)
        _same(part, idx)
    _same(whole, idx)
    assert idx.unit_of_rows([0, idx.num_rows - 1]).tolist() == whole.unit_of_rows([0, whole.num_rows - 1]).tolist()
    # each file's own page arrays are dropped once folded in (the source's arrays hold them): a rebuild that would
    # need them is refused, not silently wrong
    assert all(not f.pages and not len(f.rg_rows) for f in idx.files) and idx.files[0].num_rows > 0
    idx.files = idx.files[1:]
    with pytest.raises(RuntimeError, match="released"):
        idx.finish()

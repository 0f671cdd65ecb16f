"""Sources on S3: a real S3-compatible server (moto's standalone server) on 127.0.0.1 over HTTP, and a
proxy in front of it for throttling, refused credentials and latency. Batches equal the local copy's
in every shuffle mode; every failure class ends in a clear error or a retry, never a hang or wrong data."""

import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from tests.s3server import S3RVER_KEY, Fault, MotoS3, S3Proxy, S3rver, credentials_env
from tests.unit.loader_testdata import write_source
from mixplane.loader import remote
from mixplane.loader.files import SourceFilesError, list_source
from mixplane.loader.indexscan import index_file
from mixplane.loader.parquet import IOStats
from mixplane.loader.blockstream import BlockStream
from mixplane.loader.stream import open_stream
from mixplane.metrics import make_metrics
from mixplane.samples import key_epoch
from mixplane.spec import SourceSpec

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    saved = {k: os.environ.get(k) for k in credentials_env()}
    os.environ.update(credentials_env())
    server = MotoS3()
    local = str(tmp_path_factory.mktemp("local") / "src")
    paths, table = write_source(local, nfiles=3, rows=700, page_size=4096, row_group_size=400, dictionary=True)
    server.upload_dir(local, "corpus", "text")
    try:
        yield server, local, table
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(autouse=True)
def _no_index_cache(monkeypatch):
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")


@pytest.fixture
def proxy(s3):
    p = S3Proxy(s3[0].endpoint)
    try:
        yield p
    finally:
        p.stop()


def spec(uri, endpoint, mode="page", **kw):
    return SourceSpec(name="web", uri=uri, columns=["text", "row", "ids"], kind="text", shuffle=mode,
                      endpoint=endpoint, region="us-east-1", **kw)


def take_all(s, n):
    r = s.take(n)
    return r.keys.tolist(), {c: r.columns[c] for c in r.columns}


@pytest.mark.parametrize("mode", ["page", "row", "rowgroup", "sequential"])
def test_remote_batches_equal_local(s3, mode):
    server, local, table = s3
    n = len(table) + 300  # into the second epoch
    loc = open_stream(spec(local, None, mode), seed=5, buffer_rows=200)
    rem = open_stream(spec("s3://corpus/text/*.parquet", server.endpoint, mode), seed=5, buffer_rows=200)
    assert [os.path.basename(p) for p in rem.files.paths] == [os.path.basename(p) for p in loc.files.paths]
    k1, c1 = take_all(loc, n)
    k2, c2 = take_all(rem, n)
    assert k1 == k2
    for c in c1:
        assert c1[c].equals(c2[c]), c
    assert rem.stats.requests > 0 and loc.stats.requests == 0
    loc.close()
    rem.close()


def test_index_from_footer_and_offset_indexes_in_few_requests(s3, proxy, tmp_path):
    server, _, _ = s3
    rng = np.random.default_rng(0)
    t = pa.table({"text": [" ".join(map(str, rng.integers(0, 10**9, 40))) for _ in range(20_000)],
                  "row": np.arange(20_000), "ids": [[i] * 5 for i in range(20_000)]})
    local = str(tmp_path / "big.parquet")
    pq.write_table(t, local, data_page_size=4096, row_group_size=5000, write_page_index=True, use_dictionary=False,
                   write_batch_size=100)
    fs = server.filesystem()
    with open(local, "rb") as f, fs.open_output_stream("corpus/big/big.parquet") as o:
        o.write(f.read())
    assert os.path.getsize(local) > 4 * remote.DEFAULTS.tail_bytes
    proxy.reset_counts()
    fi = index_file("corpus/big/big.parquet", ["text", "row", "ids"], filesystem=server.filesystem(proxy.endpoint),
                    stats=IOStats())
    chunks = 4 * 3
    assert fi.num_pages() > 4 * 40  # every page of every chunk indexed (from the OffsetIndexes)
    # HEAD (open) + the tail (footer) + at most one read of all OffsetIndexes, not one per chunk (12)
    assert proxy.requests <= 3 < chunks, proxy.requests


@pytest.mark.parametrize("mode", ["page", "sequential", "rowgroup", "row"])
def test_read_ahead_coalesces_and_cuts_waiting(s3, proxy, monkeypatch, mode):
    """Every mode reads ahead: the same batches as without read-ahead, reads served from what was
    fetched ahead (none waits for its own round trip), and fewer requests than one per page and column."""
    server, local, table = s3
    uri = "s3://corpus/text/*.parquet"
    runs = {}
    monkeypatch.setattr(remote.DEFAULTS, "tail_bytes", 1024)  # small files: pages are not all inside the tail read
    for name, pages in (("naive", 0), ("ahead", 32)):
        monkeypatch.setattr(remote.DEFAULTS, "prefetch_pages", pages)
        monkeypatch.setattr(remote.DEFAULTS, "prefetch_chunks", 2 if pages else 0)
        monkeypatch.setattr(remote.DEFAULTS, "coalesce_gap", 0 if pages == 0 else 1 << 20)
        s = open_stream(spec(uri, proxy.endpoint, mode), seed=1, buffer_rows=100, row_block=64)
        proxy.reset_counts()
        runs[name] = (take_all(s, len(table) + 50), proxy.requests, s.stats.cache_hits, s.reader.ahead_misses)
        runs["split_hits"] = s.reader.split_hits
        s.close()
    (k0, c0), naive_requests, _, naive_misses = runs["naive"]
    (k1, c1), ahead_requests, hits, misses = runs["ahead"]
    assert k0 == k1 and all(c0[c].equals(c1[c]) for c in c0)
    assert hits > 0 and naive_misses > 0
    assert misses == 0, misses
    if mode == "page":  # pages split in parts: each decoded once while its other parts were planned
        assert runs["split_hits"] > 0
    assert ahead_requests < naive_requests, (ahead_requests, naive_requests)


def test_live_remote_source_picks_up_new_objects(s3, tmp_path):
    server, local, table = s3
    fs = server.filesystem()
    for name in ("part-00.parquet", "part-01.parquet"):
        fs.copy_file(f"corpus/text/{name}", f"corpus/live/{name}")
    s = open_stream(spec("s3://corpus/live/", server.endpoint, live=True), seed=0, buffer_rows=100, poll_s=0.2)
    first = s.index.num_rows
    r = s.take(first)
    assert len(r.keys) == first
    fs.copy_file("corpus/text/part-02.parquet", "corpus/live/part-02.parquet")
    deadline = time.monotonic() + 30
    got = []
    while time.monotonic() < deadline and len(got) < len(table) - first:
        got += s.take(len(table) - first - len(got), timeout=0.5).columns["row"].to_pylist()
    assert sorted(got) == list(range(first, len(table)))  # the new object's rows, each once
    s.close()


def test_missing_bucket_is_named(s3):
    server, _, _ = s3
    with pytest.raises(SourceFilesError, match="bucket 'no-such-bucket' does not exist"):
        list_source(spec("s3://no-such-bucket/text/*.parquet", server.endpoint))


def test_object_missing_or_deleted_mid_run_is_quarantined_by_name(s3):
    server, local, table = s3
    fs = server.filesystem()
    for name in ("part-00.parquet", "part-01.parquet", "part-02.parquet"):
        fs.copy_file(f"corpus/text/{name}", f"corpus/gone/{name}")
    sp = spec("s3://corpus/gone/*.parquet", server.endpoint)
    s = open_stream(sp, seed=2, buffer_rows=50)  # indexed: all three objects
    fs.delete_file("corpus/gone/part-01.parquet")  # deleted mid-run
    n0 = pq.ParquetFile(os.path.join(local, "part-00.parquet")).metadata.num_rows
    n1 = pq.ParquetFile(os.path.join(local, "part-01.parquet")).metadata.num_rows
    r = s.take(len(table) - n1)
    rows = r.columns["row"].to_pylist()
    assert (key_epoch(r.keys) == 0).all()
    assert sorted(rows) == [i for i in range(len(table)) if not n0 <= i < n0 + n1]
    exp = table.column("text").take(pa.array(rows)).combine_chunks()
    assert r.columns["text"].equals(exp)
    msgs = s.quarantine.messages()
    assert msgs and all("s3://corpus/gone/part-01.parquet" in m and "not found" in m for m in msgs)
    assert set(s.quarantine.counts()["by_kind"]) == {"missing_object"}
    s.close()
    # listed, then gone before it was indexed: the file is quarantined, the rest is served
    fs.copy_file("corpus/text/part-01.parquet", "corpus/gone/part-01.parquet")
    files = list_source(sp)
    fs.delete_file("corpus/gone/part-02.parquet")
    s = open_stream(sp, seed=2, buffer_rows=50, files=files)
    assert s.quarantine.counts()["files"] == 1 and "part-02.parquet" in s.quarantine.messages()[0]
    assert s.index.num_rows == n0 + n1
    s.close()


def test_truncated_object_is_quarantined_rest_served(s3, tmp_path):
    server, local, table = s3
    fs = server.filesystem()
    for name in ("part-00.parquet", "part-02.parquet"):
        fs.copy_file(f"corpus/text/{name}", f"corpus/trunc/{name}")
    raw = open(os.path.join(local, "part-01.parquet"), "rb").read()
    with fs.open_output_stream("corpus/trunc/part-01.parquet") as o:
        o.write(raw[: len(raw) // 2])
    s = open_stream(spec("s3://corpus/trunc/*.parquet", server.endpoint), seed=0, buffer_rows=50)
    assert s.quarantine.counts()["by_kind"] == {"corrupt_file": 1}
    assert "part-01.parquet" in s.quarantine.messages()[0] and "magic" in s.quarantine.messages()[0]
    n0 = pq.ParquetFile(os.path.join(local, "part-00.parquet")).metadata.num_rows
    n2 = pq.ParquetFile(os.path.join(local, "part-02.parquet")).metadata.num_rows
    r = s.take(n0 + n2)
    assert (key_epoch(r.keys) == 0).all() and len(set(r.columns["row"].to_pylist())) == n0 + n2
    s.close()


def test_throttling_is_retried_to_the_same_batches(s3, proxy):
    server, local, table = s3
    loc = open_stream(spec(local, None), seed=9, buffer_rows=100)
    k0, c0 = take_all(loc, 600)
    proxy.inject(Fault(503, count=4, code="SlowDown", match=lambda m, p: m == "GET" and "part-01" in p))
    proxy.inject(Fault(500, count=2, code="InternalError", match=lambda m, p: m == "GET" and ".parquet" in p))
    s = open_stream(spec("s3://corpus/text/*.parquet", proxy.endpoint), seed=9, buffer_rows=100)
    k1, c1 = take_all(s, 600)
    assert k0 == k1 and all(c0[c].equals(c1[c]) for c in c0)
    assert s.stats.retries >= 6 and all(f.fired == f.count for f in proxy.faults)
    assert s.quarantine.counts()["units"] == 0
    m = make_metrics("loader")  # what the loader server exports from these stats
    m.loader_remote_retries.labels("web").inc(s.stats.retries)
    assert m.registry.get_sample_value("mixplane_loader_remote_retries_total", {"source": "web"}) >= 6
    s.close()
    loc.close()


def test_throttling_that_never_ends_is_a_clear_error_not_a_hang(s3, proxy, monkeypatch):
    monkeypatch.setattr(remote.DEFAULTS, "attempts", 3)
    proxy.inject(Fault(503, count=10_000, code="SlowDown", match=lambda m, p: m == "GET" and "list-type" not in p))
    t0 = time.monotonic()
    with pytest.raises(remote.RemoteUnavailableError, match=r"s3://corpus/text/part-0\d.parquet.*after 3 attempts"):
        open_stream(spec("s3://corpus/text/*.parquet", proxy.endpoint), seed=0, buffer_rows=50)
    assert time.monotonic() - t0 < 30


def test_refused_credentials_are_a_clear_error(s3, proxy):
    proxy.inject(Fault(403, count=10_000, code="InvalidAccessKeyId"))
    with pytest.raises(SourceFilesError, match="access denied.*credentials"):
        open_stream(spec("s3://corpus/text/*.parquet", proxy.endpoint), seed=0, buffer_rows=50)
    proxy.faults.clear()
    # refused after listing (e.g. a key rotated mid-run): reading stops with the object named
    s = open_stream(spec("s3://corpus/text/*.parquet", proxy.endpoint), seed=0, buffer_rows=50)
    s.reader.close()
    proxy.inject(Fault(403, count=10_000, code="AccessDenied"))
    with pytest.raises(remote.AccessDeniedError, match=r"s3://corpus/text/part-0\d.parquet: access denied"):
        s.take(100)
    s.close()


def test_credentials_refused_by_a_server_that_checks_them(s3, monkeypatch):
    """s3rver checks access keys (moto's server does not): wrong keys from the environment are refused
    at listing with a clear error; the right ones read the same batches as the local copy."""
    _, local, table = s3
    server = S3rver(("corpus",))
    try:
        server.upload_dir(local, "corpus", "text")
        for k, v in credentials_env("not-the-key").items():
            monkeypatch.setenv(k, v)
        with pytest.raises(SourceFilesError, match="access denied.*credentials"):
            open_stream(spec("s3://corpus/text/*.parquet", server.endpoint), seed=0, buffer_rows=50)
        for k, v in credentials_env(S3RVER_KEY).items():
            monkeypatch.setenv(k, v)
        rem = open_stream(spec("s3://corpus/text/*.parquet", server.endpoint), seed=4, buffer_rows=80)
        loc = open_stream(spec(local, None), seed=4, buffer_rows=80)
        a, b = rem.take(len(table)), loc.take(len(table))
        assert a.keys.tolist() == b.keys.tolist() and a.columns["text"].equals(b.columns["text"])
        rem.close()
        loc.close()
    finally:
        server.stop()


def test_spec_never_holds_credentials():
    fields = set(SourceSpec.model_fields)
    assert {"endpoint", "region"} <= fields
    assert not fields & {"access_key", "secret_key", "secret_access_key", "session_token", "password", "credentials"}
    assert np.isfinite(remote.backoff(3, remote.DEFAULTS))


def test_loader_server_exports_remote_request_metrics(s3, tmp_path):
    from mixplane.loader.server import LoaderServer
    from mixplane.spec import parse_spec
    from tests.integration.test_transport_multimodal import _tokenizer

    server_s3, _, _ = s3
    _tokenizer(tmp_path / "tok.json")
    spec = parse_spec({
        "name": "remote-metrics",
        "sources": [{"name": "web", "uri": "s3://corpus/text/*.parquet", "endpoint": server_s3.endpoint,
                     "region": "us-east-1", "columns": ["text"], "tokenizer": str(tmp_path / "tok.json")}],
        "batch": {"sequences": 2, "seq_len": 64, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": 1}}},
        "runtime": {"window": 8, "metrics": False},
    })
    server = LoaderServer(spec, 0, 0, "tcp://127.0.0.1:9")  # never connected: the test drives _fill by hand
    try:
        server.welcomed = True
        server.window.seek({"low": 0})
        assert server._fill()
        reg = server.m.registry
        st = server.stream.stats
        assert reg.get_sample_value("mixplane_loader_remote_requests_total", {"source": "web"}) == st.requests > 0
        assert reg.get_sample_value("mixplane_loader_remote_bytes_total", {"source": "web"}) == st.bytes_read > 0
        assert reg.get_sample_value("mixplane_loader_remote_request_seconds_count", {"source": "web"}) > 0
    finally:
        server.close()


@pytest.mark.parametrize("mode", ["page", "rowgroup"])
def test_disk_cache_serves_a_restarted_stream_and_stays_bounded(s3, proxy, tmp_path, mode):
    """A second stream over the same objects (a restarted loader) reads its pages from the disk cache:
    no ranged GET of page data, the same batches as the local copy; a damaged cache file is re-read
    from the server, never served; the cache stays under its bound."""
    server, local, table = s3
    cache = tmp_path / "cache"
    uri = "s3://corpus/text/*.parquet"
    n = len(table)
    loc = open_stream(spec(local, None, mode), seed=3, buffer_rows=150)
    want = take_all(loc, n)
    loc.close()

    def run():
        s = open_stream(spec(uri, proxy.endpoint, mode, read_cache_dir=str(cache)), seed=3, buffer_rows=150)
        proxy.reset_counts()
        got = take_all(s, n)
        out = (got, proxy.get_bytes, s.reader.disk)
        s.close()
        return out

    (k1, c1), bytes1, disk1 = run()
    assert disk1 is not None and disk1.writes > 0
    (k2, c2), bytes2, disk2 = run()
    assert k1 == k2 == want[0] and all(c1[c].equals(want[1][c]) and c2[c].equals(want[1][c]) for c in c1)
    assert bytes1 > 50_000 and bytes2 == 0, (bytes1, bytes2)  # no page data over the network the second time
    assert disk2.hits > 0 and disk2.misses == 0
    # damage every cached file: the third stream detects it, re-reads from the server, same batches
    for d in os.scandir(cache):
        for f in os.scandir(d.path):
            with open(f.path, "r+b") as fh:
                fh.seek(0)
                fh.write(b"\xff\xfe")
    (k3, c3), bytes3, disk3 = run()
    assert k3 == want[0] and all(c3[c].equals(want[1][c]) for c in c3)
    assert disk3.damaged > 0 and bytes3 > 50_000
    # a bound smaller than the source: the cache never holds more than it
    small = spec(uri, proxy.endpoint, mode, read_cache_dir=str(tmp_path / "small"), read_cache_gb=30_000 / (1 << 30))
    s = open_stream(small, seed=3, buffer_rows=150)
    assert take_all(s, n)[0] == want[0]
    s.reader.ahead.close()  # let the write-behind finish
    total = sum(f.stat().st_size for d in os.scandir(tmp_path / "small") for f in os.scandir(d.path))
    assert 0 < total <= 30_000 and s.reader.disk.evictions > 0
    s.close()


def test_page_index_of_remote_objects_cached_locally(s3, proxy, tmp_path, monkeypatch):
    """The page index built from an object's footer and OffsetIndexes is kept in the local sidecar cache:
    a second open of the source lists the bucket and reads nothing else."""
    server, local, table = s3
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", str(tmp_path / "idx"))
    opened = []
    for _ in range(2):
        proxy.reset_counts()
        s = open_stream(spec("s3://corpus/text/*.parquet", proxy.endpoint), seed=0, buffer_rows=100)
        opened.append((proxy.requests, proxy.get_bytes, s.index.num_pages))
        s.close()
    (req1, bytes1, pages1), (req2, bytes2, pages2) = opened
    assert pages1 == pages2 > 0
    assert req1 > 3 and bytes1 > 0  # listing + per object: HEAD and footer reads
    assert bytes2 < 2_000 and req2 <= 2, (req2, bytes2)  # the listing only


def test_page_index_kept_beside_the_data_serves_a_new_loader(s3, proxy, tmp_path, monkeypatch):
    """`index_beside_data`: the first loader keeps each object's page index beside it in the bucket; a loader
    with an empty local cache (a new pod, another node) then reads one small object per file instead of its
    footer and OffsetIndexes, with the same batches; an object rewritten since is indexed again, not served
    its old index."""
    server, _, _ = s3
    fs = server.filesystem()
    src = "corpus/text"
    for info in fs.get_file_info(pafs.FileSelector(src)):
        if info.path.endswith(".parquet"):
            fs.copy_file(info.path, info.path.replace("/text/", "/beside/"))
    uri = "s3://corpus/beside/*.parquet"
    # loader A (straight to the server: the test proxy does not forward chunked uploads) keeps the indexes
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", str(tmp_path / "local-a"))
    s = open_stream(spec(uri, server.endpoint, index_beside_data=True), seed=3, buffer_rows=100)
    keys_a, cols_a = take_all(s, 500)
    s.close()
    def page_indexes():  # the files' page indexes (the source's kept listing is in listings/ beside them)
        return sorted(i.path for i in fs.get_file_info(pafs.FileSelector("corpus/beside/_mixplane_index"))
                      if i.type == pafs.FileType.File)

    kept = page_indexes()
    files = sorted(i.path for i in fs.get_file_info(pafs.FileSelector("corpus/beside")) if i.path.endswith(".parquet"))
    assert len(kept) == len(files) == 3 and all(k.endswith(".npz") for k in kept), kept
    # loader B (a new pod: empty local cache) reads them; loader C, without the option, scans every object
    seen = {}
    for name, beside in (("b", True), ("c", False)):
        monkeypatch.setenv("MIXPLANE_INDEX_CACHE", str(tmp_path / f"local-{name}"))
        proxy.reset_counts()
        s = open_stream(spec(uri, proxy.endpoint, index_beside_data=beside), seed=3, buffer_rows=100)
        seen[name] = (proxy.requests, proxy.get_bytes, s.index.num_pages, list(proxy.seen))
        keys, cols = take_all(s, 500)
        s.close()
        assert keys == keys_a and all(cols[c].equals(cols_a[c]) for c in cols), name
    assert seen["b"][2] == seen["c"][2] > 0
    # B: the listing kept beside the data (loader.listing) and each object's kept index (pyarrow asks a HEAD before
    # the GET), no request to the data objects at all; C: the listing, then a HEAD and the tail (footer,
    # OffsetIndexes) of every data object
    b_paths, c_paths = [p for _, p in seen["b"][3]], [p for _, p in seen["c"][3]]
    b_indexes = [p for p in b_paths if p.endswith(".npz") and "/listings/" not in p]
    assert not [p for p in b_paths if p.endswith(".parquet")] and len(b_indexes) == 2 * len(files), b_paths
    assert sum(p.endswith(".parquet") for p in c_paths) >= 2 * len(files), c_paths
    # requests: B's two per kept index stand for C's two per data object; B's kept listing is two objects read
    # (latest.json and the listing, a HEAD and a GET each) where C lists (one request per 1,000 keys)
    listing_reads = [p for p in b_paths if "/listings/" in p]
    assert len(listing_reads) == 4 and seen["b"][0] == len(b_indexes) + 4, b_paths
    assert seen["c"][0] >= 1 + 2 * len(files) and seen["b"][1] < seen["c"][1], (seen["b"][:2], seen["c"][:2])
    assert all(f not in kept for f in files)  # the indexes never become part of the source

    # an object rewritten (other size and mtime): its kept index is another file's, so it is indexed again
    t = pq.read_table(fs.open_input_file(files[0]))
    with fs.open_output_stream(files[0]) as o:
        pq.write_table(t.slice(0, t.num_rows // 2), o, data_page_size=4096, write_page_index=True)
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", str(tmp_path / "local-3"))
    # (a start that lists the store: a kept listing would name the object's former version, which is quarantined)
    s = open_stream(spec(uri, server.endpoint, index_beside_data=True, listing_max_age_s=0), seed=3, buffer_rows=100)
    assert s.index.num_rows == sum(pq.ParquetFile(fs.open_input_file(f)).metadata.num_rows for f in files)
    s.close()
    # ... and the index of its former version is removed from the bucket (every rewrite used to leave one behind)
    now = page_indexes()
    base = files[0].split("/")[-1] + "."
    old = [k for k in kept if k.split("/")[-1].startswith(base)]
    assert len(old) == 1 and len(now) == 3 and old[0] not in now, (kept, now)
    assert set(kept) - set(old) <= set(now) and sum(n.split("/")[-1].startswith(base) for n in now) == 1, (kept, now)


def test_a_remote_source_read_block_by_block_equals_local(s3, tmp_path):
    """A source of many objects read block by block (the next block indexed, and its first pages fetched, while one
    is read): the same keys and values as the same files read locally, across blocks and into the next epoch."""
    server, _, _ = s3
    local = tmp_path / "many"
    local.mkdir()
    for k in range(24):
        write_source(str(tmp_path / f"w{k}"), nfiles=1, rows=30 + k, page_size=512, row_group_size=16, seed=k)
        os.rename(tmp_path / f"w{k}" / "part-00.parquet", local / f"f{k:02d}.parquet")
    server.upload_dir(str(local), "corpus", "many")
    more = {"lazy_index_files": 16, "block_files": 5}
    loc = open_stream(spec(str(local), None, **more), seed=2, buffer_rows=40)
    rem = open_stream(spec("s3://corpus/many/", server.endpoint, **more), seed=2, buffer_rows=40)
    try:
        assert isinstance(rem, BlockStream) and rem.per_epoch == 5
        n = sum(30 + k for k in range(24)) + 100
        k1, c1 = take_all(loc, n)
        k2, c2 = take_all(rem, n)
        assert k1 == k2 and set(key_epoch(np.asarray(k2)).tolist()) == {0, 1}
        for c in c1:
            assert c1[c].equals(c2[c]), c
        assert rem.stats.requests > 0
    finally:
        loc.close()
        rem.close()

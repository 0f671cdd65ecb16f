"""The kept listing on S3 (moto's server on 127.0.0.1, a counting proxy in front of it): the second start of a
source of 2,000 keys sends no request at all, `mixplane listing --refresh` lists again and sees a new key, a new pod
(another cache) finds the listing kept beside the data without listing the source, and a file deleted after its
listing was kept is quarantined by name while the rest is delivered."""

from __future__ import annotations

import json
import os

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from mixplane.cli import main
from mixplane.loader import listing
from mixplane.loader.files import list_source
from mixplane.loader.listing import find_kept, source_listing
from mixplane.loader.stream import open_stream
from mixplane.samples import key_epoch
from mixplane.spec import SourceSpec
from tests.s3server import MotoS3, S3Proxy, credentials_env
from tests.unit.loader_testdata import write_source

pytestmark = pytest.mark.timeout(120)
KEYS = 2000  # two pages of a LIST (1,000 keys each)


@pytest.fixture(scope="module")
def s3():
    saved = {k: os.environ.get(k) for k in credentials_env()}
    os.environ.update(credentials_env())
    server = MotoS3()
    server.put_keys("kept-listing", [f"many/f{i:05d}.parquet" for i in range(KEYS)])
    try:
        yield server
    finally:
        server.filesystem().delete_dir("kept-listing")  # moto's servers in one process share their buckets
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def proxy(s3):
    p = S3Proxy(s3.endpoint)
    try:
        yield p
    finally:
        p.stop()


def _spec(uri: str, endpoint: str, **kw) -> SourceSpec:
    return SourceSpec(name="web", uri=uri, columns=["text", "row", "ids"], kind="text", shuffle="page",
                      endpoint=endpoint, region="us-east-1", **kw)


def _lists(proxy: S3Proxy) -> list[str]:
    """The LIST requests (ListObjectsV2) the proxy saw since its counts were reset."""
    return [p for m, p in proxy.seen if m == "GET" and "list-type=" in p]


def test_second_start_sends_no_request_and_refresh_lists_again(s3, proxy, tmp_path, monkeypatch, capsys):
    cache = str(tmp_path / "cache")
    sp = _spec("s3://kept-listing/many/", proxy.endpoint)
    first = source_listing(sp, cache_dir=cache)
    assert len(first.paths) == KEYS and first.kept_from is None
    assert len(_lists(proxy)) >= 2, proxy.seen  # listed: a page per 1,000 keys
    proxy.reset_counts()
    second = source_listing(sp, cache_dir=cache)
    assert proxy.seen == []  # not one request to the store
    assert second.kept_from is not None and (second.paths, second.sizes, second.mtimes_ns) == (
        first.paths, first.sizes, first.mtimes_ns)
    assert second.filesystem.type_name == "s3" and second.digest == first.digest

    # a key written since: not in the kept listing; `mixplane listing --refresh` lists again and keeps it
    s3.put_keys("kept-listing", ["many/zz-new.parquet"])
    assert "kept-listing/many/zz-new.parquet" not in source_listing(sp, cache_dir=cache).paths
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", cache)
    doc = {"name": "m", "sources": [{"name": "web", "uri": sp.uri, "endpoint": proxy.endpoint, "region": "us-east-1",
                                     "kind": "text", "columns": ["text"], "tokenizer": "tok.json"}],
           "mixture": {"weights": {"web": 1.0}}, "batch": {"sequences": 2, "seq_len": 64},
           "topology": {"modules": {"backbone": {"dp": 1}}}}
    path = tmp_path / "m.json"
    path.write_text(json.dumps(doc))
    proxy.reset_counts()
    assert main(["listing", str(path), "--refresh"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["files"] == KEYS + 1 and out["kept_from"] == "listed" and len(_lists(proxy)) >= 2
    proxy.reset_counts()
    after = source_listing(sp)  # the default cache (MIXPLANE_INDEX_CACHE): the refreshed listing, no request
    assert proxy.seen == [] and "kept-listing/many/zz-new.parquet" in after.paths and after.digest == out["digest"]


def test_a_new_pod_finds_the_listing_beside_the_data_without_listing(s3, proxy, tmp_path):
    uri = "s3://kept-listing/many/"
    # pod A (straight to the server: the test proxy does not forward chunked uploads) lists and keeps it
    a = _spec(uri, s3.endpoint, index_beside_data=True)
    listed = source_listing(a, cache_dir=str(tmp_path / "pod-a"))
    assert listed.kept_from is None
    fs = s3.filesystem()
    kept_dir = f"kept-listing/many/_mixplane_index/{listing.LISTINGS_DIR}/{listing.beside_key(uri)}"
    names = sorted(i.path.rsplit("/", 1)[1] for i in fs.get_file_info(pafs.FileSelector(kept_dir)))
    assert names == sorted([f"{listed.digest}.npz", listing.LATEST]), names
    assert len(list_source(a).paths) == KEYS + 1  # the kept listing never becomes part of the source

    # pod B: an empty cache, another endpoint to the same store: two small objects read, no LIST at all
    b = _spec(uri, proxy.endpoint, index_beside_data=True)
    proxy.reset_counts()
    got = source_listing(b, cache_dir=str(tmp_path / "pod-b"))
    assert _lists(proxy) == [] and all("/_mixplane_index/" in p for _, p in proxy.seen), proxy.seen
    assert got.kept_from == f"s3://{kept_dir}/{listed.digest}.npz" and got.paths == listed.paths
    # ... and keeps it in its own cache: its next start reads only the newest record beside the data
    proxy.reset_counts()
    again = source_listing(b, cache_dir=str(tmp_path / "pod-b"))
    assert again.kept_from is not None and not again.kept_from.startswith("s3://") and again.paths == listed.paths
    assert _lists(proxy) == [] and all(p.endswith(listing.LATEST) for _, p in proxy.seen), proxy.seen
    # a run pinned to the listing finds it by its digest from either place
    assert find_kept(b, listed.digest, cache_dir="").kept_from == got.kept_from
    assert find_kept(b, listed.digest, cache_dir=str(tmp_path / "pod-b")).kept_from == again.kept_from


def test_a_file_deleted_after_the_listing_was_kept_is_quarantined(s3, tmp_path, monkeypatch):
    local = str(tmp_path / "src")
    _, table = write_source(local, nfiles=3, rows=300, page_size=2048, row_group_size=100)
    s3.upload_dir(local, "kept-listing", "gone")
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", str(tmp_path / "cache"))
    sp = _spec("s3://kept-listing/gone/*.parquet", s3.endpoint)
    assert len(source_listing(sp).paths) == 3  # listed and kept
    s3.filesystem().delete_file("kept-listing/gone/part-01.parquet")
    s = open_stream(sp, seed=2, buffer_rows=50)  # from the kept listing: the deleted file is in it
    try:
        assert s.files.kept_from is not None and "kept-listing/gone/part-01.parquet" in s.files.paths
        n0, n1 = (pq.ParquetFile(os.path.join(local, f"part-0{k}.parquet")).metadata.num_rows for k in (0, 1))
        msgs = s.quarantine.messages()
        assert len(msgs) == 1 and "part-01.parquet" in msgs[0], msgs
        r = s.take(len(table) - n1)
        rows = r.columns["row"].to_pylist()
        assert (key_epoch(r.keys) == 0).all()
        assert sorted(rows) == [i for i in range(len(table)) if not n0 <= i < n0 + n1]
    finally:
        s.close()

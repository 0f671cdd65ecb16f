"""gs:// (pyarrow's native GCS client against gcp-storage-emulator, its own process on 127.0.0.1) and
http(s):// (fsspec's HTTP filesystem wrapped as a pyarrow filesystem, the path hf:// takes too, against a
range-serving HTTP server on 127.0.0.1): batches equal to the local copy, read-ahead serving every read,
missing objects named, throttling retried. hf:// itself is checked for its wiring only (no Hub server
is installable here)."""

import os

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from tests.s3server import GcsEmulator, RangeHTTPServer
from tests.unit.loader_testdata import write_source
from mixplane.loader import remote
from mixplane.loader.files import SourceFilesError, list_source
from mixplane.loader.stream import open_stream
from mixplane.samples import key_epoch
from mixplane.spec import SourceSpec

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    local = str(root / "src")
    _, table = write_source(local, nfiles=3, rows=600, page_size=4096, row_group_size=300, dictionary=True)
    return str(root), local, table


@pytest.fixture(autouse=True)
def _no_index_cache(monkeypatch):
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")


def spec(uri, endpoint=None, mode="page"):
    return SourceSpec(name="web", uri=uri, columns=["text", "row", "ids"], kind="text", shuffle=mode, endpoint=endpoint)


def same_as_local(local, uri, endpoint, mode, n):
    loc = open_stream(spec(local, None, mode), seed=2, buffer_rows=150)
    rem = open_stream(spec(uri, endpoint, mode), seed=2, buffer_rows=150)
    assert [os.path.basename(p) for p in rem.files.paths] == [os.path.basename(p) for p in loc.files.paths]
    a, b = loc.take(n), rem.take(n)
    assert a.keys.tolist() == b.keys.tolist()
    for c in a.columns:
        assert a.columns[c].equals(b.columns[c]), c
    assert rem.stats.requests > 0 and rem.reader.ahead is not None and rem.reader.ahead_misses == 0
    loc.close()
    rem.close()


@pytest.fixture(scope="module")
def gcs(corpus):
    root, local, table = corpus
    saved = os.environ.get("MIXPLANE_GCS_ANONYMOUS")
    os.environ["MIXPLANE_GCS_ANONYMOUS"] = "1"
    server = GcsEmulator("corpus")
    server.upload_dir(local, "corpus", "text")
    try:
        yield server
    finally:
        server.stop()
        if saved is None:
            os.environ.pop("MIXPLANE_GCS_ANONYMOUS", None)
        else:
            os.environ["MIXPLANE_GCS_ANONYMOUS"] = saved


@pytest.mark.parametrize("mode", ["page", "rowgroup", "sequential"])
def test_gcs_batches_equal_local(corpus, gcs, mode):
    _, local, table = corpus
    files = list_source(spec("gs://corpus/text/*.parquet", gcs.endpoint))
    assert isinstance(files.filesystem, pafs.GcsFileSystem) and len(files.paths) == 3
    same_as_local(local, "gs://corpus/text/*.parquet", gcs.endpoint, mode, len(table) + 100)


def test_gcs_missing_object_and_bucket_named(corpus, gcs):
    _, local, table = corpus
    fs = gcs.filesystem()
    fs.copy_file("corpus/text/part-00.parquet", "corpus/gone/part-00.parquet")
    fs.copy_file("corpus/text/part-01.parquet", "corpus/gone/part-01.parquet")
    s = open_stream(spec("gs://corpus/gone/", gcs.endpoint), seed=0, buffer_rows=100)
    fs.delete_file("corpus/gone/part-01.parquet")
    n0 = pq.ParquetFile(os.path.join(local, "part-00.parquet")).metadata.num_rows
    r = s.take(n0)  # the deleted object's rows are quarantined, part-00's all delivered in epoch 0
    assert (key_epoch(r.keys) == 0).all() and sorted(r.columns["row"].to_pylist()) == list(range(n0))
    assert set(s.quarantine.counts()["by_kind"]) == {"missing_object"}
    assert all("gs://corpus/gone/part-01.parquet" in m and "not found" in m for m in s.quarantine.messages())
    s.close()
    with pytest.raises(SourceFilesError, match="nobucket"):
        list_source(spec("gs://nobucket/x/*.parquet", gcs.endpoint))


@pytest.fixture(scope="module")
def http(corpus):
    root, _, _ = corpus
    server = RangeHTTPServer(root)
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("mode,uri", [("page", "src/"), ("row", "src/*.parquet"), ("rowgroup", "src/part-0*.parquet")])
def test_http_batches_equal_local(corpus, http, mode, uri):
    _, local, table = corpus
    files = list_source(spec(f"{http.endpoint}/{uri}"))
    assert type(files.filesystem).__name__ == "PyFileSystem" and len(files.paths) == 3
    assert all(p.startswith(http.endpoint) for p in files.paths)
    http.requests = 0
    same_as_local(local, f"{http.endpoint}/{uri}", None, mode, len(table) + 100)
    assert http.requests > 0


def test_http_throttling_retried_and_missing_object_named(corpus, http, tmp_path):
    _, local, table = corpus
    s = open_stream(spec(f"{http.endpoint}/src/"), seed=0, buffer_rows=100)
    loc = open_stream(spec(local), seed=0, buffer_rows=100)
    # 503 x6: fsspec answers a failed HEAD with a GET of its own, so an attempt fails only when both do
    # (up to three files are opened at once by the read-ahead threads); ours retry with backoff, same rows
    http.fail_next = 6
    r = s.take(200)
    assert http.fail_next == 0 and s.stats.retries >= 1
    assert r.keys.tolist() == loc.take(200).keys.tolist()
    s.close()
    loc.close()
    with pytest.raises(remote.MissingObjectError, match="nothing-here.parquet"):
        remote.with_retries("opening", "x/nothing-here.parquet",
                            lambda: remote.open_ranged(remote.fsspec_filesystem("http"),
                                                       f"{http.endpoint}/src/nothing-here.parquet"))


def test_hf_wiring():
    """hf:// goes through huggingface_hub's HfFileSystem inside pyarrow's FSSpecHandler, the spec's
    endpoint as the Hub's address (not exercised against a server: none is installable here)."""
    fs = remote.fsspec_filesystem("hf", endpoint="http://127.0.0.1:9")
    inner = remote.fsspec_of(fs)
    assert type(inner).__name__ == "HfFileSystem" and inner.endpoint == "http://127.0.0.1:9"
    assert remote.object_name(fs, "datasets/org/corpus/data/part-0.parquet") == "hf://datasets/org/corpus/data/part-0.parquet"
    assert remote.is_remote(fs)

"""`sources[].index_beside_data`: each file's page index kept beside it (`<dir>/_mixplane_index/`), read by a
loader whose own cache is empty, ignored when it is another file's, and never fatal when it cannot be written."""

from __future__ import annotations

import os

from mixplane.loader import indexscan, sidecar
from mixplane.loader.files import list_source_files
from mixplane.loader.listing import LISTINGS_DIR
from mixplane.loader.stream import open_stream
from mixplane.spec import SourceSpec
from tests.unit.loader_testdata import write_source


def _spec(root: str, **kw) -> SourceSpec:
    return SourceSpec(name="web", uri=root, columns=["text", "row", "ids"], kind="text", shuffle="page", **kw)


def test_kept_beside_read_by_a_new_loader_and_never_fatal(tmp_path, monkeypatch):
    root = str(tmp_path / "src")
    write_source(root, nfiles=2, rows=300, page_size=2048, row_group_size=100, dictionary=True)
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")  # no local cache: only what is beside the data
    s = open_stream(_spec(root, index_beside_data=True), seed=1, buffer_rows=50)
    first = s.take(200).keys.tolist()
    s.close()
    kept = sorted(os.listdir(os.path.join(root, "_mixplane_index")))
    assert len(kept) == 2 and all(k.endswith(".npz") for k in kept)

    scans = []
    real = indexscan.index_file
    monkeypatch.setattr(indexscan, "index_file", lambda *a, **k: scans.append(a[0]) or real(*a, **k))
    s = open_stream(_spec(root, index_beside_data=True), seed=1, buffer_rows=50)
    assert s.take(200).keys.tolist() == first and scans == []  # served from beside the data, nothing scanned
    assert len(s.index.files) == 2  # the index files are not part of the source
    s.close()
    for uri in (f"{root}/**", f"{root}/*/*", f"{root}/**/*.npz"):  # nor of any glob's: no file quarantined
        assert all("_mixplane_index" not in p for p in list_source_files(uri).paths), uri
    s = open_stream(_spec(f"{root}/**", index_beside_data=True), seed=1, buffer_rows=50)
    assert s.take(200).keys.tolist() == first and len(s.index.files) == 2 and not s.index.bad_files
    s.close()

    # a damaged kept index is another's: the file is scanned again (and its index written again)
    with open(os.path.join(root, "_mixplane_index", kept[0]), "wb") as f:
        f.write(b"not an npz")
    s = open_stream(_spec(root, index_beside_data=True), seed=1, buffer_rows=50)
    assert s.take(200).keys.tolist() == first and len(scans) == 1
    s.close()

    # a store the loader cannot write to only loses the cache (here: a file where the index directory would be)
    other = str(tmp_path / "ro")
    write_source(other, nfiles=1, rows=100, page_size=2048, row_group_size=100, dictionary=True)
    with open(os.path.join(other, "_mixplane_index"), "w") as f:
        f.write("in the way")
    s = open_stream(_spec(other, index_beside_data=True), seed=1, buffer_rows=50)
    assert len(s.take(50)) == 50
    s.close()


def test_a_failed_write_beside_leaves_no_temporary_file(tmp_path):
    root = str(tmp_path / "src")
    write_source(root, nfiles=1, rows=100, page_size=2048, row_group_size=100, dictionary=True)
    (path,) = [os.path.join(root, n) for n in os.listdir(root) if n.endswith(".parquet")]
    st = os.stat(path)
    cols = ["text", "row", "ids"]
    near = sidecar.beside_path(path, st.st_size, st.st_mtime_ns, cols)
    os.makedirs(near)  # a directory where the index goes: the write's final rename fails
    fi = indexscan.load_or_index_file(path, cols, size=st.st_size, mtime_ns=st.st_mtime_ns, cache_dir=None, beside=True)
    assert fi.num_rows == 100  # the loader has its index all the same
    assert os.listdir(os.path.dirname(near)) == [os.path.basename(near)]  # and left no temporary file beside the data


def test_a_store_that_takes_no_writes_only_loses_the_cache(tmp_path, monkeypatch):
    """An http(s):// source (fsspec's HTTP filesystem: reads only, writes raise NotImplementedError) with
    index_beside_data reads as without it."""
    import functools
    import http.server
    import threading

    root = str(tmp_path / "src")
    write_source(root, nfiles=1, rows=100, page_size=2048, row_group_size=100, dictionary=True)
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=root))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        (name,) = [n for n in os.listdir(root) if n.endswith(".parquet")]
        uri = f"http://127.0.0.1:{srv.server_address[1]}/{name}"
        got = {}
        for beside in (False, True):
            s = open_stream(_spec(uri, index_beside_data=beside), seed=1, buffer_rows=50)
            got[beside] = s.take(50).keys.tolist()
            s.close()
        assert got[True] == got[False] and len(got[True]) == 50
    finally:
        srv.shutdown()
        srv.server_close()


def test_stale_index_names():
    pre, cur, old = sidecar.index_prefix("/d/part.0.parquet"), sidecar.index_stamp(10, 1), sidecar.index_stamp(9, 1)
    other = sidecar.index_prefix("/e/part.0.parquet")
    names = [f"{pre}{cur}.aaaa.npz", f"{pre}{cur}.bbbb.npz",  # this version, two column sets: kept
             f"{pre}{old}.aaaa.npz",  # an older version: stale
             f"{other}{old}.aaaa.npz",  # another file (same base name, other directory): not ours to judge
             f"{pre}{old}.aaaa.npz.tmp", "junk.npz", "x.y.npz"]
    assert sidecar.stale_indexes(names, {pre: cur}) == [f"{pre}{old}.aaaa.npz"]


def test_a_rewritten_file_leaves_no_stale_index(tmp_path, monkeypatch):
    """Every rewrite of a file used to leave its former index behind, beside the data and in the local cache."""
    root, cache = str(tmp_path / "src"), str(tmp_path / "cache")
    paths, _ = write_source(root, nfiles=2, rows=200, page_size=2048, row_group_size=100, dictionary=True)
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", cache)
    beside_dir = os.path.join(root, "_mixplane_index")

    def open_take(columns=("text", "row", "ids")) -> list[int]:
        s = open_stream(SourceSpec(name="web", uri=root, columns=list(columns), kind="text", shuffle="page",
                                   index_beside_data=True), seed=1, buffer_rows=50)
        try:
            return s.take(100).keys.tolist()
        finally:
            s.close()

    open_take()
    open_take(("text", "row"))  # another projection of the same files: its own indexes, kept beside the first
    def indexes(d: str) -> list[str]:  # the page indexes (the cache also keeps the source's listing, in listings/)
        return sorted(n for n in os.listdir(d) if n != LISTINGS_DIR)

    first_beside, first_cache = indexes(beside_dir), indexes(cache)
    assert len(first_beside) == len(first_cache) == 4
    write_source(root, nfiles=1, rows=150, page_size=2048, row_group_size=100, dictionary=True, seed=9)  # rewrites part 0
    st = os.stat(paths[0])
    new_name = os.path.basename(sidecar.beside_path(paths[0], st.st_size, st.st_mtime_ns, ["text", "row", "ids"]))
    open_take()
    pre = sidecar.index_prefix(paths[0])
    for d, before in ((beside_dir, first_beside), (cache, first_cache)):
        now = indexes(d)
        # part 0: only the new version's index (the other projection's old one went too: that version is gone)
        assert [n for n in now if n.startswith(pre)] == [new_name], (d, now)
        assert [n for n in now if not n.startswith(pre)] == [n for n in before if not n.startswith(pre)], (d, now)

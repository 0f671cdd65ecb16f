"""A remote source read across more files than the reader keeps open (SourceReader's max_open_files, 64): a reader
evicted while a read-ahead thread reads from it must not be closed under that read. Before, a page-mode source of
300 files read through fsspec failed at its first take ('NoneType' object is not subscriptable: the evicted
reader's held tail emptied under the read)."""

from __future__ import annotations

import io
import os

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem  # type: ignore[import-untyped]

from mixplane.loader.files import list_source_files
from mixplane.loader.stream import open_stream
from mixplane.spec import SourceSpec


NFILES = 300


class ObjectStore(LocalFileSystem):
    """Local files read as object storage is: pyarrow over fsspec, ranged reads, the loader's read-ahead."""

    cachable = False


def _file(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    ids = pa.array([rng.integers(1, 30_000, 24).astype(np.int32) for _ in range(48)], pa.list_(pa.int32()))
    buf = io.BytesIO()
    pq.write_table(pa.table({"ids": ids}), buf, row_group_size=16, data_page_size=256, write_batch_size=8,
                   write_page_index=True)
    return buf.getvalue()


def test_a_source_of_more_files_than_open_readers_is_read_whole_through_fsspec(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")
    blobs = [_file(s) for s in range(4)]
    for i in range(NFILES):
        (tmp_path / f"part-{i:03d}.parquet").write_bytes(blobs[i % 4])
    src = SourceSpec(name="a", uri=str(tmp_path), kind="tokens", columns=["ids"], shuffle="page")
    got = {}
    fds0 = len(os.listdir("/proc/self/fd"))
    for kind in ("local", "object"):
        files = list_source_files(str(tmp_path))
        if kind == "object":
            files.filesystem = pafs.PyFileSystem(pafs.FSSpecHandler(ObjectStore()))
        s = open_stream(src, seed=1, cache_dir=None, files=files)
        try:
            assert s.reader.ahead is not None if kind == "object" else s.reader.ahead is None
            r = s.take(NFILES * 48)  # one epoch: every page of every file
            got[kind] = (r.keys.tolist(), [bytes(np.asarray(x, np.int32)) for x in r.columns["ids"].to_pylist()])
            if kind == "local":  # an evicted reader is dropped, not closed: its file closes with its last reference
                assert len(os.listdir("/proc/self/fd")) <= fds0 + 64 + 8
        finally:
            s.close()
    assert len(got["object"][0]) == NFILES * 48 and len(set(got["object"][0])) == NFILES * 48
    assert got["object"] == got["local"]

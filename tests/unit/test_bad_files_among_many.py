"""Bad input at scale: among 3,000 files of a source, one corrupt, one missing after the listing, one changed between
the listing and its indexing and one rewritten after the index was built are quarantined with their names, and the
stream goes on to deliver every row of every other file, once."""

from __future__ import annotations

import io
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mixplane.loader.files import list_source_files
from mixplane.loader.stream import open_stream
from mixplane.spec import SourceSpec

FILES, ROWS = 3000, 32


def _blob(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    ids = pa.array([rng.integers(1, 30_000, 16).astype(np.int32) for _ in range(ROWS)], pa.list_(pa.int32()))
    buf = io.BytesIO()
    pq.write_table(pa.table({"ids": ids}), buf, row_group_size=16, write_page_index=True)
    return buf.getvalue()


def test_bad_files_among_3000_are_quarantined_by_name_and_the_source_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")
    blobs = [_blob(s) for s in range(4)]
    paths = []
    for i in range(FILES):
        d = tmp_path / f"d{i // 1000}"
        d.mkdir(exist_ok=True)
        p = d / f"part-{i:05d}.parquet"
        p.write_bytes(blobs[i % 4])
        paths.append(str(p))
    corrupt, missing, changed, rewritten = paths[777], paths[1234], paths[2222], paths[2999]
    with open(corrupt, "r+b") as f:  # a footer length past the file's start
        f.seek(-8, os.SEEK_END)
        f.write(b"\xff\xff\xff\x7fPAR1")
    files = list_source_files(str(tmp_path))
    assert len(files.paths) == FILES
    os.remove(missing)  # gone between the listing and the read
    with open(changed, "r+b") as f:  # rewritten shorter between the listing and the read
        f.truncate(os.path.getsize(changed) // 2)
    src = SourceSpec(name="big", uri=str(tmp_path), kind="tokens", columns=["ids"], shuffle="sequential")
    s = open_stream(src, seed=0, cache_dir=None, files=files)
    try:
        indexed = {f.path for f in s.index.files}
        assert {corrupt, missing, changed} & indexed == set() and len(indexed) == FILES - 3
        with open(rewritten, "wb") as f:  # the last file rewritten (another size) after its index was built
            f.write(blobs[1] + b"\0" * 100)
        got = s.take((FILES - 4) * ROWS)  # epoch 0: every row of the 2,996 good files, in file order
        assert len(got) == (FILES - 4) * ROWS
        where = [s.where_key(int(k)) for k in got.keys]
        assert len(set(where)) == len(where)
        assert {w[0] for w in where} == set(paths) - {corrupt, missing, changed, rewritten}
        assert {e.file for e in s.quarantine.entries} == {corrupt, missing, changed}  # at indexing
        nxt = s.take(ROWS)  # past the rewritten file (its pages quarantined as they are read) into the next epoch
        assert len(nxt) == ROWS and s.where_key(int(nxt.keys[0])) == (paths[0], 0) and nxt.keys[0] != got.keys[0]
        named = {e.file for e in s.quarantine.entries}
        assert named == {corrupt, missing, changed, rewritten}, named
        messages = " ".join(s.quarantine.messages())
        assert all(p in messages for p in named) and "changed since it was indexed" in messages
        assert s.quarantine.counts()["files"] == 3  # three whole files at indexing; the fourth's pages at reading
    finally:
        s.close()

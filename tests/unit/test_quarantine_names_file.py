"""A quarantined sample's record and log line name its file and row (issue 10, hygiene)."""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mixplane.loader.stream import open_stream
from mixplane.loader.transforms import make_transform
from mixplane.loader.window import LoaderWindow
from mixplane.spec import SourceSpec


def test_a_bad_sample_is_reported_with_its_file_and_row(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")
    good = np.arange(6, dtype="<i4").tobytes()
    for name, rows in (("a.parquet", [good] * 5), ("b.parquet", [good, good, b"\x01\x02\x03", good])):
        pq.write_table(pa.table({"ids": pa.array(rows, pa.binary())}), tmp_path / name)
    src = SourceSpec(name="s", uri=str(tmp_path), kind="tokens", columns=["ids"], shuffle="sequential")
    transform = make_transform(src)
    w = LoaderWindow(open_stream(src, seed=0, cache_dir=None), transform, (8, 1, 8))
    with caplog.at_level(logging.WARNING):
        a = w.fill()
    assert len(a) == 8 and 7 not in a.key.tolist()  # row 7 of the source: b.parquet row 2
    entries = list(transform.quarantine.entries)
    assert len(entries) == 1 and entries[0].file.endswith("b.parquet")
    assert "b.parquet, row 2)" in entries[0].message
    assert any("b.parquet, row 2" in r.getMessage() for r in caplog.records)

"""A live source's rescan looks each listed path up in a set of the indexed ones: the work of finding what is new
grows with the listing, not with the listing times the files indexed (it rebuilt a set of every indexed path for
each new file: ~10^10 steps for 10^5 files joining 10^5)."""

import os
import shutil

import pyarrow.parquet as pq
import pytest

from mixplane.loader.stream import open_stream
from mixplane.spec import SourceSpec
from tests.unit.loader_testdata import text_table


@pytest.fixture(autouse=True)
def _index_cache(monkeypatch):
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")


class _Walked(list):
    """The index's file list, counting the walks over all of it."""

    walks = 0

    def __iter__(self):
        _Walked.walks += 1
        return super().__iter__()


def test_a_rescan_walks_the_indexed_files_a_bounded_number_of_times(tmp_path):
    d = tmp_path / "live"
    d.mkdir()
    first = str(tmp_path / "t.parquet")
    pq.write_table(text_table(20, 0, 0), first)
    for k in range(50):
        shutil.copy(first, d / f"a-{k:03d}.parquet")
    src = SourceSpec(name="live", uri=os.path.join(str(d), "*.parquet"), columns=["text", "row"], kind="text",
                     live=True)
    s = open_stream(src, seed=0, poll_s=0.05, status_every_s=1e9)
    assert len(s.index.files) == 50
    for rescan, joining in enumerate((300, 0, 100)):
        for k in range(joining):
            shutil.copy(first, d / f"b{rescan}-{k:03d}.parquet")
        before = len(s.index.files)
        s.index.files = _Walked(s.index.files)
        _Walked.walks = 0
        s._rescan(force=True)
        assert len(s.index.files) == before + joining  # each new file indexed once
        assert _Walked.walks <= 2, (joining, _Walked.walks)  # not once per new file
    # a file rewritten in place keeps its index (as before): not indexed a second time
    shutil.copy(str(tmp_path / "t.parquet"), d / "a-000.parquet")
    os.utime(d / "a-000.parquet", ns=(1, 1))
    s._rescan(force=True)
    assert len(s.index.files) == 450 and len({f.path for f in s.index.files}) == 450

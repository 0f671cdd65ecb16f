"""`mixplane profile` on a source of many files: the footers and pages of a bounded, deterministic sample are read,
not every file's; max_partitions is extrapolated from the sample to the listing; a small source is profiled exactly."""

from __future__ import annotations

import io
import os
import threading
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.local import LocalFileSystem  # type: ignore[import-untyped]

from mixplane.loader.blocks import block_order
from mixplane.loader.files import SourceFiles, list_source_files
from mixplane.loader.stream import open_stream
from mixplane.profile import SAMPLE_FILES, profile_source, sample_indices
from mixplane.spec import parse_spec


class TouchedFiles(LocalFileSystem):
    """The local filesystem, read as object storage is (ranged reads through fsspec), recording every path read."""

    cachable = False  # fsspec would hand every test the same instance

    def __init__(self) -> None:
        super().__init__()
        self.touched: set[str] = set()
        self._lock = threading.Lock()

    def _note(self, path: str) -> None:
        with self._lock:
            self.touched.add(os.path.abspath(self._strip_protocol(path)))

    def _open(self, path, *args, **kwargs):
        self._note(path)
        return super()._open(path, *args, **kwargs)

    def cat_file(self, path, *args, **kwargs):
        self._note(path)
        return super().cat_file(path, *args, **kwargs)


def _template(rows: int, row_group: int) -> bytes:
    rng = np.random.default_rng(rows)
    ids = pa.array([rng.integers(1, 30_000, 40).astype(np.int32) for _ in range(rows)], pa.list_(pa.int32()))
    buf = io.BytesIO()
    pq.write_table(pa.table({"ids": ids}), buf, row_group_size=row_group, data_page_size=512, write_batch_size=8,
                   write_page_index=True)
    return buf.getvalue()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """600 files of two shapes (bytes copied, not encoded: fast): every third holds 6 row groups, the others 2."""
    root = tmp_path_factory.mktemp("many")
    big, small = _template(96, 16), _template(32, 16)
    for i in range(600):
        d = root / f"d{i // 200}"
        d.mkdir(exist_ok=True)
        (d / f"part-{i:05d}.parquet").write_bytes(big if i % 3 == 0 else small)
    return str(root)


def _spec(uri: str, shuffle: str):
    return parse_spec({"name": "m", "sources": [{"name": "a", "uri": uri, "kind": "tokens", "columns": ["ids"],
                                                 "shuffle": shuffle}],
                       "mixture": {"weights": {"a": 1.0}}, "batch": {"sequences": 4, "seq_len": 128},
                       "topology": {"modules": {"m": {"dp": 1}}}, "runtime": {"metrics": False}})


def _counted(uri: str) -> tuple[SourceFiles, TouchedFiles]:
    listed = list_source_files(uri)
    fs = TouchedFiles()
    listed.filesystem = pafs.PyFileSystem(pafs.FSSpecHandler(fs))
    return listed, fs


def _truth(spec, shuffle: str) -> int:
    s = open_stream(spec.sources[0], seed=0, cache_dir=None)
    try:
        return {"row": int(s.index.num_rows), "rowgroup": len(s.index.chunk_rows), "page": int(s.index.num_units)}[shuffle]
    finally:
        s.close()


def test_the_sample_is_bounded_deterministic_and_spans_the_listing():
    assert sample_indices(10) == list(range(10))
    pick = sample_indices(100_000)
    assert len(pick) == SAMPLE_FILES and pick == sample_indices(100_000)
    assert pick[: SAMPLE_FILES // 2] == list(range(SAMPLE_FILES // 2)) and pick[-1] == 99_999
    gaps = np.diff(pick[SAMPLE_FILES // 2:])
    assert gaps.min() >= 3000 and gaps.max() - gaps.min() <= 1  # evenly spaced over the rest
    for n in (65, 97, 1000, 10**7):  # exactly SAMPLE_FILES distinct files once there are more
        assert len(sample_indices(n)) == SAMPLE_FILES and sample_indices(n)[-1] == n - 1
    with pytest.raises(ValueError, match="sample_files"):
        sample_indices(5, 0)


@pytest.mark.parametrize("shuffle", ["rowgroup", "page", "row"])
def test_a_source_of_many_files_is_profiled_on_a_sample(corpus, monkeypatch, shuffle):
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")
    spec = _spec(corpus, shuffle)
    listed, fs = _counted(corpus)
    prof = profile_source(spec, 0, max_rows=256, max_cpu_s=1.0, files=listed)
    assert prof["files_listed"] == 600 and prof["files_sampled"] == SAMPLE_FILES and prof["sampled"] is True
    # only the sampled files were opened or read: footers, indexes and pages
    assert 0 < len(fs.touched) <= SAMPLE_FILES
    assert fs.touched <= {listed.paths[i] for i in sample_indices(600)}
    assert prof["rows"] > 0 and prof["tokens"] == 40 * prof["rows"] and prof["cpu_s_per_token"] > 0
    # every loader indexes all 600 files: the memory per partition holds the index of the 536 not read
    assert 500 < prof["index_bytes_per_file"] < 64 << 10
    assert prof["memory_per_partition"] > prof["index_bytes_per_file"] * 536 * 0.9
    # the estimate: within 15% under the truth of the whole source, never over it
    truth = _truth(spec, shuffle)
    assert 0.85 * truth <= prof["max_partitions"] <= truth, (prof["max_partitions"], truth)


def test_a_small_source_is_profiled_exactly_on_every_file(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")
    few = tmp_path / "few"
    few.mkdir()
    for p in sorted(os.listdir(os.path.join(corpus, "d0")))[:40]:
        (few / p).write_bytes(open(os.path.join(corpus, "d0", p), "rb").read())
    spec = _spec(str(few), "rowgroup")
    listed, fs = _counted(str(few))
    prof = profile_source(spec, 0, max_rows=64, files=listed)
    assert prof["files_listed"] == prof["files_sampled"] == 40 and prof["sampled"] is False
    assert len(fs.touched) == 40 and "index_bytes_per_file" not in prof
    assert prof["max_partitions"] == _truth(spec, "rowgroup") == 14 * 6 + 26 * 2
    # without the bound every file of the large source is read (what sampling saves)
    listed, fs_all = _counted(corpus)
    profile_source(_spec(corpus, "rowgroup"), 0, max_rows=64, files=listed, sample_files=10**6)
    assert len(fs_all.touched) == 600


def test_cli_sample_files_bounds_the_files_read(corpus, tmp_path, monkeypatch, capsys):
    import json

    import yaml

    from mixplane.cli import main

    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")
    doc = {"name": "m", "sources": [{"name": "a", "uri": corpus, "kind": "tokens", "columns": ["ids"]}],
           "mixture": {"weights": {"a": 1.0}}, "batch": {"sequences": 4, "seq_len": 128},
           "topology": {"modules": {"m": {"dp": 1}}}, "runtime": {"metrics": False}}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(doc))
    assert main(["profile", str(tmp_path / "m.yaml"), "--max-rows", "32", "--sample-files", "8"]) == 0
    got = json.loads(capsys.readouterr().out)["sources"]["a"]
    assert (got["files_listed"], got["files_sampled"], got["sampled"]) == (600, 8, True)


def test_a_live_source_of_many_files_is_profiled_on_its_sample_without_a_rescan(corpus, monkeypatch):
    """A stream given its files lists the storage again at its first take; a sampled profile's must not (it would
    index every file after all)."""
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")
    doc = _spec(corpus, "page").model_dump(mode="json")
    doc["sources"][0]["live"] = True
    spec = parse_spec(doc)
    listed, fs = _counted(corpus)
    # more rows than the sample holds (~3,400): the stream runs dry, where a live stream lists its storage again
    prof = profile_source(spec, 0, max_rows=8000, max_cpu_s=5.0, files=listed)
    assert prof["sampled"] is True and prof["max_partitions"] == 1 and 0 < prof["rows"] < 8000
    assert 0 < len(fs.touched) <= SAMPLE_FILES


def test_the_index_heap_is_measured_on_the_profiles_own_open_with_one_thread_passed_not_set(corpus, monkeypatch):
    """index_bytes_per_file reuses the profile's traced open of the sample and opens only half of it more (plus one
    file to pay a first open's costs): each index build gets one thread as a parameter, MIXPLANE_INDEX_THREADS is
    neither read for it nor touched."""
    from mixplane.loader import indexscan

    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")
    monkeypatch.setenv("MIXPLANE_INDEX_THREADS", "7")
    builds = []
    real = indexscan.index_workers

    def recorded(filesystem, files, threads=None):
        builds.append((files, threads, os.environ.get("MIXPLANE_INDEX_THREADS")))
        return real(filesystem, files, threads)

    monkeypatch.setattr(indexscan, "index_workers", recorded)
    listed, _ = _counted(corpus)
    prof = profile_source(_spec(corpus, "rowgroup"), 0, max_rows=64, files=listed)
    assert 500 < prof["index_bytes_per_file"] < 64 << 10
    assert builds == [(1, 1, "7"), (SAMPLE_FILES, 1, "7"), (SAMPLE_FILES // 2, 1, "7")]
    assert real(None, 100, 3) == 3 and real(None, 100) == 7  # the parameter first, then the variable
    with pytest.raises(ValueError, match="index threads must be >= 1"):
        real(None, 100, 0)


def _block_spec(uri: str, lazy_index_files: int, block_files: int = 64):
    doc = _spec(uri, "page").model_dump(mode="json")
    doc["sources"][0].update(lazy_index_files=lazy_index_files, block_files=block_files)
    return parse_spec(doc)


def test_a_source_read_block_by_block_is_capped_at_its_blocks_and_holds_two_blocks_index(corpus, monkeypatch):
    """600 files, lazy_index_files 100, blocks of 64: 10 blocks. The loaders split the source into at most 10
    partitions and hold the index of 2 blocks (128 files) and the listing, not of 600 files; below the threshold the
    same source is profiled in page order as before."""
    from mixplane import profile as profile_mod
    from mixplane.profile import held_index_bytes, listing_bytes, sample_files_of

    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")
    # the RSS growth of a second open in one process is noise (freed memory is reused): held at 0 here, so the
    # figures compared are the estimate's own terms
    monkeypatch.setattr(profile_mod, "_rss", lambda: 1 << 30)
    listed, fs = _counted(corpus)
    blocks = profile_source(_block_spec(corpus, 100), 0, max_rows=256, files=listed)
    assert (blocks["order"], blocks["blocks"], blocks["block_files"], blocks["files_indexed"]) == ("blocks", 10, 64, 128)
    assert blocks["max_partitions"] == 10 and blocks["sampled"] is True and blocks["files_sampled"] == SAMPLE_FILES
    assert 0 < len(fs.touched) <= SAMPLE_FILES  # measured on the sample, in page order, as a page-order source is
    listed, _ = _counted(corpus)
    pages = profile_source(_block_spec(corpus, 1000), 0, max_rows=256, files=listed)
    assert pages["order"] == "pages" and "blocks" not in pages and pages["max_partitions"] > 1000
    assert 0.85 * _truth(_block_spec(corpus, 0), "page") <= pages["max_partitions"]
    # pages: the index of all 600 files (the 536 not read added); blocks: 128 files' worth, the sample's replaced
    per = blocks["index_bytes_per_file"]
    sample = sample_files_of(listed)
    held = held_index_bytes(block_order(_block_spec(corpus, 100).sources[0], 600), per, listed, sample)
    assert held > per * 128 * 0.5
    assert blocks["open_rss_bytes"] == pytest.approx(max(0, held - per * SAMPLE_FILES) + listing_bytes(listed), rel=0.02)
    assert pages["open_rss_bytes"] > pages["index_bytes_per_file"] * 536 * 0.9
    assert blocks["memory_per_partition"] < pages["memory_per_partition"] - 0.5 * per * (600 - 128)


def test_a_few_files_read_block_by_block_are_measured_whole_and_capped_at_their_blocks(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")
    few = tmp_path / "few"
    few.mkdir()
    for p in sorted(os.listdir(os.path.join(corpus, "d0")))[:40]:
        (few / p).write_bytes(open(os.path.join(corpus, "d0", p), "rb").read())
    listed, fs = _counted(str(few))
    prof = profile_source(_block_spec(str(few), 10, 16), 0, max_rows=64, files=listed)
    assert (prof["order"], prof["blocks"], prof["max_partitions"], prof["sampled"]) == ("blocks", 3, 3, False)
    assert prof["files_indexed"] == 32 and len(fs.touched) == 40


def test_the_block_cap_reaches_the_auto_partitioner_and_the_scaler(corpus, monkeypatch):
    """A mixture whose demand wants 12 partitions of a 10-block source: with the page-based cap the plan had 12
    (loaders then fail at start: "cannot be split into 12 partitions"); now the plan is refused naming the bound, a
    demand of exactly 10 partitions gets 10, and the run-time scaler stops at 10."""
    from mixplane.operator.autopartition import LoaderBudget, PartitionBounds, PartitionError, auto_partition
    from mixplane.operator.scaling import partitions_for
    from mixplane.profile import costs_from_profile

    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")
    listed, _ = _counted(corpus)
    prof = profile_source(_block_spec(corpus, 100), 0, max_rows=256, files=listed)
    (cost,) = costs_from_profile({"version": 1, "sources": {"a": prof}})
    bounds, budget = PartitionBounds(), LoaderBudget(cpu=1000.0, memory=1 << 50)

    def tps(n: int) -> float:  # trainer tokens a second that need exactly n one-worker partitions
        return (n - 0.5) * bounds.capacity(1) / bounds.headroom / cost.cpu_s_per_token

    assert cost.max_partitions == 10
    assert auto_partition([cost], [(0, {"a": 1.0})], tps(10), budget, bounds).partitions == {"a": 10}
    with pytest.raises(PartitionError, match="data-parallel bound 10"):
        auto_partition([cost], [(0, {"a": 1.0})], tps(12), budget, bounds)
    # the cap the page-based figure gave the same source (what the profile said before it knew the block order)
    listed, _ = _counted(corpus)
    paged = profile_source(_block_spec(corpus, 1000), 0, max_rows=256, files=listed)["max_partitions"]
    assert auto_partition([replace(cost, max_partitions=paged)], [(0, {"a": 1.0})], tps(12), budget,
                          bounds).partitions == {"a": 12}
    assert partitions_for(1000.0, cost, bounds) == 10


def test_the_recent_blocks_the_profile_counts_are_those_a_block_stream_keeps(corpus, monkeypatch):
    """loader.blocks.RECENT_BLOCKS, which the profile counts, is how many blocks' row starts BlockStream keeps (to name
    a key's file): read through 6 blocks of one file each, the stream keeps exactly that many."""
    from mixplane.loader.blocks import RECENT_BLOCKS

    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")
    s = open_stream(_block_spec(corpus, 100, 1).sources[0], seed=0, cache_dir=None)
    try:
        seen = set()
        while len(seen) < RECENT_BLOCKS + 2:
            s.take(16)
            seen.add(s.block_of(s._place))  # (place: prefix piece or -1, epoch, block in the order)
        assert len(s._recent) == RECENT_BLOCKS
    finally:
        s.close()

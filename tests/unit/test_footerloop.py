"""The compiled footer / OffsetIndex path of indexing (`loader/footerloop.py`, `indexscan._index_compiled`) gives
exactly what the Python path (its specification: `index_file(..., compiled=False)`) gives -- the same FileIndex,
arrays and dtypes included, or the same error naming the file -- on the writer zoo, on files written as the
start-up benchmark writes them, and on those files truncated and with bytes flipped in their footers and
OffsetIndexes; and it does answer (not leave every file to the Python path) where the files are the common case."""

import os
import random
import struct

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from mixplane.loader import indexscan
from mixplane.loader.indexscan import _index_compiled, build_source_index, index_file
from mixplane.loader.parquet import ParquetError, RangeReader, read_file_meta
from tests.unit.writer_zoo import write_zoo


def _bench_like(directory: str) -> list[tuple[str, list[str]]]:
    """Files as bench/startup.py writes them (4 row groups, small pages, page indexes, a dictionary column), and a
    few variations: other codecs, list<int64>, dictionary pages for every column, an all-null column."""
    out = []
    rng = np.random.default_rng(3)
    for k, (codec, dictionary, ids_type) in enumerate([
            ("zstd", ["lang"], pa.int32()), ("snappy", True, pa.int32()), ("none", False, pa.int64()),
            ("gzip", ["lang"], pa.int64()), ("lz4", True, pa.int32())]):
        n = 128 + 17 * k
        lens = rng.integers(4, 40, n)
        ids = pa.ListArray.from_arrays(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
                                       pa.array(rng.integers(3, 1000, int(lens.sum())), ids_type))
        t = pa.table({"ids": ids, "lang": pa.array(rng.choice(["en", "de", "fr"], n)),
                      "id": pa.array(np.arange(n), pa.int64()), "none": pa.nulls(n, pa.string())})
        p = os.path.join(directory, f"bench-{k}.parquet")
        pq.write_table(t, p, row_group_size=32 + k, write_batch_size=8, data_page_size=1024, write_page_index=True,
                       use_dictionary=dictionary, compression=codec)
        out.append((p, ["ids"]))
        out.append((p, ["ids", "lang", "id"]))
        out.append((p, ["lang", "none"]))
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("footerloop"))
    out = _bench_like(d)
    for _, path, cols, _ in write_zoo(os.path.join(d, "zoo"), rows=600):
        out.append((path, cols))
        out.append((path, cols[:1]))
    return out


def _outcome(path, cols, compiled):
    try:
        return index_file(path, cols, compiled=compiled)
    except Exception as e:  # (only ParquetErrors are expected: test_damaged_files... asserts it)
        return (type(e), str(e))


def _assert_same(got, want):
    if isinstance(want, tuple):
        assert got == want
        return
    assert not isinstance(got, tuple), got
    for f in ("path", "size", "mtime_ns", "num_rows", "columns"):
        assert getattr(got, f) == getattr(want, f), f
    assert [(type(e), str(e)) for e in got.bad_chunks] == [(type(e), str(e)) for e in want.bad_chunks]
    assert type(got.num_rows) is int
    assert got.rg_rows.dtype == want.rg_rows.dtype and np.array_equal(got.rg_rows, want.rg_rows)
    assert list(got.pages) == list(want.pages)
    for c in want.pages:
        for f in want.pages[c].FIELDS:
            a, b = getattr(got.pages[c], f), getattr(want.pages[c], f)
            assert a.dtype == b.dtype and np.array_equal(a, b), (c, f)


def _answers(path, cols) -> bool:
    """Whether the compiled path indexes this file itself (its schema resolved before)."""
    r = RangeReader(path)
    try:
        r.hold(0, r.size)
        return _index_compiled(r, cols, None, 0)[0] is not None
    except ParquetError:
        return False
    finally:
        r.close()


def test_the_same_index_as_the_python_path(files):
    indexscan._RESOLVED.clear()
    answered = 0
    for path, cols in files:
        want = _outcome(path, cols, False)
        _assert_same(_outcome(path, cols, True), want)  # (resolves the schema with the Python path)
        _assert_same(_outcome(path, cols, True), want)  # the compiled path where it applies
        answered += _answers(path, cols)
    # every bench-like file, and the zoo's files with page indexes, go the compiled way
    assert answered >= 15 + 2
    assert answered < len(files)  # files without OffsetIndexes go the Python way


def _damaged(data: bytes, rnd: random.Random, spans: list[tuple[int, int]]):
    """Copies of a file truncated, and with 1-4 bytes flipped within the given spans (footer, OffsetIndexes)."""
    n = len(data)
    for cut in (n - 1, n - 9, n - 200, n // 2):
        if 0 < cut < n:
            yield data[:cut]
    for _ in range(int(os.environ.get("FOOTERLOOP_FLIPS", "60"))):
        b = bytearray(data)
        lo, hi = spans[rnd.randrange(len(spans))]
        for _ in range(rnd.randint(1, 4)):
            b[rnd.randrange(lo, hi)] = rnd.randrange(256)
        yield bytes(b)


def test_damaged_files_give_what_the_python_path_gives(files, tmp_path):
    rnd = random.Random(11)
    fast = slow = failed = 0
    for path, cols in files[::2]:
        data = open(path, "rb").read()
        flen = struct.unpack("<I", data[-8:-4])[0]
        spans = [(len(data) - 8 - flen, len(data) - 8)]
        r = RangeReader(path)
        meta = read_file_meta(r)
        r.close()
        ois = [(c.offset_index_offset, c.offset_index_offset + c.offset_index_length)
               for g in meta.row_groups for c in g.columns if c.offset_index_offset and c.offset_index_length]
        if ois:  # the OffsetIndexes lie between the data and the footer: flip bytes there too
            spans.append((min(a for a, _ in ois), max(b for _, b in ois)))
        indexscan._RESOLVED.clear()
        index_file(path, cols, compiled=True)  # the schema, resolved
        for k, bad in enumerate(_damaged(data, rnd, spans)):
            p = str(tmp_path / f"bad-{k}.parquet")
            with open(p, "wb") as f:
                f.write(bad)
            want = _outcome(p, cols, False)
            got = _outcome(p, cols, True)
            if isinstance(want, tuple):
                assert issubclass(want[0], ParquetError) and p in want[1], want  # an error naming the file
                failed += 1
            _assert_same(got, want)
            if _answers(p, cols):
                fast += 1
            else:
                slow += 1
            os.unlink(p)
    assert failed > 20  # the damage is seen: the same errors
    assert fast > 20 and slow > 20  # both ways are exercised by the damage (a flipped statistic is no matter)


def test_a_corrupt_offset_index_is_named_not_delivered(tmp_path):
    """An OffsetIndex whose page offsets go backwards: the compiled path leaves the file to the Python one,
    which refuses it naming the file, row group and column."""
    p = str(tmp_path / "f.parquet")
    t = pa.table({"ids": pa.array([[i] * 40 for i in range(64)], pa.list_(pa.int32()))})
    pq.write_table(t, p, row_group_size=32, write_batch_size=8, data_page_size=256, write_page_index=True,
                   compression="none")
    indexscan._RESOLVED.clear()
    good = index_file(p, ["ids"], compiled=True)
    assert index_file(p, ["ids"], compiled=True).pages["ids"].unit_off.tolist() == good.pages["ids"].unit_off.tolist()
    data = bytearray(open(p, "rb").read())
    r = RangeReader(p)
    cc = read_file_meta(r).row_groups[1].columns[0]
    r.close()
    lo = cc.offset_index_offset
    # the second PageLocation's offset (field 1, a zigzag varint): made equal to the first's
    oi = bytes(data[lo: lo + cc.offset_index_length])
    first = good.pages["ids"].unit_off[good.pages["ids"].chunk_first_unit[1]]
    second = good.pages["ids"].unit_off[good.pages["ids"].chunk_first_unit[1] + 1]

    def zz(v):
        v = (v << 1) ^ (v >> 63)
        out = bytearray()
        while True:
            b = v & 0x7F
            v >>= 7
            out.append(b | (0x80 if v else 0))
            if not v:
                return bytes(out)
    i = oi.index(zz(int(second)))
    assert len(zz(int(first))) == len(zz(int(second)))
    data[lo + i: lo + i + len(zz(int(first)))] = zz(int(first))
    with open(p, "wb") as f:
        f.write(data)
    with pytest.raises(ParquetError) as e:
        index_file(p, ["ids"], compiled=True)
    assert p in str(e.value) and "OffsetIndex does not match" in str(e.value) and "row group 1" in str(e.value)
    assert not _answers(p, ["ids"])


def test_a_source_indexes_the_same_either_way(tmp_path, monkeypatch):
    """build_source_index over a source with a corrupt file, a file without OffsetIndexes and one of another
    schema among bench-like files: the same source index and the same bad files, compiled or not."""
    d = tmp_path / "src"
    d.mkdir()
    made = _bench_like(str(tmp_path))
    data = [open(p, "rb").read() for p, _ in made[::3]]
    for i in range(40):
        (d / f"f{i:03d}.parquet").write_bytes(data[i % 3])  # (three schemas: ids int32 / int32 / int64)
    (d / "f040.parquet").write_bytes(data[0][:-30] + data[0][-8:])  # truncated footer
    pq.write_table(pa.table({"ids": pa.array([[1, 2]] * 50, pa.list_(pa.int32()))}), str(d / "f041.parquet"))
    paths = sorted(str(p) for p in d.iterdir())

    def build(compiled):
        indexscan._RESOLVED.clear()
        monkeypatch.setattr(indexscan, "COMPILED_MIN_FILES", 0 if compiled else 10**9)
        return build_source_index(paths, ["ids"], cache_dir=None)

    a, b = build(True), build(False)
    assert {k: str(e) for k, e in a.bad_files.items()} == {k: str(e) for k, e in b.bad_files.items()}
    assert list(a.bad_files) == [paths[40]]
    assert [f.path for f in a.files] == [f.path for f in b.files] and a.num_rows == b.num_rows
    for c in b.cols:
        for k in b.cols[c]:
            assert a.cols[c][k].dtype == b.cols[c][k].dtype and np.array_equal(a.cols[c][k], b.cols[c][k]), (c, k)


def test_offset_indexes_before_the_tail_and_through_object_storage_reads(tmp_path):
    """A file whose OffsetIndexes do not fit in the tail read at first (the compiled path asks for their span and
    reads it in one go), read from a local path and through a pyarrow filesystem (the object-storage reader:
    ranged reads, its own tail): the same index as the Python path, by the compiled path."""
    p = str(tmp_path / "many-pages.parquet")
    n = 120_000
    pq.write_table(pa.table({"id": pa.array(np.arange(n), pa.int64()),
                             "ids": pa.array([[i % 7] * 3 for i in range(n)], pa.list_(pa.int32()))}), p,
                   row_group_size=40_000, write_batch_size=16, data_page_size=64, write_page_index=True,
                   compression="none")
    r = RangeReader(p)
    meta = read_file_meta(r)
    r.close()
    oi_lo = min(c.offset_index_offset for g in meta.row_groups for c in g.columns)
    assert os.path.getsize(p) - oi_lo > indexscan.LOCAL_TAIL_BYTES + 10_000  # (they lie before the tail)
    fs = pafs.SubTreeFileSystem("/", pafs.LocalFileSystem())
    for cols in (["id"], ["ids", "id"]):
        for filesystem, path in ((None, p), (fs, p.lstrip("/"))):
            indexscan._RESOLVED.clear()
            want = index_file(path, cols, filesystem=filesystem)
            assert want.pages[cols[0]].unit_off.size > 1000
            index_file(path, cols, filesystem=filesystem, compiled=True)  # (the schema, resolved)
            r = RangeReader(path, filesystem)
            try:
                got, _ = _index_compiled(r, cols, None, 0)
            finally:
                r.close()
            assert got is not None
            _assert_same(got, want)

"""Bad input: every case is named in the error, quarantined and counted; the rest is still served."""

import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.unit.loader_testdata import text_table, write_source
from mixplane.loader import indexscan as scan
from mixplane.loader import pageindex as pi
from mixplane.loader.parquet import parse_page_header
from mixplane.loader.stream import StreamError, open_stream
from mixplane.samples import key_epoch, key_row
from mixplane.spec import SourceSpec


@pytest.fixture(autouse=True)
def _index_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")


def spec(d, mode="page"):
    return SourceSpec(name="bad", uri=d, columns=["text", "row"], kind="text", shuffle=mode)


def good_source(tmp_path, **kw):
    d = str(tmp_path / "src")
    paths, table = write_source(d, nfiles=3, rows=400, **kw)
    return d, paths, table


def epoch_rows(s, n_expected_max):
    r = s.take(n_expected_max)
    return r, r.columns["row"].to_numpy()[key_epoch(r.keys) == 0]


def check_serves_rest(d, table, lost_rows, mode="page", whole_files=False):
    """One epoch delivers exactly the rows outside the quarantined unit, each once, with true data."""
    s = open_stream(spec(d, mode), seed=1, buffer_rows=100)
    n_ok = len(table) - len(lost_rows)
    r = s.take(n_ok)
    got = r.columns["row"].to_numpy()
    assert (key_epoch(r.keys) == 0).all()
    assert sorted(got.tolist()) == sorted(set(range(len(table))) - set(lost_rows))
    if whole_files:  # a skipped file holds no rows: the source's row numbers continue over it
        survivors = np.array(sorted(set(range(len(table))) - set(lost_rows)))
        assert (survivors[key_row(r.keys)] == got).all()
    else:  # a skipped page keeps the numbering
        assert (key_row(r.keys) == got).all()
    exp = table.column("text").take(pa.array(got)).combine_chunks()
    assert r.columns["text"].equals(exp)  # never garbage
    nxt = s.take(1)
    assert key_epoch(nxt.keys)[0] == 1  # the epoch held nothing else
    return s, r


def _file_rows(paths, k):
    n0 = sum(pq.ParquetFile(p).metadata.num_rows for p in paths[:k])
    return list(range(n0, n0 + pq.ParquetFile(paths[k]).metadata.num_rows))


@pytest.mark.parametrize("case", ["truncated", "bad_magic", "empty", "zero_rows", "garbage_footer"])
def test_bad_file_is_quarantined_and_named(tmp_path, case):
    d, paths, table = good_source(tmp_path)
    bad = paths[1]
    lost = _file_rows(paths, 1)
    if case == "truncated":
        with open(bad, "r+b") as f:
            f.truncate(os.path.getsize(bad) // 2)
    elif case == "bad_magic":
        with open(bad, "r+b") as f:
            f.seek(-4, 2)
            f.write(b"XXXX")
    elif case == "empty":
        open(bad, "wb").close()
    elif case == "zero_rows":
        pq.write_table(text_table(0), bad)
    elif case == "garbage_footer":
        size = os.path.getsize(bad)
        flen = int.from_bytes(open(bad, "rb").read()[-8:-4], "little")
        with open(bad, "r+b") as f:
            f.seek(size - 8 - flen)
            f.write(b"\xff" * min(flen, 40))
    s, _ = check_serves_rest(d, table, lost, whole_files=True)
    q = s.quarantine.counts()
    assert q["files"] == 1 and q["pages"] == 1
    msg = s.quarantine.messages()[0]
    assert bad in msg
    assert q["by_kind"]


def test_missing_column_and_type_mismatch_quarantine_the_file(tmp_path):
    d, paths, table = good_source(tmp_path)
    t1 = pq.read_table(paths[1])
    pq.write_table(t1.drop_columns(["text"]), paths[1])
    t2 = pq.read_table(paths[2])
    pq.write_table(t2.set_column(t2.column_names.index("row"), "row", t2.column("row").cast(pa.string())), paths[2])
    s, _ = check_serves_rest(d, table, _file_rows(paths, 1) + _file_rows(paths, 2), whole_files=True)
    q = s.quarantine.counts()
    assert q["by_kind"] == {"missing_column": 1, "type_mismatch": 1}
    msgs = " | ".join(s.quarantine.messages())
    assert paths[1] in msgs and "no column 'text'" in msgs
    assert paths[2] in msgs and "differ" in msgs


def test_source_with_nothing_readable_fails_at_open_naming_the_problem(tmp_path):
    d, paths, _ = good_source(tmp_path)
    for p in paths:
        open(p, "wb").close()
    with pytest.raises(StreamError, match="no readable rows"):
        open_stream(spec(d), seed=0)
    with pytest.raises(StreamError, match="no Parquet files"):
        open_stream(spec(str(tmp_path / "nothing-here")), seed=0)


def _page_of(paths, file_k, unit_k):
    idx = scan.build_source_index(paths, ["text", "row"], cache_dir=None)
    u = int(idx.primary["file_first_unit"][file_k]) + unit_k
    r0 = int(idx.unit_row_start[u])
    return idx, u, int(idx.primary["unit_off"][u]), int(idx.primary["unit_len"][u]), list(range(r0, r0 + int(idx.unit_rows[u])))


@pytest.mark.parametrize("case", ["header", "crc", "bytes_no_crc"])
def test_corrupt_page_is_quarantined_with_file_row_group_and_page(tmp_path, case):
    d, paths, table = good_source(tmp_path, checksum=(case != "bytes_no_crc"), compression="snappy")
    idx, u, off, ln, lost = _page_of(paths, 1, 3)
    with open(paths[1], "r+b") as f:
        f.seek(off)
        head = f.read(ln)
        h = parse_page_header(head, 0)
        if case == "header":
            f.seek(off)
            f.write(b"\x0f" * 6)  # field type 15: not valid thrift
        else:  # flip bytes in the middle of the compressed page body
            f.seek(off + h.header_len + h.compressed_size // 2)
            f.write(bytes(b ^ 0x5A for b in head[h.header_len + h.compressed_size // 2:][:16]))
    s, _ = check_serves_rest(d, table, lost)
    q = s.quarantine.counts()
    assert q["pages"] == 1 and q["files"] == 0
    msg = s.quarantine.messages()[0]
    assert paths[1] in msg and "row group" in msg and "page" in msg and "'text'" in msg
    if case == "crc":
        assert q["by_kind"] == {"checksum": 1} and "CRC" in msg


def test_bad_page_does_not_break_seek(tmp_path):
    d, paths, table = good_source(tmp_path)
    _, _, off, ln, lost = _page_of(paths, 0, 2)
    with open(paths[0], "r+b") as f:
        f.seek(off + ln - 8)
        f.write(b"\x00" * 8)
    full = open_stream(spec(d), seed=7, buffer_rows=100).take(1500)
    # slots of the quarantined rows stay empty: positions skip them, so seek stays exact
    assert len(full.positions) == 1500 and (np.diff(full.positions) >= 1).all()
    holes = int(full.positions[-1]) + 1 - 1500
    n = len(table)  # epoch 0 fills slots [0, n): exactly the bad page's rows are missing there
    assert n - int((full.positions < n).sum()) == len(lost)
    assert len(lost) <= holes <= 2 * len(lost)  # the rest of the 1500 slots lie in epoch 1
    for i in (0, 300, 900, 1400):
        s = open_stream(spec(d), seed=7, buffer_rows=100)
        s.seek(int(full.positions[i]))
        r = s.take(50)
        k = min(50, 1500 - i)
        assert (r.keys[:k] == full.keys[i : i + k]).all()


def test_file_changed_after_indexing_is_quarantined_not_misread(tmp_path):
    d, paths, table = good_source(tmp_path)
    changed = set(_file_rows(paths, 2))
    s = open_stream(spec(d), seed=1, buffer_rows=100)
    with open(paths[2], "ab") as f:
        f.write(b"appended junk")
    r = s.take(len(table) - len(changed))
    got = set(r.columns["row"].to_numpy().tolist())
    assert got.isdisjoint(changed) and len(got) == len(table) - len(changed)
    assert (key_epoch(r.keys) == 0).all()
    fu = s.index.cols["text"]["file_first_unit"]  # (the file's own page arrays are released once folded in)
    n_pages = int(fu[3] - fu[2])
    assert s.quarantine.pages_total == n_pages  # every page of the changed file, each counted once
    assert "changed since it was indexed" in s.quarantine.messages()[0]


def test_odd_first_file_does_not_set_the_schema(tmp_path):
    """Only part-00 has another type: it is the one quarantined, not every correct file after it."""
    d, paths, table = good_source(tmp_path)
    t0 = pq.read_table(paths[0])
    # (a float column among int64 ones; int32 vs int64 alone would be unified, not refused)
    pq.write_table(t0.set_column(t0.column_names.index("row"), "row", t0.column("row").cast(pa.float64())), paths[0])
    s, _ = check_serves_rest(d, table, _file_rows(paths, 0), whole_files=True)
    assert s.quarantine.counts()["by_kind"] == {"type_mismatch": 1}
    assert paths[0] in s.quarantine.messages()[0] and "differ" in s.quarantine.messages()[0]


def test_file_whose_type_the_kind_cannot_read_is_quarantined_even_if_first_or_most(tmp_path):
    """A kind check comes before the majority: two of three files hold token ids as strings."""
    d = str(tmp_path / "src")
    os.makedirs(d)
    for k, ids in enumerate((["1 2", "3"], [[1, 2], [3]], ["4", "5 6"])):
        typ = pa.string() if isinstance(ids[0], str) else pa.list_(pa.int32())
        pq.write_table(pa.table({"ids": pa.array(ids, typ)}), os.path.join(d, f"part-{k:02d}.parquet"))
    s = open_stream(SourceSpec(name="tok", uri=d, columns=["ids"], kind="tokens"), seed=0, buffer_rows=10)
    assert [os.path.basename(f.path) for f in s.index.files] == ["part-01.parquet"]
    assert s.quarantine.counts()["by_kind"] == {"type_mismatch": 2}
    assert all("kind tokens reads list<integer>" in m for m in s.quarantine.messages())
    assert sorted(s.take(2).columns["ids"].to_pylist()) == [[1, 2], [3]]


def test_kind_accepts_the_types_its_transform_reads():
    ok = {"text": [pa.string(), pa.large_string(), pa.binary()],
          "tokens": [pa.list_(pa.int32()), pa.large_list(pa.int64()), pa.binary(), pa.large_binary()]}
    bad = {"text": [pa.int64(), pa.list_(pa.int32())], "tokens": [pa.string(), pa.list_(pa.float32()), pa.int32()]}
    assert all(pi.kind_accepts(k, 0, t) is None for k, ts in ok.items() for t in ts)
    assert all(pi.kind_accepts(k, 0, t) is not None for k, ts in bad.items() for t in ts)
    assert pi.kind_accepts("tokens", 1, pa.float64()) is None  # extra projected columns: any type


def _chunk_units(idx, col, file_k, rg):
    """(unit range, rows) of column ``col``'s chunk for row group ``rg`` of file ``file_k``."""
    a = idx.cols[col]
    c = int(np.flatnonzero((a["chunk_file"] == file_k) & (a["chunk_rg"] == rg))[0])
    r0 = int(a["chunk_row_start"][c])
    return (int(a["chunk_first_unit"][c]), int(a["chunk_first_unit"][c + 1])), list(range(r0, r0 + int(a["chunk_rows"][c])))


@pytest.mark.parametrize("col", ["text", "row"])
def test_corrupt_header_without_offset_index_loses_only_its_row_group(tmp_path, col):
    d = str(tmp_path / "src")
    paths, table = write_source(d, nfiles=3, rows=1200, page_index=False)  # 3 row groups a file
    idx = scan.build_source_index(paths, ["text", "row"], cache_dir=None)
    (u0, u1), lost = _chunk_units(idx, col, 1, 1)
    assert u1 - u0 >= 2  # corrupt the second page's header: the chunk's first page was fine
    primary_pages = int(idx.primary["unit_pages"][slice(*_chunk_units(idx, "text", 1, 1)[0])].sum())
    with open(paths[1], "r+b") as f:
        f.seek(int(idx.cols[col]["unit_off"][u0 + 1]))
        f.write(b"\x0f" * 6)  # field type 15: not valid thrift
    s, _ = check_serves_rest(d, table, lost)  # file 1's other row groups are still served
    q = s.quarantine.counts()
    assert q["files"] == 0 and q["by_kind"] == {"corrupt_page": 1} and len(s.index.files) == 3
    e = s.quarantine.entries[0]
    assert (e.file, e.row_group, e.column, e.page) == (paths[1], 1, col, 1)
    assert paths[1] in e.message and "row group 1" in e.message and "page 1" in e.message
    if col == "row":  # the first column's pages of that row group are known exactly
        assert q["pages"] == primary_pages
    else:  # estimated from the pages scanned before the bad header: at least those and the bad one
        assert 2 <= q["pages"] <= 2 * primary_pages


def test_quarantined_pages_count_the_pages_lost(tmp_path):
    d = str(tmp_path / "src")
    paths, table = write_source(d, nfiles=3, rows=1200)
    idx = scan.build_source_index(paths, ["text", "row"], cache_dir=None)
    file_pages = [int(idx.primary["unit_pages"][idx.primary["file_first_unit"][k]:idx.primary["file_first_unit"][k + 1]].sum())
                  for k in range(3)]
    t2 = pq.read_table(paths[2])  # a whole file of another type: all its pages are lost
    pq.write_table(t2.set_column(t2.column_names.index("row"), "row", t2.column("row").cast(pa.string())), paths[2],
                   data_page_size=2048, row_group_size=500, write_batch_size=50, use_dictionary=False)
    s = open_stream(spec(d), seed=0, buffer_rows=100)
    assert s.quarantine.counts()["pages"] == file_pages[2] > 1
    # missing column: the footer is read, its row groups (at least a page each) are counted
    pq.write_table(t2.drop_columns(["text"]), paths[2], row_group_size=500)
    s = open_stream(spec(str(d)), seed=0, buffer_rows=100, cache_dir=None)
    assert s.quarantine.counts()["pages"] == pq.ParquetFile(paths[2]).metadata.num_row_groups > 1
    # rowgroup mode: a bad page loses its whole row-group chunk, every page of it counted
    os.remove(paths[2])
    (u0, u1), lost = _chunk_units(idx, "text", 0, 1)
    with open(paths[0], "r+b") as f:
        f.seek(int(idx.primary["unit_off"][u0]) + int(idx.primary["unit_len"][u0]) - 8)
        f.write(b"\x00" * 8)
    s = open_stream(spec(d, "rowgroup"), seed=0, buffer_rows=100)
    s.take(sum(pq.ParquetFile(p).metadata.num_rows for p in paths[:2]) - len(lost))
    q = s.quarantine.counts()
    assert q["units"] == 1 and q["pages"] == int(idx.primary["unit_pages"][u0:u1].sum()) == u1 - u0 > 1

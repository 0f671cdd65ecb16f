"""Parquet files as pipelines write them (pyarrow with every encoding, DuckDB, Polars, fastparquet):
each decoded by the page reader equal to pyarrow's reading, and a directory of them read as one source."""

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mixplane.loader import indexscan as scan

from mixplane.loader import sourcereader as sr
from mixplane.loader import parquet as pr
from mixplane.loader.files import list_source_files, read_schema_names
from mixplane.loader.stream import open_stream
from mixplane.samples import key_epoch
from mixplane.spec import SourceSpec
from tests.unit.writer_zoo import (
    ALL_COLUMNS,
    FLAT_COLUMNS,
    WRITERS,
    reference_columns,
    write_zoo,
)


@pytest.fixture(autouse=True)
def _index_cache(monkeypatch):
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return write_zoo(str(tmp_path_factory.mktemp("zoo")))


def _encodings(path):
    md = pq.ParquetFile(path).metadata
    return {e for i in range(md.num_row_groups) for j in range(md.num_columns) for e in md.row_group(i).column(j).encodings}


def _read_all(path, columns):
    """Every row of a file through the index and the page reader (unit by unit, as the loader reads)."""
    idx = scan.build_source_index([path], columns, cache_dir=None)
    assert not idx.bad_files, idx.bad_files
    r = sr.SourceReader(idx)
    try:
        parts = {c: [] for c in columns}
        for ch in range(idx.num_chunks):
            r0 = int(idx.chunk_row_start[ch])
            got = r.read_rows(ch, r0, r0 + int(idx.chunk_rows[ch]))
            for c in columns:
                parts[c].append(got[c])
        return {c: pa.concat_arrays(v) for c, v in parts.items()}, idx
    finally:
        r.close()


def test_zoo_covers_every_encoding_and_both_page_versions(zoo):
    seen = set().union(*(_encodings(p) for _, p, _, _ in zoo))
    assert {"PLAIN", "RLE_DICTIONARY", "DELTA_BINARY_PACKED", "DELTA_LENGTH_BYTE_ARRAY", "DELTA_BYTE_ARRAY",
            "BYTE_STREAM_SPLIT"} <= seen
    kinds = set()
    for _, p, _, _ in zoo:
        rr = pr.RangeReader(p)
        meta = pr.read_file_meta(rr)
        ch = meta.row_groups[0].columns[0]
        kinds.add(pr.parse_page_header(rr.read_at(ch.data_page_offset, min(1 << 16, rr.size - ch.data_page_offset))).type)
        rr.close()
    assert {pr.DATA_PAGE, pr.DATA_PAGE_V2} <= kinds
    assert {n.split("-")[0] for n, *_ in zoo} == {"pyarrow", "duckdb", "polars", "fastparquet"}


@pytest.mark.parametrize("writer", [w[0] for w in WRITERS])
def test_every_zoo_file_decodes_equal_to_pyarrow(zoo, writer):
    _, path, cols, table = next(z for z in zoo if z[0] == writer)
    got, _ = _read_all(path, cols)
    exp = reference_columns(path, cols)
    for c in cols:
        assert got[c].type == exp[c].type, (writer, c)
        assert got[c].equals(exp[c]), (writer, c)
    # and the values are the rows that were written (the reference reading is not itself wrong)
    assert got["id"].to_pylist() == table.column("id").to_pylist()
    assert got["text"].to_pylist() == table.column("text").to_pylist()


def test_nested_columns_are_the_written_values(zoo):
    _, path, cols, table = zoo[3]  # pyarrow, DELTA encodings in data pages v2
    got, _ = _read_all(path, cols)
    meta = table.column("meta").combine_chunks()
    assert got["meta.url"].to_pylist() == [None if m is None else m["url"] for m in meta.to_pylist()]
    assert got["turns"].to_pylist() == table.column("turns").to_pylist()
    assert got["toks"].to_pylist() == table.column("toks").to_pylist()


def _one_epoch(d, columns, **kw):
    s = open_stream(SourceSpec(name="zoo", uri=d, columns=columns, kind="text", **kw), seed=3, buffer_rows=300)
    n = s.index.num_rows
    r = s.take(n)
    assert (key_epoch(r.keys) == 0).all()
    assert key_epoch(s.take(1).keys)[0] == 1
    return s, r


@pytest.mark.parametrize("mode", ["page", "rowgroup"])
def test_zoo_is_one_source(zoo, tmp_path, mode):
    """Files of every writer but fastparquet (no nested columns) in one directory: one source, nothing
    quarantined, every row once, each equal to pyarrow's reading cast to the source's types."""
    d = str(tmp_path / "src")
    os.makedirs(d)
    ref = {}
    for _, path, cols, _ in zoo:
        if cols == ALL_COLUMNS:
            os.link(path, os.path.join(d, os.path.basename(path)))
            ref[path] = reference_columns(path, ALL_COLUMNS)
    s, r = _one_epoch(d, ALL_COLUMNS, shuffle=mode)
    assert s.quarantine.counts()["units"] == 0, s.quarantine.messages()
    want = {c: s.index.col_info[i].arrow_type for i, c in enumerate(ALL_COLUMNS)}
    assert str(want["text"]) == "string" and str(want["toks"].value_type) == "int32"  # the majority's types
    exp = {c: pa.concat_arrays([ref[p][c].cast(want[c]) for p in sorted(ref)]) for c in ALL_COLUMNS}
    ids = r.columns["id"].to_numpy()
    assert sorted(ids.tolist()) == sorted(exp["id"].to_pylist())
    pos = {v: i for i, v in enumerate(exp["id"].to_pylist())}
    order = pa.array([pos[int(v)] for v in ids], pa.int64())
    for c in ALL_COLUMNS:
        assert r.columns[c].type == want[c], c
        assert r.columns[c].equals(exp[c].take(order)), c


def test_flat_columns_of_every_writer_are_one_source(zoo, tmp_path):
    d = str(tmp_path / "flat")
    os.makedirs(d)
    for _, path, _, _ in zoo:
        os.link(path, os.path.join(d, os.path.basename(path)))
    s, r = _one_epoch(d, FLAT_COLUMNS)
    assert s.quarantine.counts()["units"] == 0, s.quarantine.messages()
    assert len(s.index.files) == len(zoo)
    by_id = {}
    for _, path, _, _ in zoo:
        ref = reference_columns(path, FLAT_COLUMNS)
        by_id.update(zip(ref["id"].to_pylist(), ref["text"].to_pylist()))
    got = dict(zip(r.columns["id"].to_pylist(), r.columns["text"].to_pylist()))
    assert got == by_id


def _write(d, k, table, **kw):
    p = os.path.join(d, f"part-{k:02d}.parquet")
    pq.write_table(table, p, data_page_size=2048, row_group_size=300, **kw)
    return p


@pytest.mark.parametrize("wide_first", [False, True])
def test_files_differing_only_in_physical_type_are_unified(tmp_path, wide_first):
    """string / large_string, binary / large_binary, list<int32> / list<int64>: one source, delivered
    as the majority's types, values unchanged."""
    d = str(tmp_path / "mix")
    os.makedirs(d)
    rng = np.random.default_rng(0)
    narrow = pa.schema([("text", pa.string()), ("blob", pa.binary()), ("toks", pa.list_(pa.int32())), ("n", pa.int32())])
    wide = pa.schema([("text", pa.large_string()), ("blob", pa.large_binary()), ("toks", pa.list_(pa.int64())),
                      ("n", pa.int64())])
    schemas = [wide, narrow, narrow] if wide_first else [narrow, wide, narrow]
    rows, start = [], 0
    for k, sch in enumerate(schemas):
        n = 500 + 10 * k
        t = pa.table({"text": [f"row {start + i}" for i in range(n)],
                      "blob": [bytes([i % 256]) * (i % 7) for i in range(n)],
                      "toks": [list(map(int, rng.integers(0, 1 << 20, i % 9))) for i in range(n)],
                      "n": list(range(start, start + n))}).cast(sch)
        _write(d, k, t, use_dictionary=k != 1, data_page_version="2.0" if k else "1.0")
        rows.append(t.cast(narrow))
        start += n
    s, r = _one_epoch(d, ["text", "blob", "toks", "n"])
    assert s.quarantine.counts()["units"] == 0, s.quarantine.messages()
    assert [str(c.arrow_type) for c in s.index.col_info] == ["string", "binary", "list<item: int32>", "int32"]
    exp = pa.concat_tables(rows).combine_chunks()
    order = pa.array(np.asarray(r.columns["n"]), pa.int64())
    for c in ["text", "blob", "toks", "n"]:
        assert r.columns[c].type == exp.schema.field(c).type, c
        assert r.columns[c].equals(exp.column(c).chunk(0).take(order)), c


def test_token_ids_that_do_not_fit_the_source_type_are_quarantined_not_wrapped(tmp_path):
    d = str(tmp_path / "big")
    os.makedirs(d)
    for k in range(3):
        typ = pa.int64() if k == 2 else pa.int32()
        big = (1 << 40) if k == 2 else 1
        t = pa.table({"text": [f"{k}-{i}" for i in range(200)], "toks": pa.array([[i, big] for i in range(200)],
                                                                                   pa.list_(typ))})
        _write(d, k, t)
    s = open_stream(SourceSpec(name="big", uri=d, columns=["text", "toks"], kind="text"), seed=0, buffer_rows=50)
    r = s.take(400)
    assert (key_epoch(r.keys) == 0).all()
    assert all(t[1] == 1 for t in r.columns["toks"].to_pylist())  # never a wrapped 2^40
    msgs = s.quarantine.messages()
    assert msgs and all("part-02.parquet" in m and "toks" in m for m in msgs)


def test_struct_field_and_nested_list_columns_validate_by_path(zoo):
    path = zoo[0][1]
    names = read_schema_names(list_source_files(path), path)
    assert {"meta", "meta.url", "meta.score", "turns", "text"} <= set(names)
    meta = pr.read_file_meta(pr.RangeReader(path))
    with pytest.raises(pr.UnsupportedError, match="meta.url"):  # a struct of two leaves: name a field
        pr.resolve_columns(meta, ["meta"])
    with pytest.raises(pr.MissingColumnError, match="meta.nope"):
        pr.resolve_columns(meta, ["meta.nope"])

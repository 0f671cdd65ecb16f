"""The page decoder against pyarrow on the same files, and its building blocks."""

import itertools

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.loader_testdata import mixed_table
from mixplane.loader import indexscan as scan
from mixplane.loader import sourcereader as sr
from mixplane.loader import parquet as pr
from mixplane.loader.parquet import encodings
from mixplane.loader.parquet import thrift

TABLE = mixed_table(1500)


def decode_file(path, columns):
    rr = pr.RangeReader(path)
    try:
        meta = pr.read_file_meta(rr)
        cols = pr.resolve_columns(meta, columns)
        out = {c.name: [] for c in cols}
        for rg in meta.row_groups:
            for c in cols:
                ch = rg.columns[c.leaf]
                buf = rr.read_at(ch.start, ch.total_compressed_size)
                arrs = pr.decode_page_run(c, buf, ch.codec, None, expect_rows=rg.num_rows)
                out[c.name].extend(arrs)
        return {k: pa.concat_arrays(v) for k, v in out.items()}, rr.stats
    finally:
        rr.close()


@pytest.mark.parametrize("codec,dictionary,version,page_size,page_index",
                         [c for c in itertools.product(["snappy", "zstd", "gzip", "none"], [True, False], ["1.0", "2.0"],
                                                       [300, 1 << 20], [True, False])
                          if (c[3] == 300) == (c[4] is True) or c[0] == "snappy"])
def test_decoded_pages_equal_pyarrow(tmp_path, codec, dictionary, version, page_size, page_index):
    path = str(tmp_path / "t.parquet")
    pq.write_table(TABLE, path, compression=codec, use_dictionary=dictionary, data_page_version=version,
                   data_page_size=page_size, row_group_size=600, write_page_index=page_index, write_page_checksum=True)
    got, _ = decode_file(path, TABLE.column_names)
    ref = pq.read_table(path)
    for name in TABLE.column_names:
        exp = ref.column(name).combine_chunks()
        assert got[name].type == exp.type, name
        assert got[name].equals(exp), name


def test_brotli_lz4_and_no_checksum(tmp_path):
    for codec in ("brotli", "lz4"):
        path = str(tmp_path / f"{codec}.parquet")
        pq.write_table(TABLE, path, compression=codec, data_page_size=4096, write_page_checksum=False)
        got, _ = decode_file(path, ["text", "toks", "i64"])
        ref = pq.read_table(path, columns=["text", "toks", "i64"])
        for name in got:
            assert got[name].equals(ref.column(name).combine_chunks())


def test_legacy_two_level_list_and_required_columns(tmp_path):
    t = pa.table({"ids": pa.array([[1, 2], [], [3]] * 200, pa.list_(pa.field("x", pa.int32(), nullable=False))),
                  "r": pa.array(np.arange(600, dtype=np.int32))},
                 schema=pa.schema([pa.field("ids", pa.list_(pa.field("x", pa.int32(), nullable=False)), nullable=False),
                                   pa.field("r", pa.int32(), nullable=False)]))
    path = str(tmp_path / "l.parquet")
    pq.write_table(t, path, use_compliant_nested_type=False, data_page_size=256)
    got, _ = decode_file(path, ["ids", "r"])
    ref = pq.read_table(path)
    assert got["ids"].to_pylist() == ref.column("ids").to_pylist()
    assert got["r"].equals(ref.column("r").combine_chunks())


def test_reads_only_requested_columns(tmp_path):
    path = str(tmp_path / "t.parquet")
    pq.write_table(TABLE, path, data_page_size=2048)
    _, stats = decode_file(path, ["i64"])
    md = pq.ParquetFile(path).metadata
    i = TABLE.column_names.index("i64")
    chunk_bytes = sum(md.row_group(r).column(i).total_compressed_size for r in range(md.num_row_groups))
    footer = stats.bytes_read - chunk_bytes
    assert 0 < footer < 20_000  # footer + magic, never the other columns


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 32), st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=300))
def test_unpack_bits_matches_reference(width, values):
    vals = [v & ((1 << width) - 1) for v in values]
    acc = 0
    for i, v in enumerate(vals):
        acc |= v << (i * width)
    data = acc.to_bytes((len(vals) * width + 7) // 8 + 1, "little")
    assert pr.unpack_bits(data, width, len(vals)).tolist() == vals


def _hybrid_encode(runs, width):
    """runs: list of ('rle', value, count) / ('bp', [values multiple of 8])."""
    out = bytearray()

    def varint(n):
        while True:
            b = n & 0x7F
            n >>= 7
            out.append(b | (0x80 if n else 0))
            if not n:
                return

    for r in runs:
        if r[0] == "rle":
            varint(r[2] << 1)
            out.extend(r[1].to_bytes((width + 7) // 8, "little"))
        else:
            vals = r[1]
            varint(((len(vals) // 8) << 1) | 1)
            acc = 0
            for i, v in enumerate(vals):
                acc |= v << (i * width)
            out.extend(acc.to_bytes(len(vals) * width // 8, "little"))
    return bytes(out)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 20), st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 2**20)), min_size=1, max_size=12))
def test_hybrid_decoding_mixed_runs(width, spec):
    mask = (1 << width) - 1
    runs, expect = [], []
    for is_rle, n, v in spec:
        if is_rle:
            runs.append(("rle", v & mask, n))
            expect += [v & mask] * n
        else:
            vals = [(v * (i + 1) * 2654435761) & mask for i in range(8 * ((n + 7) // 8))]
            runs.append(("bp", vals))
            expect += vals
    buf = _hybrid_encode(runs, width)
    got = pr.decode_hybrid(buf, 0, len(buf), width, len(expect))
    assert got.tolist() == expect


def test_hybrid_rejects_truncated_data():
    buf = _hybrid_encode([("bp", list(range(16)))], 5)
    with pytest.raises(ValueError):
        pr.decode_hybrid(buf[:4], 0, 4, 5, 16)


def test_thrift_roundtrip_and_errors():
    w = thrift.CompactWriter()
    w.struct([(1, thrift.I32, -5), (2, thrift.BINARY, "héllo"), (3, thrift.LIST, (thrift.I64, [1, 2**40, -3])),
              (20, thrift.STRUCT, [(1, thrift.TRUE, True)]), (21, thrift.I64, 7)])
    s, end = thrift.read_struct(bytes(w.out))
    assert s == {1: -5, 2: "héllo".encode(), 3: [1, 2**40, -3], 20: {1: True}, 21: 7}
    assert end == len(w.out)
    with pytest.raises(thrift.ThriftError):
        thrift.read_struct(bytes(w.out)[:-3])
    with pytest.raises(thrift.ThriftError):
        thrift.read_struct(b"\x1d")  # field type 13 does not exist


def test_page_header_parse_of_real_file(tmp_path):
    path = str(tmp_path / "t.parquet")
    pq.write_table(TABLE, path, data_page_version="2.0", write_page_checksum=True)
    md = pq.ParquetFile(path).metadata.row_group(0).column(0)
    with open(path, "rb") as f:
        f.seek(md.data_page_offset)
        buf = f.read(256)
    h = pr.parse_page_header(buf, 0)
    assert h.type in (pr.DATA_PAGE_V2, pr.DICTIONARY_PAGE)
    assert h.crc is not None and h.compressed_size > 0


@pytest.mark.parametrize("dictionary,version", [(False, "1.0"), (True, "1.0"), (False, "2.0"), (True, "2.0")])
def test_selected_rows_of_a_page_equal_taking_them(tmp_path, dictionary, version):
    """Decoding only some rows of a page (page splits) gives exactly those rows, for every type,
    with and without nulls (pages with nulls or lists decode fully, then take)."""
    path = str(tmp_path / "t.parquet")
    pq.write_table(TABLE, path, use_dictionary=dictionary, data_page_version=version, data_page_size=2048,
                   row_group_size=600, write_page_index=True)
    rr = pr.RangeReader(path)
    meta = pr.read_file_meta(rr)
    rng = np.random.default_rng(0)
    for c in pr.resolve_columns(meta, TABLE.column_names):
        ch = meta.row_groups[0].columns[c.leaf]
        off, size, _ = pr.read_offset_index(rr, ch)
        dictionary_ = None
        if off[0] > ch.start:
            dictionary_ = pr.read_dictionary(c, rr.read_at(ch.start, int(off[0] - ch.start)), ch.codec)
        for k in range(min(4, len(off))):
            buf = rr.read_at(int(off[k]), int(size[k]))
            full = pa.concat_arrays(pr.decode_page_run(c, buf, ch.codec, dictionary_))
            for sel in (np.arange(0, len(full), 3), np.sort(rng.choice(len(full), len(full) // 2, replace=False)),
                        np.zeros(0, np.int64)):
                got = pr.decode_page_run(c, buf, ch.codec, lambda: dictionary_, select=sel, expect_rows=len(full))
                assert len(got) == 1 and got[0].equals(full.take(pa.array(sel, pa.int64()))), (c.name, k)
    rr.close()


def test_dictionary_page_read_only_for_dictionary_encoded_pages(tmp_path):
    """A chunk whose dictionary filled up falls back to PLAIN: reading a PLAIN page of it does not
    read (or keep) the dictionary page."""
    from mixplane.loader import indexscan as scan
    from mixplane.loader import sourcereader as sr
    words = [f"w{i:06d}" + "x" * 200 for i in range(4000)]  # all distinct: the dictionary overflows
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"t": words}), path, use_dictionary=True, dictionary_pagesize_limit=64 << 10,
                   data_page_size=16 << 10, write_page_index=True)
    idx = scan.build_source_index([path], ["t"], cache_dir=None)
    assert int(idx.primary["chunk_dict_len"][0]) > 0
    stats = pr.IOStats()
    rd = sr.SourceReader(idx, stats=stats)
    last = idx.num_units - 1  # a PLAIN page after the fallback
    r0 = int(idx.unit_row_start[last])
    got = rd.read_rows(0, r0, r0 + int(idx.unit_rows[last]), (last, last + 1))["t"]
    assert got.to_pylist() == words[r0:]
    assert stats.bytes_read == int(idx.primary["unit_len"][last]) and rd._dicts.nbytes == 0
    first = rd.read_rows(0, 0, int(idx.unit_rows[0]), (0, 1))["t"]  # dictionary-encoded: needs it
    assert first.to_pylist() == words[: int(idx.unit_rows[0])] and rd._dicts.nbytes > 0
    rd.close()


def test_dictionary_pages_are_read_once_per_chunk_in_random_page_order(tmp_path):
    """A dictionary-encoded list<int32> column of many row groups whose decoded dictionaries exceed
    the old fixed 8 MB cache: each dictionary page is read once however the pages are visited."""
    rng = np.random.default_rng(0)
    n_rg, rows, distinct = 48, 1600, 48_000  # 192 KB of decoded int32 dictionary per chunk, ~9 MB in all
    toks = [g * distinct + rng.permutation(distinct).astype(np.int32) for g in range(n_rg)]  # each id once
    vals = np.concatenate(toks).reshape(-1)
    arr = pa.ListArray.from_arrays(pa.array(np.arange(0, len(vals) + 1, 30, dtype=np.int32)), pa.array(vals))
    path = str(tmp_path / "dict.parquet")
    pq.write_table(pa.table({"t": arr}), path, row_group_size=rows, use_dictionary=True, data_page_size=64 << 10,
                   dictionary_pagesize_limit=4 << 20)
    idx = scan.build_source_index([path], ["t"], cache_dir=None)
    a = idx.primary
    with_dict = int((a["chunk_dict_len"] > 0).sum())
    assert with_dict == n_rg and int(np.diff(a["chunk_first_unit"]).min()) >= 2
    r = sr.SourceReader(idx)
    order = rng.permutation(idx.num_units)
    for _ in range(2):  # two epochs of random page order
        for u in order.tolist():
            c = int(idx.chunk_of_units([u])[0])
            r.read_units(idx.col_info[0], c, u, u + 1)
    assert r.dict_reads == with_dict
    # a reader given a small budget re-reads (the count is what it claims)
    small = sr.SourceReader(idx, dict_cache_bytes=1 << 20)
    for u in order[:200].tolist():
        small.read_units(idx.col_info[0], int(idx.chunk_of_units([u])[0]), u, u + 1)
    assert small.dict_reads > len({int(c) for c in idx.chunk_of_units(order[:200])})
    want = pq.read_table(path).column("t").combine_chunks()
    u = int(order[0])
    got = r.read_units(idx.col_info[0], int(idx.chunk_of_units([u])[0]), u, u + 1)
    r0 = int(idx.unit_row_start[u])
    assert got.equals(want.slice(r0, len(got)))


def _plain_byte_array_reference(buf, pos, end, n, select=None):
    """The former per-value loop (kept here as the reference the vectorised decoder must match)."""
    starts, p = [], pos
    for _ in range(n):
        if p > end - 4:
            raise ValueError("BYTE_ARRAY data ends early")
        starts.append(p)
        p += 4 + int.from_bytes(buf[p : p + 4], "little")
    if p > end:
        raise ValueError("BYTE_ARRAY value runs past the end of the page")
    vals = [bytes(buf[q + 4 : q + 4 + int.from_bytes(buf[q : q + 4], "little")]) for q in starts]
    if select is not None:
        vals = [vals[i] for i in select]
    offsets = np.concatenate([[0], np.cumsum([len(v) for v in vals], dtype=np.int64)]).astype(np.int64)
    return offsets, np.frombuffer(b"".join(vals), np.uint8)


@pytest.mark.parametrize("mean_len", [0, 3, 40, 3000])
@pytest.mark.parametrize("few", [True, False])  # both decoders: the short loop and Arrow's reader
def test_plain_byte_array_matches_the_reference_loop(mean_len, few):
    rng = np.random.default_rng(mean_len)
    n = int(rng.integers(1, encodings.PLAIN_LOOP_MAX_VALUES)) if few else int(rng.integers(encodings.PLAIN_LOOP_MAX_VALUES + 1, 3000))
    vals = [rng.bytes(int(rng.integers(0, 2 * mean_len + 1))) for _ in range(n)]
    body = b"".join(len(v).to_bytes(4, "little") + v for v in vals)
    buf, pos = b"junk" + body + b"tail", 4  # values inside a larger buffer
    sel = np.sort(rng.choice(n, max(1, n // 3), replace=False))
    for s in (None, sel):
        want = _plain_byte_array_reference(buf, pos, pos + len(body), n, s)
        got = encodings._plain_byte_array(buf, pos, pos + len(body), n, s)
        assert got[0].dtype == np.int64 and (got[0] == want[0]).all() and (got[1] == want[1]).all()
    with pytest.raises(ValueError):  # the last value runs past the page
        encodings._plain_byte_array(buf, pos, pos + len(body) - 1, n)
    with pytest.raises(ValueError):  # fewer values than the header says
        encodings._plain_byte_array(buf, pos, pos + len(body), n + 1)
